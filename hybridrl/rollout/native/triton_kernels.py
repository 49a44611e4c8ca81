"""Triton kernels for the decode step's small fused operations (GPU path).

At W0.5B's size a decode step is bound by the number of kernels, not by bytes (BENCHMARK.md,
calibration), so each kernel here replaces a chain of PyTorch ops: add + RMSNorm (7 -> 1),
q/k norm + rotary + KV-cache write (~20 -> 1), SiLU * up (3 -> 1).
Numerics follow HF's modules: fp32 statistics, round to the model dtype where HF rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, H, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        # The residual stream is rounded to the model dtype, as HF's `residual + hidden` is.
        x = x.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * H + cols, x, mask=mask)
        x = x.to(tl.float32)
    var = tl.sum(x * x, axis=0) / H
    normed = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place; residual = x when None), returns (rms_norm(residual), residual)."""
    rows, hidden = x.shape
    out = torch.empty_like(x)
    res = x if residual is None else residual
    _add_rms_norm_kernel[(rows,)](
        x, res, weight, out, hidden, eps,
        HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(hidden), num_warps=4,
    )  # fmt: skip
    return out, res


@triton.jit
def _rms_rope_heads(x1, x2, w_ptr, c, s, hd, hd_mask, eps, D: tl.constexpr, HALF: tl.constexpr,
                    HAS_NORM: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """Optional per-head RMSNorm (Qwen3), then rotate-half rotary, on halves [heads, D/2]."""
    if HAS_NORM:
        ms = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D
        r = tl.rsqrt(ms + eps)[:, None]
        w1 = tl.load(w_ptr + hd, mask=hd_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + hd, mask=hd_mask, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * r).to(DTYPE).to(tl.float32) * w1).to(DTYPE).to(tl.float32)
        x2 = ((x2 * r).to(DTYPE).to(tl.float32) * w2).to(DTYPE).to(tl.float32)
    # HF's rounding: cos / sin in the model dtype, each product and the sum rounded to it.
    c = c.to(DTYPE).to(tl.float32)
    s = s.to(DTYPE).to(tl.float32)
    o1 = ((x1 * c).to(DTYPE).to(tl.float32) - (x2 * s).to(DTYPE).to(tl.float32)).to(DTYPE)
    o2 = ((x2 * c).to(DTYPE).to(tl.float32) + (x1 * s).to(DTYPE).to(tl.float32)).to(DTYPE)
    return o1, o2


@triton.jit
def _rope_at(cos_ptr, sin_ptr, pos, HALF: tl.constexpr, HALF_P: tl.constexpr):
    """The rotary tables' row for position `pos`: (hd, hd_mask, cos [1, HALF_P], sin [1, HALF_P])."""
    hd = tl.arange(0, HALF_P)
    hd_mask = hd < HALF
    c = tl.load(cos_ptr + pos * HALF + hd, mask=hd_mask, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * HALF + hd, mask=hd_mask, other=0.0)[None, :]
    return hd, hd_mask, c, s


