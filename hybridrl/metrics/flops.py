"""FLOPs of the trainer's passes and model FLOPs utilisation (MFU).

Counted from what the passes compute (`train.packing.Work`): tokens through the decoder, tokens
through the lm_head (response tokens only), and attention (query, key) pairs:

    forward = 2 * N_matmul * tokens + 2 * d_model * vocab * logit_tokens + 4 * d_attn * layers * pairs
    train   = 3 * forward   (backward = 2 x forward; recomputation for gradient checkpointing is not counted)

N_matmul is the parameters of the decoder's matrix products (embeddings excluded: a lookup is no
matmul; the lm_head is the second term). Packed prompts count once, padding never: MFU is the
useful work per second. Peak: the dense bf16 tensor-core figure of the GPU's datasheet (H100/H200
SXM: 989 TFLOP/s), as MFU is conventionally quoted; BENCHMARK.md's measured 790 TFLOP/s on the H200
(a large square matmul) is ~80% of it.
"""

from __future__ import annotations

import torch

# Dense (no sparsity) bf16 tensor-core peak in FLOP/s, by a substring of torch.cuda.get_device_name().
PEAK_BF16_FLOPS = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
]


def peak_flops(device: torch.device) -> float | None:
    """The bf16 peak of `device`, or None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters of the decoder's matrix products: 2-D weights other than the input and output embeddings."""
    skip = {id(model.get_input_embeddings().weight)}
    head = model.get_output_embeddings()
    if head is not None:
        skip.add(id(head.weight))
    return sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in skip)


def forward_flops(model: torch.nn.Module, work) -> float:
    """FLOPs of a forward pass that did `work` (a `train.packing.Work`)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    d_attn = cfg.num_attention_heads * head_dim
    return (
        2.0 * matmul_params(model) * work.tokens
        + 2.0 * cfg.hidden_size * cfg.vocab_size * work.logit_tokens
        + 4.0 * d_attn * cfg.num_hidden_layers * work.attention_pairs
    )


def mfu(flops: float, seconds: float, device: torch.device) -> float | None:
    """Fraction of the device's bf16 peak that `flops` in `seconds` achieved; None where unknown."""
    peak = peak_flops(device)
    if peak is None or seconds <= 0:
        return None
    return flops / seconds / peak
