"""Triton kernels for lm_head.py: one pass over a chunk of logits for the statistics, one for the gradient,
and the in-place scaling of the gradients made in the forward pass by the backward's incoming gradient.

The PyTorch reference (lm_head.logit_stats_torch / logit_grad_torch) makes about ten fp32 passes over
`[c, V]`; these read the model-dtype logits once (and write the gradient over them), which is what
keeps the log-prob phase off the memory-bandwidth floor at a 152k vocabulary.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: lm_head.py uses the PyTorch path
    triton = None

BLOCK_V = 4096  # the gradient kernel's columns per iteration
STATS_BLOCK_V = 2048  # the statistics kernel's (H200, 1024 x 151936 bf16: 124 us against 126 at 4096)
NUM_WARPS = 8
GRAD_NUM_WARPS = 16  # (the same: 169 us against 180 with 8 warps)
SCALE_BLOCK = 4096  # elements per program of the scaling kernels
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _stats_kernel(logits_ptr, stride, labels_ptr, lse_ptr, lp_ptr, ent_ptr, inv_temp, V: tl.constexpr, BLOCK: tl.constexpr):
        # Each lane keeps its own online-softmax state over the columns it reads, in log2 units
        # (y = z * log2(e)): max m, sum of 2^(y - m), sum of 2^(y - m) * y. Nothing is reduced across
        # the program until the end, and one exp2 per element (2^-|y - m| serves both cases: a new
        # lane maximum rescales the sums, any other element adds to them).
        LN2: tl.constexpr = 0.6931471805599453
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        to_log2 = inv_temp * 1.4426950408889634
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        a = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            valid = cols < V
            y = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) * to_log2
            d = tl.where(valid, y - m, float("-inf"))  # +inf at a lane's first element
            up = d > 0
            t = tl.exp2(-tl.abs(d))  # 0 for padding (and for a lane's first element)
            s = tl.where(up, s * t + 1.0, s + t)
            a = tl.where(up, a * t + y, a + t * y)
            m = tl.where(up, y, m)
        m_row = tl.max(m, 0)
        w = tl.exp2(m - m_row)  # 0 for a lane that read no column
        s_row = tl.sum(s * w, 0)
        lse = (m_row + tl.log2(s_row)) * LN2
        label = tl.load(labels_ptr + row)
        z_label = tl.load(base + label).to(tl.float32) * inv_temp
        tl.store(lse_ptr + row, lse)
        tl.store(lp_ptr + row, z_label - lse)
        tl.store(ent_ptr + row, lse - tl.sum(a * w, 0) / s_row * LN2)

    @triton.jit
    def _grad_kernel(
        logits_ptr, stride, labels_ptr, lse_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, inv_temp, V: tl.constexpr,
        HAS_LP: tl.constexpr, HAS_ENT: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        lse = tl.load(lse_ptr + row)
        label = tl.load(labels_ptr + row)
        g_lp = 0.0
        g_ent = 0.0
        centre = 0.0  # sum_j p_j z_j = logsumexp - entropy
        if HAS_LP:
            g_lp = tl.load(g_lp_ptr + row)
        if HAS_ENT:
            g_ent = tl.load(g_ent_ptr + row)
            centre = lse - tl.load(ent_ptr + row)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            valid = cols < V
            z = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) * inv_temp
            p = tl.exp(z - lse)
            grad = tl.where(cols == label, g_lp, 0.0) - g_lp * p
            if HAS_ENT:
                grad += g_ent * p * (centre - z)
            tl.store(base + cols, (grad * inv_temp).to(logits_ptr.dtype.element_ty), mask=valid)


    @triton.jit
    def _scale_kernel(x_ptr, g_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        g = tl.load(g_ptr).to(x.dtype).to(tl.float32)  # as PyTorch casts a 0-dim operand to the result's dtype
        tl.store(x_ptr + offs, (x.to(tl.float32) * g).to(x.dtype), mask=mask)

    @triton.jit
    def _scale_add_kernel(dst_ptr, src_ptr, g_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        s = tl.load(src_ptr + offs, mask=mask)
        g = tl.load(g_ptr).to(s.dtype).to(tl.float32)
        s = (s.to(tl.float32) * g).to(s.dtype)  # rounded as src.mul_(g) rounds, then added
        d = tl.load(dst_ptr + offs, mask=mask)
        tl.store(dst_ptr + offs, (d.to(tl.float32) + s.to(tl.float32)).to(d.dtype), mask=mask)


def logit_stats(logits: torch.Tensor, labels: torch.Tensor, inv_temp: float, out=None):
    """(logsumexp, log-prob, entropy) per row, fp32; written into `out` (three contiguous fp32
    vectors, e.g. slices of the whole batch's) when given, saving a copy per chunk."""
    assert logits.stride(-1) == 1
    rows, V = logits.shape
    if out is None:
        out = tuple(torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3))
    lse, lp, ent = out
    assert all(t.dtype == torch.float32 and t.is_contiguous() and t.numel() == rows for t in out)
    if rows:
        _stats_kernel[(rows,)](
            logits, logits.stride(0), labels, lse, lp, ent, inv_temp, V=V, BLOCK=STATS_BLOCK_V, num_warps=NUM_WARPS
        )
    return lse, lp, ent


def logit_grad_(logits: torch.Tensor, labels, lse, entropy, g_lp, g_ent, inv_temp: float) -> torch.Tensor:
    """Overwrites `logits` with the gradient (see lm_head.logit_grad_torch) and returns it."""
    assert logits.stride(-1) == 1
    rows, V = logits.shape
    dummy = lse  # unused pointer when a gradient is absent
    g_lp_f = g_lp.float().contiguous() if g_lp is not None else dummy
    g_ent_f = g_ent.float().contiguous() if g_ent is not None else dummy
    if rows:
        _grad_kernel[(rows,)](
            logits, logits.stride(0), labels, lse, entropy, g_lp_f, g_ent_f, inv_temp, V=V,
            HAS_LP=g_lp is not None, HAS_ENT=g_ent is not None, BLOCK=BLOCK_V, num_warps=GRAD_NUM_WARPS,
        )  # fmt: skip
    return logits


def scalable(t: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether scale_ / scale_add_ run here: a contiguous CUDA tensor of a float type they handle, and a
    one-element scale on its device."""
    return (
        triton is not None and t.is_cuda and t.is_contiguous() and t.dtype in SCALE_DTYPES
        and g.numel() == 1 and g.device == t.device and g.dtype.is_floating_point
    )  # fmt: skip


def scale_(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`t.mul_(g)` for a one-element tensor `g` on t's device (scalable), bit for bit (g rounded to t's
    dtype first, as PyTorch does), in one vectorised pass. PyTorch runs a 0-dim CUDA operand through
    its generic casting kernel: on an H200, W0.5B's [151936, 896] bf16 weight gradient and an [11904,
    896] hidden one took 541 us that way, 150 us here."""
    n = t.numel()
    if n:
        _scale_kernel[(triton.cdiv(n, SCALE_BLOCK),)](t, g, n, BLOCK=SCALE_BLOCK, num_warps=4, enable_fp_fusion=False)
    return t


def scale_add_(dst: torch.Tensor, src: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`dst.add_(src.mul_(g))` in one pass, bit for bit, without writing `src` (both scalable, one dtype,
    one shape)."""
    assert dst.dtype == src.dtype and dst.shape == src.shape
    n = dst.numel()
    if n:
        _scale_add_kernel[(triton.cdiv(n, SCALE_BLOCK),)](dst, src, g, n, BLOCK=SCALE_BLOCK, num_warps=4, enable_fp_fusion=False)
    return dst