@triton.jit
def _rope_heads_into(x_ptr, x_stride, out_ptr, row, w_ptr, eps, c, s, hd, hd_mask,
                     H: tl.constexpr, H_P: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                     HAS_NORM: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """Norms (if any) and rotates `row`'s H heads of x (heads contiguous, rows x_stride apart) into
    row `row` of out `[rows, H, D]`; returns the rotated halves with their offsets and mask."""
    h = tl.arange(0, H_P)
    off = h[:, None] * D + hd[None, :]
    mask = (h[:, None] < H) & hd_mask[None, :]
    x1 = tl.load(x_ptr + row * x_stride + off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + row * x_stride + off + HALF, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = _rms_rope_heads(x1, x2, w_ptr, c, s, hd, hd_mask, eps, D, HALF, HAS_NORM, DTYPE)
    tl.store(out_ptr + row * H * D + off, o1, mask=mask)
    tl.store(out_ptr + row * H * D + off + HALF, o2, mask=mask)
    return o1, o2, off, mask


@triton.jit
def _rope_write_kv(
    k_ptr, v_ptr, k_stride, v_stride, kn_ptr, eps, row, pos, heads, mask, c, s, hd, hd_mask,
    k_cache_ptr, v_cache_ptr, bt_ptr, bt_stride,
    HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BS: tl.constexpr, HAS_NORM: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """Norms (if any) and rotates `row`'s new key for KV heads `heads` ([H, 1], or one head as a
    scalar; `mask` [H or 1, HALF_P]) and writes it and the new value into the cache slot of `pos`;
    returns the rotated key's halves and the value's, as written."""
    off = heads * D + hd[None, :]
    k1 = tl.load(k_ptr + row * k_stride + off, mask=mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptr + row * k_stride + off + HALF, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = _rms_rope_heads(k1, k2, kn_ptr, c, s, hd, hd_mask, eps, D, HALF, HAS_NORM, DTYPE)
    block = tl.load(bt_ptr + row * bt_stride + pos // BS).to(tl.int64)
    v1, v2 = _store_kv(k_cache_ptr, v_cache_ptr, v_ptr, v_stride, row, block, pos % BS, heads, off, o1, o2, mask, hd, HKV, D, HALF, BS, DTYPE)
    return o1, o2, v1, v2


@triton.jit
def _store_kv(
    k_cache_ptr, v_cache_ptr, v_ptr, v_stride, row, block, in_block, heads, off, k1, k2, mask, hd,
    HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BS: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """Writes a token's rotated key halves (k1, k2) and its value (row `row` of v, heads at `off`)
    into place `in_block` of cache block `block`, for KV heads `heads`; returns the value's halves."""
    c_off = ((block * HKV + heads) * BS + in_block) * D + hd[None, :]
    tl.store(k_cache_ptr + c_off, k1.to(DTYPE), mask=mask)
    tl.store(k_cache_ptr + c_off + HALF, k2.to(DTYPE), mask=mask)
    v1 = tl.load(v_ptr + row * v_stride + off, mask=mask, other=0.0)
    v2 = tl.load(v_ptr + row * v_stride + off + HALF, mask=mask, other=0.0)
    tl.store(v_cache_ptr + c_off, v1.to(DTYPE), mask=mask)
    tl.store(v_cache_ptr + c_off + HALF, v2.to(DTYPE), mask=mask)
    return v1, v2


@triton.jit
def _cache_pointers(k_ptr, v_ptr, kv_off_ptr, KV_TABLE: tl.constexpr):
    """The K and V cache pointers of a kernel: as passed, or (KV_TABLE) the anchor passed as both
    moved by this layer's element offsets, read at run time from the address table
    (kv_cache.CacheAddresses); the offsets are multiples of 8 elements, so loads stay vectorised."""
    if KV_TABLE:
        k_ptr += tl.multiple_of(tl.load(kv_off_ptr), 8)
        v_ptr += tl.multiple_of(tl.load(kv_off_ptr + 1), 8)
    return k_ptr, v_ptr


def _cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_table) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The K / V pointer arguments of a kernel and its address-table arguments: the cache itself, or
    (kv_table given) the table's anchor for both and this layer's offsets (_cache_pointers)."""
    if kv_table is None:
        return k_cache, v_cache, dict(kv_off_ptr=k_cache, KV_TABLE=False)  # kv_off_ptr unused
    anchor, offsets = kv_table
    assert anchor.dtype == k_cache.dtype == v_cache.dtype, "the anchor's type is the cache's"
    return anchor, anchor, dict(kv_off_ptr=offsets, KV_TABLE=True)


def _rope_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(batch, half, head_dim, num_heads, num_kv_heads) of a decode step's q / k / v `[B, heads * D]`
    (heads contiguous; rows may be strided slices of one fused q|k|v output) and rope table `cos`."""
    assert q.stride(1) == k.stride(1) == v.stride(1) == 1
    half = cos.shape[1]
    head_dim = 2 * half
    return q.shape[0], half, head_dim, q.shape[1] // head_dim, k.shape[1] // head_dim


def _head_consts(num_heads: int, num_kv_heads: int, half: int, k_cache: torch.Tensor, has_norm: bool) -> dict:
    """The compile-time head shapes of the rotary + KV-write kernels, and their launch width."""
    return dict(
        HQ=num_heads, HKV=num_kv_heads, HQ_P=triton.next_power_of_2(num_heads), HKV_P=triton.next_power_of_2(num_kv_heads),
        D=2 * half, HALF=half, HALF_P=triton.next_power_of_2(half), BS=k_cache.shape[2], HAS_NORM=has_norm, num_warps=4,
    )  # fmt: skip


@triton.jit
def _qk_rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, eps,
    q_out_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, bt_stride,
    HQ: tl.constexpr, HKV: tl.constexpr, HQ_P: tl.constexpr, HKV_P: tl.constexpr,
    D: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, BS: tl.constexpr,
    HAS_NORM: tl.constexpr, kv_off_ptr, KV_TABLE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    k_cache_ptr, v_cache_ptr = _cache_pointers(k_cache_ptr, v_cache_ptr, kv_off_ptr, KV_TABLE)
    dtype = q_out_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + row)
    hd, hd_mask, c, s = _rope_at(cos_ptr, sin_ptr, pos, HALF, HALF_P)

    _rope_heads_into(q_ptr, q_stride, q_out_ptr, row, qn_ptr, eps, c, s, hd, hd_mask, HQ, HQ_P, D, HALF, HAS_NORM, dtype)

    hk = tl.arange(0, HKV_P)[:, None]  # every KV head
    _rope_write_kv(
        k_ptr, v_ptr, k_stride, v_stride, kn_ptr, eps, row, pos, hk, (hk < HKV) & hd_mask[None, :], c, s, hd, hd_mask,
        k_cache_ptr, v_cache_ptr, bt_ptr, bt_stride, HKV, D, HALF, BS, HAS_NORM, dtype,
    )  # fmt: skip


def qk_rope_write_kv(
    q, k, v, positions, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, block_tables, kv_table=None
) -> torch.Tensor:
    """See TorchOps.qk_rope_write_kv; one program per sequence. q / k / v may be column slices of
    one fused q|k|v output (rows strided, heads contiguous). kv_table: as
    triton_attention.paged_decode_attention's."""
    k_arg, v_arg, table = _cache_args(k_cache, v_cache, kv_table)
    batch, half, head_dim, num_heads, num_kv_heads = _rope_shapes(q, k, v, cos)
    q_out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    has_norm = q_norm is not None
    _qk_rope_write_kv_kernel[(batch,)](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), positions, cos, sin,
        q_norm if has_norm else q, k_norm if has_norm else k, eps,
        q_out, k_arg, v_arg, block_tables, block_tables.stride(0), **table,
        **_head_consts(num_heads, num_kv_heads, half, k_cache, has_norm),
    )  # fmt: skip
    return q_out


@triton.jit
def _prefill_rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, len_ptr, slot_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, eps,
    q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr, L,
    HQ: tl.constexpr, HKV: tl.constexpr, HQ_P: tl.constexpr, HKV_P: tl.constexpr,
    D: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, BS: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # token t of prompt p: row p * L + t, at position t
    pos = row % L
    dtype = q_out_ptr.dtype.element_ty
    hd, hd_mask, c, s = _rope_at(cos_ptr, sin_ptr, pos, HALF, HALF_P)

    _rope_heads_into(q_ptr, q_stride, q_out_ptr, row, qn_ptr, eps, c, s, hd, hd_mask, HQ, HQ_P, D, HALF, HAS_NORM, dtype)
    o1, o2, k_off, k_mask = _rope_heads_into(
        k_ptr, k_stride, k_out_ptr, row, kn_ptr, eps, c, s, hd, hd_mask, HKV, HKV_P, D, HALF, HAS_NORM, dtype
    )
    if pos < tl.load(len_ptr + row // L):  # a real token (right padding computes garbage nobody reads)
        slot = tl.load(slot_ptr + row)
        _store_kv(k_cache_ptr, v_cache_ptr, v_ptr, v_stride, row, slot // BS, slot % BS, tl.arange(0, HKV_P)[:, None],
                  k_off, o1, o2, k_mask, hd, HKV, D, HALF, BS, dtype)  # fmt: skip


def prefill_rope_write_kv(q, k, v, lengths, slots, cos, sin, q_norm, k_norm, eps, k_cache, v_cache):
    """See TorchOps.prefill_rope_write_kv; one program per token of the right-padded prompts."""
    num_tokens, half, head_dim, num_heads, num_kv_heads = _rope_shapes(q, k, v, cos)
    width = slots.shape[1]
    assert num_tokens == slots.numel() and slots.is_contiguous(), "one slot per token of the [P, L] prompts"
    q_out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=k.dtype, device=k.device)
    has_norm = q_norm is not None
    _prefill_rope_write_kv_kernel[(num_tokens,)](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), lengths, slots, cos, sin,
        q_norm if has_norm else q, k_norm if has_norm else k, eps,
        q_out, k_out, k_cache, v_cache, width,
        **_head_consts(num_heads, num_kv_heads, half, k_cache, has_norm),
    )  # fmt: skip
    return q_out, k_out


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, g_stride, u_stride, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(g_ptr + row * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + cols, mask=mask, other=0.0).to(tl.float32)
    # HF rounds silu(g) to the model dtype before the product.
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [B, I] inputs whose rows may be strided (halves of a fused gate|up)."""
    assert gate.stride(1) == up.stride(1) == 1
    rows, inter = gate.shape
    out = torch.empty(rows, inter, dtype=gate.dtype, device=gate.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
        gate, up, out, gate.stride(0), up.stride(0), inter, BLOCK=block, num_warps=4
    )
    return out


@triton.jit
def _advance_kernel(
    new_ptr, lp_ptr, tokens_ptr, positions_ptr, steps_ptr, max_lens_ptr, done_ptr, out_tok_ptr, out_lp_ptr,
    stop_ptr, batch, out_stride, max_gen, NSTOP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < batch
    done = tl.load(done_ptr + rows, mask=live, other=1).to(tl.int1)
    steps = tl.load(steps_ptr + rows, mask=live, other=0)
    tok = tl.load(new_ptr + rows, mask=live, other=0)
    lp = tl.load(lp_ptr + rows, mask=live, other=0.0)
    active = (done == 0) & live
    column = tl.where(active, steps, max_gen)  # finished rows write to the trash column
    out_off = rows.to(tl.int64) * out_stride + column
    tl.store(out_tok_ptr + out_off, tok, mask=live)
    tl.store(out_lp_ptr + out_off, lp, mask=live)
    stop_ids = tl.load(stop_ptr + tl.arange(0, NSTOP))
    stopped = tl.sum((tok[:, None] == stop_ids[None, :]).to(tl.int32), axis=1) > 0
    one = active.to(tl.int64)
    new_steps = steps + one
    max_len = tl.load(max_lens_ptr + rows, mask=live, other=0)
    now_done = (done != 0) | (active & (stopped | (new_steps >= max_len)))
    tl.store(done_ptr + rows, now_done.to(tl.int1), mask=live)
    tl.store(steps_ptr + rows, new_steps, mask=live)
    pos = tl.load(positions_ptr + rows, mask=live, other=0)
    tl.store(positions_ptr + rows, pos + one, mask=live)
    old = tl.load(tokens_ptr + rows, mask=live, other=0)
    tl.store(tokens_ptr + rows, tl.where(active, tok, old), mask=live)


def advance(state, batch: int, new_tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
    """DecodeState.advance in one kernel (its ~14 small PyTorch ops are launch-bound)."""
    if batch == 0:
        return
    block = 256
    _advance_kernel[(triton.cdiv(batch, block),)](
        new_tokens, logprobs, state.tokens, state.positions, state.steps, state.max_lens, state.done,
        state.out_tokens, state.out_logprobs, state.stop_ids, batch, state.out_tokens.stride(0),
        state.max_gen, NSTOP=state.stop_ids.numel(), BLOCK=block, num_warps=4,
    )  # fmt: skip
