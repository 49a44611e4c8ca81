"""Model and tokenizer loading, the tiny demo model."""

from hybridrl.models.loading import (
    ModelLoadError,
    load_causal_lm,
    load_critic,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)

__all__ = ["ModelLoadError", "load_causal_lm", "load_critic", "load_tokenizer", "resolve_device", "resolve_dtype"]
