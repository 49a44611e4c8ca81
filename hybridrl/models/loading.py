"""Load HF models and tokenizers with the fixes every RL run needs, and nothing for the user to write."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer, PreTrainedTokenizerBase

log = logging.getLogger("hybridrl.models")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """A model or tokenizer that cannot be loaded; the message names the path and the fix."""


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} was asked for but no CUDA GPU is visible; set train.device=cpu (or auto)")
    return dev


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device` without stalling the host: a copy from pageable CPU memory to a GPU first waits
    for the whole stream to drain (CUDA's rule for pageable transfers), so CPU tensors go through
    pinned memory (PyTorch's caching host allocator keeps the buffer until the copy is done)."""
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on GPU and fp32 on CPU (CPU bf16 matmuls are slow and imprecise)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def check_model_path(path: str) -> None:
    """A local-looking path that does not exist is almost always a typo: say so before the Hub is tried."""
    p = Path(path)
    looks_local = path.startswith((".", "/", "~")) or p.exists() or path.count("/") > 1
    if looks_local and not p.expanduser().exists():
        raise ModelLoadError(f"model path {path} does not exist (cwd {Path.cwd()}); set model.path to a local model directory or a Hub id like Qwen/Qwen2.5-0.5B")
    if p.is_dir() and not (p / "config.json").is_file():
        raise ModelLoadError(f"model directory {path} has no config.json: it is not a HuggingFace model directory (export a checkpoint with `hybridrl export`)")


def load_tokenizer(path: str, *, trust_remote_code: bool = False, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """Loads a tokenizer, adds a pad token if missing, pads on the left for generation."""
    check_model_path(path)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load the tokenizer from {path}: {e}") from None
    if tok.pad_token is None:
        # Reusing EOS for padding is safe: padding is always masked out by attention and losses.
        tok.pad_token = tok.eos_token
        log.info("tokenizer of %s has no pad token; using eos %r", path, tok.eos_token)
    if tok.eos_token is None:
        raise ModelLoadError(f"tokenizer of {path} has no eos token, so responses could never end; set one in its tokenizer_config.json")
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.padding_side = "left"
    return tok


def load_causal_lm(
    path: str,
    *,
    dtype: str = "auto",
    device: str | torch.device = "auto",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """Loads a causal LM onto the device in the resolved dtype, in eval mode."""
    check_model_path(path)
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    kwargs = {"dtype": resolve_dtype(dtype, dev), "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load a causal LM from {path}: {e}") from None
    return model.to(dev).eval()


def load_critic(
    path: str,
    *,
    dtype: str = "auto",
    device: str | torch.device = "auto",
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """A value model: the same architecture with a scalar head on every token.

    `AutoModelForTokenClassification(num_labels=1)` is exactly that and saves as a normal HF
    directory. The head starts at zero so the first value estimates are 0, not noise.
    """
    check_model_path(path)
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    try:
        config = AutoConfig.from_pretrained(path, num_labels=1, trust_remote_code=trust_remote_code)
        config.classifier_dropout = 0.0  # values must be deterministic functions of the input
        model = AutoModelForTokenClassification.from_pretrained(
            path, config=config, dtype=resolve_dtype(dtype, dev), trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load a critic (token-classification model) from {path}: {e}") from None
    if not getattr(model.config, "hybridrl_value_head", False):
        # A fresh head (loaded from a causal LM): start at zero. A saved critic keeps its head.
        head = model.get_output_embeddings() or model.score
        torch.nn.init.zeros_(head.weight)
        if head.bias is not None:
            torch.nn.init.zeros_(head.bias)
        model.config.hybridrl_value_head = True
    return model.to(dev).eval()
