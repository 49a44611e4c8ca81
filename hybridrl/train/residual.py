"""An fp32 residual stream for a bf16 HF decoder (`train.fp32_residual`).

A bf16 decoder rounds its residual stream to bf16 after every attention and MLP block: 2 roundings
per layer, each losing the low bits of the small update added to a large running sum. Carrying
the stream in fp32 removes them (Megatron-LM's `fp32_residual_connection`); the projections,
attention and MLP still run in bf16 on bf16 inputs, so the cost is a few elementwise ops and, with
gradient checkpointing, fp32 instead of bf16 for each layer's saved input.

The native rollout engine does the same (`rollout.fp32_residual`), so with both on the trainer's
log-probs and the rollout's share their rounding points (bench/logprob_parity.py measures it).

`enable_fp32_residual(model)` changes three things on a Llama / Qwen2 / Qwen3 / Mistral-style model:
the token embeddings come out in fp32 (so `residual + block(x)` stays fp32); every RMSNorm takes
fp32 or bf16 input and returns the weight's dtype (normalised in fp32, rounded, then scaled, as HF
does for bf16 input); the rotary tables stay in the weight dtype. Nothing else in the model changes.
"""

from __future__ import annotations

import torch

from hybridrl.models.norms import rms_norm

_FLAG = "_hybridrl_fp32_residual"


class RMSNormToWeightDtype(torch.nn.Module):
    """RMSNorm that accepts an fp32 or bf16 stream and returns the weight's dtype. It holds the
    replaced norm's own `weight` Parameter (same object, same state-dict key)."""

    def __init__(self, weight: torch.nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _embeddings_to_fp32(module, inputs, output: torch.Tensor) -> torch.Tensor:
    return output.float()


def _make_rotary_hook(dtype: torch.dtype):
    def hook(module, inputs, output):
        return tuple(t.to(dtype) for t in output)

    return hook


_NORM_SLOTS = ("input_layernorm", "post_attention_layernorm")


def _norm_slots(base: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """(parent module, attribute name) of the final norm and every layer's two norms."""
    return [(base, "norm")] + [(layer, name) for layer in base.layers for name in _NORM_SLOTS]


def enable_fp32_residual(model: torch.nn.Module) -> None:
    """Carries `model`'s residual stream in fp32 from now on (idempotent). fp32 models are unchanged."""
    base = getattr(model, model.base_model_prefix, model)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if not all(hasattr(base, name) for name in needed) or not all(
        hasattr(getattr(parent, name, None), "variance_epsilon") for parent, name in _norm_slots(base)
    ):
        raise ValueError(
            f"train.fp32_residual supports Llama / Qwen2 / Qwen3 / Mistral-style decoders (embed_tokens, "
            f"layers with input_layernorm / post_attention_layernorm RMSNorms, norm, rotary_emb); "
            f"{type(model).__name__} is not one: set train.fp32_residual=false"
        )
    if getattr(base, _FLAG, False):
        return
    dtype = base.embed_tokens.weight.dtype
    if dtype == torch.float32:
        return
    base.embed_tokens.register_forward_hook(_embeddings_to_fp32)
    base.rotary_emb.register_forward_hook(_make_rotary_hook(dtype))
    for parent, name in _norm_slots(base):
        old = getattr(parent, name)
        setattr(parent, name, RMSNormToWeightDtype(old.weight, old.variance_epsilon))
    setattr(base, _FLAG, True)


def has_fp32_residual(model: torch.nn.Module) -> bool:
    return bool(getattr(getattr(model, model.base_model_prefix, model), _FLAG, False))
