"""Triton kernel for precision.CompensatedAdamW: the whole step of every parameter in one launch.

The PyTorch path (`CompensatedAdamW._update`) makes ~25 fp32 passes over each slice and launches
~25 kernels per slice; this kernel reads weight, compensation, m, v and gradient once (10 bytes
per bf16 parameter) and writes weight, compensation, m and v (8 bytes), with no temporaries. The
arithmetic is the PyTorch path's, operation for operation (up to fused multiply-adds); the
stochastic rounding bits come from Philox keyed by a per-tensor seed that the optimizer draws
from its own generator and by each 8-element group's offset within its tensor.

One launch covers a whole list of parameters (a model's ~300 tensors): a table on the GPU holds
each tensor's addresses, size and seed, and the first block index of each tensor; each program
finds its tensor by binary search in that index. W0.5B's 290 tensors on one H200: 2.9 ms of GPU
time, against 3.5-3.6 ms for the kernel this replaced, launched once per tensor, whose launches
took the host 6.4-8.7 ms a step (train/NOTES.md, session 27).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: CompensatedAdamW uses the PyTorch path
    triton = None

BLOCK = 1024
NUM_WARPS = 4
FIELDS = 7  # per tensor in the table: weight, compensation, m, v and gradient addresses, size, seed


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _step_kernel(
        table_ptr, num_tensors, lerp_w, b2, one_minus_b2, eps, decay, neg_step_size, bc2_sqrt,
        BF16: tl.constexpr, SEARCH_STEPS: tl.constexpr, FIELDS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # table: [num_tensors + 1] first block of each tensor (the last entry: the total), then
        # [num_tensors, FIELDS] per-tensor fields
        pid = tl.program_id(0)
        lo = pid * 0  # invariant: first_block[lo] <= pid < first_block[hi]
        hi = lo + num_tensors
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            right = tl.load(table_ptr + mid) <= pid
            lo = tl.where(right, mid, lo)
            hi = tl.where(right, hi, mid)
        fields = table_ptr + num_tensors + 1 + lo * FIELDS
        if BF16:
            dtype = tl.bfloat16
        else:
            dtype = tl.float32
        p_ptr = tl.load(fields).to(tl.pointer_type(dtype))
        comp_ptr = tl.load(fields + 1).to(tl.pointer_type(dtype))
        m_ptr = tl.load(fields + 2).to(tl.pointer_type(dtype))
        v_ptr = tl.load(fields + 3).to(tl.pointer_type(dtype))
        g_ptr = tl.load(fields + 4).to(tl.pointer_type(dtype))
        n = tl.load(fields + 5)
        seed = tl.load(fields + 6)
        start = (pid - tl.load(table_ptr + lo)).to(tl.int32) * BLOCK  # the caller keeps n < 2**31
        offs = start + tl.arange(0, BLOCK)
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
        p_new = x.to(dtype)  # round to nearest even
        tl.store(p_ptr + offs, p_new, mask=mask)
        tl.store(comp_ptr + offs, (x - p_new.to(tl.float32)).to(dtype), mask=mask)
        tl.store(m_ptr + offs, m.to(dtype), mask=mask)
        if BF16:  # v to bf16 by stochastic rounding: add 16 random bits to the fp32 pattern, truncate; inf/NaN unchanged
            bits = v.to(tl.uint32, bitcast=True)
            # one Philox call (128 bits) per 8 elements: element 8 i + 2 j + h takes half h of word
            # j of call i, keyed by the tensor's seed and i (a call per element, 16 of its 128 bits
            # used: 3,375 against 2,850 us for W0.5B's step on an H200)
            r0, r1, r2, r3 = tl.randint4x(seed, start // 8 + tl.arange(0, BLOCK // 8))
            words = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [BLOCK // 2]).to(tl.uint32, bitcast=True)
            noise = tl.reshape(tl.join(words & 0xFFFF, words >> 16), [BLOCK])
            rounded = (((bits + noise) >> 16) << 16).to(tl.float32, bitcast=True)
            v = tl.where((bits & 0x7F800000) != 0x7F800000, rounded, v)
        tl.store(v_ptr + offs, v.to(dtype), mask=mask)


def step(tensors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]], seeds: list[int], *,
         lr: float, weight_decay: float, b1: float, b2: float, eps: float, step: int) -> None:
    """One CompensatedAdamW step, in place, of every (weight, compensation, m, v, gradient) in
    `tensors`: contiguous CUDA tensors of one device and one dtype (bf16 or fp32), each of fewer
    than 2**31 elements; `seeds[i]` keys tensor i's random bits (bf16 only)."""
    if not tensors:
        return
    dtype, device = tensors[0][0].dtype, tensors[0][0].device
    first_blocks, fields = [0], []
    for group, seed in zip(tensors, seeds, strict=True):
        n = group[0].numel()
        if any(t.dtype != dtype or t.device != device or t.numel() != n or not t.is_contiguous() for t in group):
            raise ValueError("triton_adamw.step: each tensor group must be contiguous tensors of one size, dtype and device")
        first_blocks.append(first_blocks[-1] + triton.cdiv(n, BLOCK))
        fields.extend(t.data_ptr() for t in group)
        fields.extend((n, seed))
    table = torch.tensor(first_blocks + fields, dtype=torch.int64)
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
    _step_kernel[(first_blocks[-1],)](
        table, len(tensors), 1 - b1, b2, 1 - b2, eps, 1 - lr * weight_decay, -lr / (1 - b1**step), (1 - b2**step) ** 0.5,
        BF16=dtype == torch.bfloat16, SEARCH_STEPS=len(tensors).bit_length(), FIELDS=FIELDS, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip
