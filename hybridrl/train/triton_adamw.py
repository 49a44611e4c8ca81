"""Triton kernel for precision.CompensatedAdamW: the whole step of one parameter in one pass.

The PyTorch path (`CompensatedAdamW._update`) makes ~25 fp32 passes over each slice and launches
~25 kernels per slice; this kernel reads weight, compensation, m, v and gradient once (10 bytes
per bf16 parameter) and writes weight, compensation, m and v (8 bytes), with no temporaries. The
arithmetic is the PyTorch path's, operation for operation (up to fused multiply-adds); the
stochastic rounding bits come from Philox keyed by a per-tensor seed that the optimizer draws
from its own generator.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: CompensatedAdamW uses the PyTorch path
    triton = None

BLOCK = 2048
NUM_WARPS = 8


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit(do_not_specialize=["seed"])
    def _step_kernel(
        p_ptr, comp_ptr, m_ptr, v_ptr, g_ptr, n, seed, lerp_w, b2, one_minus_b2, eps, decay, neg_step_size, bc2_sqrt,
        STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # int32: the caller keeps n < 2**31
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        c = tl.load(comp_ptr + offs, mask=mask, other=0.0)
        m = m + lerp_w * (g - m)
        v = v * b2 + one_minus_b2 * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        x = (p.to(tl.float32) + c.to(tl.float32)) * decay
        x = x + neg_step_size * tl.div_rn(m, denom)
        p_new = x.to(p.dtype)  # round to nearest even
        tl.store(p_ptr + offs, p_new, mask=mask)
        tl.store(comp_ptr + offs, (x - p_new.to(tl.float32)).to(c.dtype), mask=mask)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
        if STOCHASTIC:  # v to bf16: add 16 random bits to the fp32 pattern, truncate; inf/NaN unchanged
            bits = v.to(tl.uint32, bitcast=True)
            noise = tl.randint(seed, offs).to(tl.uint32, bitcast=True) & 0xFFFF
            rounded = (((bits + noise) >> 16) << 16).to(tl.float32, bitcast=True)
            v = tl.where((bits & 0x7F800000) != 0x7F800000, rounded, v)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)


def step(p: torch.Tensor, comp: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, *, seed: int,
         lr: float, weight_decay: float, b1: float, b2: float, eps: float, step: int) -> None:
    """One CompensatedAdamW step of one contiguous CUDA parameter (fewer than 2**31 elements), in place."""
    n = p.numel()
    _step_kernel[(triton.cdiv(n, BLOCK),)](
        p, comp, m, v, grad, n, seed, 1 - b1, b2, 1 - b2, eps, 1 - lr * weight_decay, -lr / (1 - b1**step),
        (1 - b2**step) ** 0.5, STOCHASTIC=v.dtype == torch.bfloat16, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip
