"""Random-init models of real shapes, for benchmarks on machines that cannot download weights.

`random_model("0.5B", "cuda")` is a Qwen2 with Qwen2.5-0.5B's shape (BENCHMARK.md's W0.5B), seeded
so every benchmark and every run builds the same weights; "1.5B" is Qwen2.5-1.5B's shape, "tiny" a
two-layer toy for CPU smoke runs. The weights are created on `device` directly (seconds on a GPU).
"""

from __future__ import annotations

import torch
import transformers

SHAPES = {
    "0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
    "1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1000),
}  # fmt: skip


def random_model(shape: str, device: str | torch.device, *, cls=transformers.Qwen2ForCausalLM, seed: int = 42, **config):
    """A `cls` (Qwen2 causal LM by default) of `SHAPES[shape]` with tied embeddings, random init
    (seed 42), in bf16 on CUDA and fp32 elsewhere, in eval mode. `config` overrides Qwen2Config fields."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    cfg = transformers.Qwen2Config(**{**SHAPES[shape], "tie_word_embeddings": True, "max_position_embeddings": 32768, **config})
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(cfg)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return model.to(dtype).eval()
