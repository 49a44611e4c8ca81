"""Views of a HuggingFace decoder's weights, in the layout the native forward reads.

Nothing here copies a parameter: every field is the module's own tensor, so an optimizer step on
the trainer's model is seen by the next generate call with no transfer (DESIGN.md, principle 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# `*ForCausalLM` classes whose decoder is the Llama block: pre-norm RMSNorm, rotary attention with
# grouped KV heads (Qwen3 adds an RMSNorm on each q / k head), SwiGLU MLP.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
}
# Rope types whose cos / sin depend on the position alone; "dynamic" rescales with the sequence
# length at run time, which a fixed table cannot follow.
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope"}


def supports(model: nn.Module) -> bool:
    """True when the native forward reproduces `model` (architecture and rope type)."""
    if type(model).__name__ not in SUPPORTED_ARCHITECTURES:
        return False
    rope_type = model.model.rotary_emb.rope_type
    return rope_type in STATIC_ROPE_TYPES


@dataclass
class LayerWeights:
    """One decoder layer's tensors (references into the HF module, never copies)."""

    input_norm: torch.Tensor  # [H]
    q_w: torch.Tensor  # [Hq * D, H]
    q_b: torch.Tensor | None
    k_w: torch.Tensor  # [Hkv * D, H]
    k_b: torch.Tensor | None
    v_w: torch.Tensor
    v_b: torch.Tensor | None
    o_w: torch.Tensor  # [H, Hq * D]
    o_b: torch.Tensor | None
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor  # [H]
    gate_w: torch.Tensor  # [I, H]
    up_w: torch.Tensor
    down_w: torch.Tensor  # [H, I]


@dataclass
class DecoderSpec:
    """Shapes and constants of the decoder, read once from the config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float
    scaling: float  # softmax scale of attention (head_dim ** -0.5)
    sliding_window: int | None  # None: full attention everywhere


class DecoderWeights:
    """The weights of a supported `*ForCausalLM`, re-read from the module on every call."""

    def __init__(self, model: nn.Module):
        if not supports(model):
            raise ValueError(
                f"the native rollout backend does not support {type(model).__name__}; "
                f"use backend='hf' (supported: {sorted(SUPPORTED_ARCHITECTURES)})"
            )
        self.model = model
        cfg = model.config
        attn = model.model.layers[0].self_attn
        self.spec = DecoderSpec(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=attn.head_dim,
            vocab_size=cfg.vocab_size,
            rms_eps=cfg.rms_norm_eps,
            scaling=attn.scaling,
            sliding_window=_sliding_window(cfg),
        )

    def layers(self) -> list[LayerWeights]:
        """The layer tensors as the module holds them now (cheap: a list of references)."""
        out = []
        for layer in self.model.model.layers:
            a, m = layer.self_attn, layer.mlp
            q_norm = getattr(a, "q_norm", None)
            k_norm = getattr(a, "k_norm", None)
            out.append(
                LayerWeights(
                    input_norm=layer.input_layernorm.weight,
                    q_w=a.q_proj.weight, q_b=a.q_proj.bias,
                    k_w=a.k_proj.weight, k_b=a.k_proj.bias,
                    v_w=a.v_proj.weight, v_b=a.v_proj.bias,
                    o_w=a.o_proj.weight, o_b=a.o_proj.bias,
                    q_norm=None if q_norm is None else q_norm.weight,
                    k_norm=None if k_norm is None else k_norm.weight,
                    post_norm=layer.post_attention_layernorm.weight,
                    gate_w=m.gate_proj.weight, up_w=m.up_proj.weight, down_w=m.down_proj.weight,
                )
            )  # fmt: skip
        return out

    @property
    def embed(self) -> torch.Tensor:
        return self.model.model.embed_tokens.weight  # [V, H]

    @property
    def final_norm(self) -> torch.Tensor:
        return self.model.model.norm.weight

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.lm_head.weight  # [V, H]; the embedding itself when tied

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the forward reads: their addresses key the captured CUDA graphs."""
        ts = [self.embed, self.final_norm, self.lm_head]
        for lw in self.layers():
            ts.extend(t for t in vars(lw).values() if t is not None)
        return ts

    def rope_tables(self, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos / sin halves [P, D/2] from the model's own rotary module (so its rope
        scaling, e.g. llama3 or yarn, and attention factor apply exactly as in HF)."""
        rotary = self.model.model.rotary_emb
        pos = torch.arange(max_positions, device=self.device)[None]
        dummy = torch.empty(0, device=self.device, dtype=torch.float32)
        cos, sin = rotary(dummy, pos)  # [1, P, D], the two halves equal
        half = self.spec.head_dim // 2
        return cos[0, :, :half].float().contiguous(), sin[0, :, :half].float().contiguous()


def _sliding_window(cfg) -> int | None:
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and "sliding_attention" in layer_types:
        return cfg.sliding_window
    if type(cfg).__name__ == "MistralConfig":
        return cfg.sliding_window
    return None
