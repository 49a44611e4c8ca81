"""Triton kernel for precision.CompensatedAdamW: the whole step of every parameter in one launch.

The PyTorch path (`CompensatedAdamW._update`) makes ~25 fp32 passes over each slice and launches
~25 kernels per slice; this kernel reads weight, compensation, m, v and gradient once (10 bytes
per bf16 parameter) and writes weight, compensation, m and v (8 bytes), with no temporaries. The
arithmetic is the PyTorch path's, operation for operation (up to fused multiply-adds); the
stochastic rounding bits come from Philox keyed by a per-tensor seed that the optimizer draws
from its own generator and by each 8-element group's offset within its tensor.

One launch covers a whole list of parameters (a model's ~300 tensors): a table on the GPU holds
where each tensor starts, its size and seed, and the first block index of each tensor; each
program finds its tensor by binary search in that index. W0.5B's 290 tensors on one H200: 2.9 ms
of GPU time and 5.0 ms with the host's table and launch, against 3.5 ms and 6.4 ms for the
kernel this replaced, launched once per tensor (train/NOTES.md, session 27).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: CompensatedAdamW uses the PyTorch path
    triton = None

# 4 elements a thread: at 8 (1024 / 4 warps, 2048 / 8) the W0.5B step took 6.0-6.2 ms, at 4 (512 / 4,
# 1024 / 8) 2.9-3.0 ms (one H200)
BLOCK = 512
NUM_WARPS = 4
FIELDS = 7  # per tensor in the table: where weight, compensation, m, v and gradient start, size, seed


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _place(fields, i, ALIGN: tl.constexpr):
        """Field i of a tensor's row: where that tensor starts, in elements from base_ptr. ALIGN
        (> 1: every tensor starts a multiple of ALIGN elements, 16 bytes, from base_ptr, which is
        16-byte aligned) lets the compiler use 16-byte loads and stores, as it does for pointer
        arguments it sees are aligned; read from the table as plain pointers, the W0.5B step took
        1.4x as long."""
        place = tl.load(fields + i)
        if ALIGN > 1:
            place = tl.multiple_of(place, ALIGN)
        return place

    @triton.jit
    def _step_kernel(
        base_ptr, table_ptr, num_tensors, lerp_w, b2, one_minus_b2, eps, decay, neg_step_size, bc2_sqrt,
        BF16: tl.constexpr, ALIGN: tl.constexpr, SEARCH_STEPS: tl.constexpr, FIELDS: tl.constexpr,
        BLOCK: tl.constexpr,
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
        start = (pid - tl.load(table_ptr + lo)).to(tl.int32) * BLOCK  # the caller keeps n < 2**31
        offs = start + tl.arange(0, BLOCK)
        mask = offs < tl.load(fields + 5)
        p_ptr = base_ptr + _place(fields, 0, ALIGN) + offs
        comp_ptr = base_ptr + _place(fields, 1, ALIGN) + offs
        m_ptr = base_ptr + _place(fields, 2, ALIGN) + offs
        v_ptr = base_ptr + _place(fields, 3, ALIGN) + offs
        g_ptr = base_ptr + _place(fields, 4, ALIGN) + offs
        seed = tl.load(fields + 6)
        g = tl.load(g_ptr, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_ptr, mask=mask, other=0.0)
        c = tl.load(comp_ptr, mask=mask, other=0.0)
        m = m + lerp_w * (g - m)
        v = v * b2 + one_minus_b2 * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        x = (p.to(tl.float32) + c.to(tl.float32)) * decay
        x = x + neg_step_size * tl.div_rn(m, denom)
        p_new = x.to(p.dtype)  # round to nearest even
        tl.store(p_ptr, p_new, mask=mask)
        tl.store(comp_ptr, (x - p_new.to(tl.float32)).to(p.dtype), mask=mask)
        tl.store(m_ptr, m.to(p.dtype), mask=mask)
        if BF16:  # v to bf16 by stochastic rounding: add 16 random bits to the fp32 pattern, truncate; inf/NaN unchanged
            bits = v.to(tl.uint32, bitcast=True)
            # one Philox call (128 bits) per 8 elements: element 8 i + 2 j + h takes half h of
            # word j of call i, keyed by the tensor's seed and i (a call per element took 1.3x as long)
            r0, r1, r2, r3 = tl.randint4x(seed, start // 8 + tl.arange(0, BLOCK // 8))
            words = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [BLOCK // 2]).to(tl.uint32, bitcast=True)
            noise = tl.reshape(tl.join(words & 0xFFFF, words >> 16), [BLOCK])
            rounded = (((bits + noise) >> 16) << 16).to(tl.float32, bitcast=True)
            v = tl.where((bits & 0x7F800000) != 0x7F800000, rounded, v)
        tl.store(v_ptr, v.to(p.dtype), mask=mask)


def step(tensors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]], seeds: list[int], *,
         lr: float, weight_decay: float, b1: float, b2: float, eps: float, step: int) -> None:
    """One CompensatedAdamW step, in place, of every (weight, compensation, m, v, gradient) in
    `tensors`: contiguous CUDA tensors of one device and one dtype (bf16 or fp32), each of fewer
    than 2**31 elements; `seeds[i]` keys tensor i's random bits (bf16 only)."""
    if not tensors:
        return
    base = tensors[0][0]
    dtype, device, size = base.dtype, base.device, base.element_size()
    first_blocks, fields, aligned = [0], [], base.data_ptr() % 16 == 0
    for group, seed in zip(tensors, seeds, strict=True):
        n = group[0].numel()
        if any(t.dtype != dtype or t.device != device or t.numel() != n or not t.is_contiguous() for t in group):
            raise ValueError("triton_adamw.step: each tensor group must be contiguous tensors of one size, dtype and device")
        first_blocks.append(first_blocks[-1] + triton.cdiv(n, BLOCK))
        for t in group:
            aligned &= (t.data_ptr() - base.data_ptr()) % 16 == 0
            fields.append((t.data_ptr() - base.data_ptr()) // size)  # exact: addresses are multiples of the element size
        fields.extend((n, seed))
    table = torch.tensor(first_blocks + fields, dtype=torch.int64)
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
    _step_kernel[(first_blocks[-1],)](
        base, table, len(tensors), 1 - b1, b2, 1 - b2, eps, 1 - lr * weight_decay, -lr / (1 - b1**step),
        (1 - b2**step) ** 0.5, BF16=dtype == torch.bfloat16, ALIGN=16 // size if aligned else 1, SEARCH_STEPS=len(tensors).bit_length(),
        FIELDS=FIELDS, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip
