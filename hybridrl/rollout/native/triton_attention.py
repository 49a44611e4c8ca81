"""Paged decode attention in Triton: one query token per sequence against its cached context.

One program per (sequence, KV head) serves the whole group of query heads that share the KV head
(GQA), so each K/V tile is read once per group; the tile gathers TILE tokens through the block
table and runs an online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022).
With a `SharedPrefix` (cascade attention), the n samples of a prompt read their shared prompt
blocks once per group in _shared_prefix_kernel, split over several programs per group, and each row
then merges their partial states and continues over its own tokens.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .kv_cache import PagedKVCache
from .triton_kernels import _cache_args, _cache_pointers, _rms_rope_heads, _rope_at, _rope_shapes, _rope_write_kv

# Tokens per inner-loop tile; several cache blocks are gathered per tile so the loop is short.
DEFAULT_TILE = 128


@triton.jit
def _tile_blocks(bt_row, ctx, start, BS: tl.constexpr, TILE: tl.constexpr):
    """The cache block of each of the TILE tokens from `start` (0 past ctx) in the row's table
    `bt_row`, as int32: _attend_range's offsets are 32-bit (_check_offsets)."""
    tok = start + tl.arange(0, TILE)
    return tl.load(bt_row + tok // BS, mask=tok < ctx, other=0)


@triton.jit
def _attend_blocks(
    q, k_ptr, v_ptr, block, kvh, ctx, start, m_i, l_i, acc, scale_log2,
    HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """_attend_tile with the tile's cache blocks (_tile_blocks) already read."""
    tok = start + tl.arange(0, TILE)
    d = tl.arange(0, D)
    t_mask = tok < ctx
    kv_off = ((block * HKV + kvh) * BS + tok % BS)[:, None] * D + d[None, :]
    return _softmax_update(q, k_ptr, v_ptr, kv_off, t_mask, t_mask[None, :], m_i, l_i, acc, scale_log2, IEEE)


@triton.jit
def _softmax_update(q, k_ptr, v_ptr, kv_off, key_mask, score_mask, m_i, l_i, acc, scale_log2, IEEE: tl.constexpr):
    """One online-softmax step: the keys and values at k_ptr / v_ptr + kv_off ([N, D], rows off key_mask
    read as 0) against the queries q [M, D], scores off score_mask [M, N] left out; returns the new state."""
    k = tl.load(k_ptr + kv_off, mask=key_mask[:, None], other=0.0)  # [N, D]
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(score_mask, s * scale_log2, float("-inf"))  # [M, N], log2 units
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked tile leaves state as is
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptr + kv_off, mask=key_mask[:, None], other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _attend_step(
    q, k_ptr, v_ptr, bt_row, kvh, hi, start, block, m_i, l_i, acc, scale_log2,
    HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr,
    PREFETCH: tl.constexpr,
):  # fmt: skip
    """One online-softmax update with the TILE tokens from `start`. Returns the new state and the
    cache blocks of the next tile: with PREFETCH, `block` holds this tile's (read an iteration
    earlier) and the next tile's are read now; otherwise this tile's are read here."""
    if PREFETCH:
        following = _tile_blocks(bt_row, hi, start + TILE, BS, TILE)
    else:
        block = _tile_blocks(bt_row, hi, start, BS, TILE)
        following = block
    m_i, l_i, acc = _attend_blocks(q, k_ptr, v_ptr, block, kvh, hi, start, m_i, l_i, acc, scale_log2, HKV, D, BS, TILE, IEEE)
    return m_i, l_i, acc, following


@triton.jit
def _attend_range(
    q, k_ptr, v_ptr, bt_ptr, bt_stride, row, kvh, lo, hi, m_i, l_i, acc, scale_log2,
    SPAN: tl.constexpr, DYNAMIC_LOOP: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """The online softmax over tokens [lo, hi) of `row`'s table, TILE at a time. PREFETCH reads
    each tile's block table entries one tile ahead, so a tile's K / V addresses depend on a value
    the loop carries in, not on a load of the same iteration. Triton's CPU interpreter cannot loop
    to a run-time bound: there, it loops over SPAN (>= hi - lo) tokens from lo; tiles past hi are
    fully masked and leave the softmax state unchanged."""
    # Token indices and cache offsets in 32 bits (at W0.5B's shapes 337 instructions a tile against 392
    # in 64; the wrappers check that a layer's cache fits); the row's table pointer is formed once.
    bt_row = bt_ptr + row * bt_stride
    lo = tl.cast(lo, tl.int32)
    hi = tl.cast(hi, tl.int32)
    if PREFETCH:
        block = _tile_blocks(bt_row, hi, lo, BS, TILE)
    else:
        block = tl.zeros([TILE], tl.int32)  # replaced by each step's own read before any use
    if DYNAMIC_LOOP:
        for start in range(lo, hi, TILE):
            m_i, l_i, acc, block = _attend_step(
                q, k_ptr, v_ptr, bt_row, kvh, hi, start, block, m_i, l_i, acc, scale_log2,
                HKV, D, BS, TILE, IEEE, PREFETCH,
            )  # fmt: skip
    else:
        for start in tl.static_range(0, SPAN, TILE):
            m_i, l_i, acc, block = _attend_step(
                q, k_ptr, v_ptr, bt_row, kvh, hi, lo + start, block, m_i, l_i, acc, scale_log2,
                HKV, D, BS, TILE, IEEE, PREFETCH,
            )  # fmt: skip
    return m_i, l_i, acc


def _check_offsets(k_cache: torch.Tensor) -> None:
    """_attend_range addresses a layer's cache [num_blocks, Hkv, bs, D] with 32-bit offsets."""
    if k_cache.numel() > PagedKVCache.MAX_LAYER_ELEMENTS:
        most = PagedKVCache.max_blocks(*k_cache.shape[1:])
        raise ValueError(
            f"a layer's KV cache of {k_cache.numel():,} elements ({tuple(k_cache.shape)}) is past the decode "
            f"attention's 32-bit offsets; allocate at most {most:,} blocks (kv_cache.PagedKVCache.max_blocks)"
        )


@triton.jit
def _merge_partial(m_i, l_i, acc, pacc_ptr, pml_ptr, part, mask, D: tl.constexpr):
    """Adds the unnormalised softmax state of another span of keys (index `part` of the partial
    state buffers; masked: none) to (m_i, l_i, acc): the log-sum-exp merge, in log2 units."""
    d = tl.arange(0, D)
    m_p = tl.load(pml_ptr + part * 2, mask=mask, other=float("-inf"))
    l_p = tl.load(pml_ptr + part * 2 + 1, mask=mask, other=0.0)
    acc_p = tl.load(pacc_ptr + part[:, None] * D + d[None, :], mask=mask[:, None], other=0.0)
    m_new = tl.maximum(m_i, m_p)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # neither state has a key yet
    alpha, beta = tl.exp2(m_i - m_use), tl.exp2(m_p - m_use)
    return m_new, l_i * alpha + l_p * beta, acc * alpha[:, None] + acc_p * beta[:, None]


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, bt_stride, ctx_ptr, out_ptr, scale_log2, pre_ptr, pacc_ptr, pml_ptr, NSPLIT,
    MAX_CTX: tl.constexpr, DYNAMIC_LOOP: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
    IEEE: tl.constexpr, HAS_PREFIX: tl.constexpr, PREFIX_TILE: tl.constexpr,
    kv_off_ptr, KV_TABLE: tl.constexpr,
):  # fmt: skip
    k_ptr, v_ptr = _cache_pointers(k_ptr, v_ptr, kv_off_ptr, KV_TABLE)
    row = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    ctx = tl.load(ctx_ptr + row)
    g = tl.arange(0, GROUP_P)
    g_mask = g < GROUP
    d = tl.arange(0, D)
    q_off = (row * HQ + kvh * GROUP + g)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + q_off, mask=g_mask[:, None], other=0.0)  # [GP, D]

    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, D], tl.float32)
    if HAS_PREFIX:
        # The row's first `pre` tokens were attended by _shared_prefix_kernel in nsplit chunks
        # (counted as it counts them): merge their partial states, then go on over the row's own tokens.
        pre = tl.load(pre_ptr + row).to(tl.int64)
        nsplit = tl.minimum((pre + PREFIX_TILE - 1) // PREFIX_TILE, NSPLIT)  # 0 for a row without a group
        head = row * HQ + kvh * GROUP + g
        for split in range(0, NSPLIT):
            has = g_mask & ((g * 0 + split) < nsplit)  # a block, not a scalar, for the CPU interpreter
            m_i, l_i, acc = _merge_partial(m_i, l_i, acc, pacc_ptr, pml_ptr, head * NSPLIT + split, has, D)
    else:
        pre = 0
    m_i, l_i, acc = _attend_range(
        q, k_ptr, v_ptr, bt_ptr, bt_stride, row, kvh, pre, ctx, m_i, l_i, acc, scale_log2,
        MAX_CTX, DYNAMIC_LOOP, HKV, D, BS, TILE, IEEE, False,
    )  # fmt: skip
    out = acc / l_i[:, None]
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit
def _rope_paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, eps,
    k_cache_ptr, v_cache_ptr, bt_ptr, bt_stride, out_ptr, scale_log2,
    MAX_CTX: tl.constexpr, DYNAMIC_LOOP: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
    BS: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr, HAS_NORM: tl.constexpr,
    kv_off_ptr, KV_TABLE: tl.constexpr, NEW_IN_REGISTERS: tl.constexpr, PREFETCH_TABLE: tl.constexpr,
):  # fmt: skip
    """_qk_rope_write_kv_kernel and _paged_decode_kernel as one program per (sequence, KV head)
    (_rope_attend_row). Same arithmetic, one launch fewer per layer."""
    k_cache_ptr, v_cache_ptr = _cache_pointers(k_cache_ptr, v_cache_ptr, kv_off_ptr, KV_TABLE)
    _rope_attend_row(
        q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, eps,
        k_cache_ptr, v_cache_ptr, bt_ptr, bt_stride, out_ptr, scale_log2, tl.program_id(0).to(tl.int64),
        tl.program_id(1), MAX_CTX, DYNAMIC_LOOP, HQ, HKV, GROUP, GROUP_P, D, HALF, HALF_P, BS, TILE, IEEE, HAS_NORM,
        NEW_IN_REGISTERS, PREFETCH_TABLE,
    )  # fmt: skip


@triton.jit
def _rope_attend_row(
    q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, eps,
    k_cache_ptr, v_cache_ptr, bt_ptr, bt_stride, out_ptr, scale_log2, row, kvh,
    MAX_CTX: tl.constexpr, DYNAMIC_LOOP: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
    BS: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr, HAS_NORM: tl.constexpr,
    NEW_IN_REGISTERS: tl.constexpr, PREFETCH_TABLE: tl.constexpr,
):  # fmt: skip
    """One (sequence `row` (int64), KV head `kvh`) of a decode step: rotates the row's query heads of
    the group and the KV head's new key, writes the new key and value into the cache, and attends
    over the context including them. (A function, not only a kernel, so that a persistent kernel can
    run it as one of its work items: bench/decode_persistent.py.)

    NEW_IN_REGISTERS (HALF a power of two): the rotated queries stay in registers, and the new
    token is attended from the registers that wrote it, before the cached tokens; nothing this
    program wrote is read back, so no barrier waits for the stores. PREFETCH_TABLE then reads the
    block table a tile ahead (_attend_range's PREFETCH). Otherwise the rotated queries are staged
    in the row's output slot (overwritten by the result) and the loop reads the new token from the
    cache. Which is faster depends on the head dim: ops_triton.TritonOps picks."""
    dtype = out_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + row)
    hd, hd_mask, c, s = _rope_at(cos_ptr, sin_ptr, pos, HALF, HALF_P)

    g = tl.arange(0, GROUP_P)
    g_mask = g < GROUP
    head = kvh * GROUP + g
    half_off = head[:, None] * D + hd[None, :]
    half_mask = g_mask[:, None] & hd_mask[None, :]
    q1 = tl.load(q_ptr + row * q_stride + half_off, mask=half_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + row * q_stride + half_off + HALF, mask=half_mask, other=0.0).to(tl.float32)
    o1, o2 = _rms_rope_heads(q1, q2, qn_ptr, c, s, hd, hd_mask, eps, D, HALF, HAS_NORM, dtype)
    out_row = out_ptr + row * HQ * D
    if not NEW_IN_REGISTERS:
        tl.store(out_row + half_off, o1.to(dtype), mask=half_mask)
        tl.store(out_row + half_off + HALF, o2.to(dtype), mask=half_mask)

    nk1, nk2, nv1, nv2 = _rope_write_kv(  # this program's KV head
        k_ptr, v_ptr, k_stride, v_stride, kn_ptr, eps, row, pos, kvh, hd_mask[None, :], c, s, hd, hd_mask,
        k_cache_ptr, v_cache_ptr, bt_ptr, bt_stride, HKV, D, HALF, BS, HAS_NORM, dtype,
    )  # fmt: skip

    d = tl.arange(0, D)
    q_off = head[:, None] * D + d[None, :]
    if NEW_IN_REGISTERS:
        # The softmax state starts from the new token (nothing of it stays live through the loop):
        # its score in fp32, its weight (1 against itself) scaling its value.
        m_i = tl.sum(o1.to(tl.float32) * nk1.to(tl.float32), axis=1)
        m_i = (m_i + tl.sum(o2.to(tl.float32) * nk2.to(tl.float32), axis=1)) * scale_log2  # [GP], log2 units
        l_i = tl.full([GROUP_P], 1.0, tl.float32)
        ones = tl.full([GROUP_P, 1], 1.0, tl.float32)
        acc = tl.reshape(tl.permute(tl.join(ones * nv1.to(tl.float32), ones * nv2.to(tl.float32)), (0, 2, 1)), (GROUP_P, D))
        q = tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), (GROUP_P, D))  # [q1 | q2] per head
        m_i, l_i, acc = _attend_range(  # the cached tokens before the new one
            q, k_cache_ptr, v_cache_ptr, bt_ptr, bt_stride, row, kvh, 0, pos, m_i, l_i, acc, scale_log2,
            MAX_CTX, DYNAMIC_LOOP, HKV, D, BS, TILE, IEEE, PREFETCH_TABLE,
        )  # fmt: skip
    else:
        tl.debug_barrier()  # the stores above are read below by other threads of this program
        q = tl.load(out_row + q_off, mask=g_mask[:, None], other=0.0)  # [GP, D]
        m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, D], tl.float32)
        m_i, l_i, acc = _attend_range(
            q, k_cache_ptr, v_cache_ptr, bt_ptr, bt_stride, row, kvh, 0, pos + 1, m_i, l_i, acc, scale_log2,
            MAX_CTX, DYNAMIC_LOOP, HKV, D, BS, TILE, IEEE, False,
        )  # fmt: skip
        tl.debug_barrier()  # every thread has read the staged queries before the result replaces them
    out = acc / l_i[:, None]
    tl.store(out_row + q_off, out.to(dtype), mask=g_mask[:, None])


@triton.jit
def _shared_prefix_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, bt_stride, grows_ptr, gpre_ptr, pacc_ptr, pml_ptr, scale_log2, NSPLIT,
    SPAN: tl.constexpr, DYNAMIC_LOOP: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, MEMBERS: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr,
    kv_off_ptr, KV_TABLE: tl.constexpr,
):  # fmt: skip
    """Cascade attention over a shared prompt (Juravsky et al. 2024, "Hydragen"; FlashInfer's
    cascade): program (group, KV head, split) attends the query heads of every member row of the
    group to one chunk of the group's shared prefix together, so each prefix K/V tile is read once
    per group instead of once per row. One program per (group, KV head) walking the whole prefix
    left most SMs idle (NOTES.md), so the prefix's tiles are cut into up to NSPLIT contiguous
    chunks, one per program; each leaves its rows' unnormalised partial softmax state, which
    _paged_decode_kernel merges."""
    k_ptr, v_ptr = _cache_pointers(k_ptr, v_ptr, kv_off_ptr, KV_TABLE)
    grp = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    pre = tl.load(gpre_ptr + grp)
    tiles = (pre + TILE - 1) // TILE
    nsplit = tl.minimum(tiles, NSPLIT)  # never more chunks than tiles: no chunk is empty
    if split >= nsplit:  # also every program of an unused entry (pre == 0)
        return
    lo = split * tiles // nsplit * TILE  # chunk sizes differ by at most one tile
    hi = tl.minimum(pre, (split + 1) * tiles // nsplit * TILE)
    i = tl.arange(0, MEMBERS * GROUP_P)
    member, j = i // GROUP_P, i % GROUP_P
    rows = tl.load(grows_ptr + grp * MEMBERS + member).to(tl.int64)  # -1: no member in that place
    valid = (rows >= 0) & (j < GROUP)
    rows = tl.where(valid, rows, 0)
    first = tl.load(grows_ptr + grp * MEMBERS).to(tl.int64)  # the shared blocks lead every member's table
    d = tl.arange(0, D)
    head = rows * HQ + kvh * GROUP + j
    q = tl.load(q_ptr + head[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
    m_i = tl.full([MEMBERS * GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([MEMBERS * GROUP_P], tl.float32)
    acc = tl.zeros([MEMBERS * GROUP_P, D], tl.float32)
    m_i, l_i, acc = _attend_range(
        q, k_ptr, v_ptr, bt_ptr, bt_stride, first, kvh, lo, hi, m_i, l_i, acc, scale_log2,
        SPAN, DYNAMIC_LOOP, HKV, D, BS, TILE, IEEE, False,
    )  # fmt: skip
    part = head * NSPLIT + split
    tl.store(pacc_ptr + part[:, None] * D + d[None, :], acc, mask=valid[:, None])
    tl.store(pml_ptr + part * 2, m_i, mask=valid)
    tl.store(pml_ptr + part * 2 + 1, l_i, mask=valid)


@triton.jit
def _paged_decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, bt_stride, ctx_ptr, acc_ptr, ml_ptr, scale_log2, NSPLIT,
    SPLIT: tl.constexpr, DYNAMIC_LOOP: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    TILE: tl.constexpr, IEEE: tl.constexpr,
    kv_off_ptr, KV_TABLE: tl.constexpr,
):  # fmt: skip
    """Flash-decoding (Dao et al. 2023): program (row, kv head, split) attends to the tokens
    [split * SPLIT, (split + 1) * SPLIT) and leaves an unnormalised partial for the merge."""
    k_ptr, v_ptr = _cache_pointers(k_ptr, v_ptr, kv_off_ptr, KV_TABLE)
    row = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + row)
    lo = split * SPLIT
    hi = tl.minimum(ctx, lo + SPLIT)
    g = tl.arange(0, GROUP_P)
    g_mask = g < GROUP
    d = tl.arange(0, D)
    head = row * HQ + kvh * GROUP + g  # [GP]
    q = tl.load(q_ptr + head[:, None] * D + d[None, :], mask=g_mask[:, None], other=0.0)
    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, D], tl.float32)
    m_i, l_i, acc = _attend_range(
        q, k_ptr, v_ptr, bt_ptr, bt_stride, row, kvh, lo, hi, m_i, l_i, acc, scale_log2,
        SPLIT, DYNAMIC_LOOP, HKV, D, BS, TILE, IEEE, False,
    )  # fmt: skip
    part = head * NSPLIT + split  # [GP]
    tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=g_mask[:, None])
    tl.store(ml_ptr + part * 2, m_i, mask=g_mask)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _merge_splits_kernel(acc_ptr, ml_ptr, out_ptr, NSPLIT, NSPLIT_P: tl.constexpr, D: tl.constexpr):
    head = tl.program_id(0).to(tl.int64)  # row * HQ + query head
    sp = tl.arange(0, NSPLIT_P)
    s_mask = sp < NSPLIT
    d = tl.arange(0, D)
    m = tl.load(ml_ptr + (head * NSPLIT + sp) * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(ml_ptr + (head * NSPLIT + sp) * 2 + 1, mask=s_mask, other=0.0)
    acc = tl.load(acc_ptr + (head * NSPLIT + sp)[:, None] * D + d[None, :], mask=s_mask[:, None], other=0.0)
    m_all = tl.max(m, axis=0)  # split 0 always holds a token, so this is finite
    w = tl.exp2(m - m_all)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
    tl.store(out_ptr + head * D + d, out.to(out_ptr.dtype.element_ty))


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, Hkv, bs, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, MB] int32
    context_lens: torch.Tensor,  # [B] int64 (>= 1)
    scale: float,
    tile: int = DEFAULT_TILE,
    num_warps: int = 4,
    num_stages: int = 2,
    split_tokens: int = 0,  # > 0: flash-decoding over splits of this many tokens (a multiple of tile)
    prefix=None,  # a SharedPrefix (shared_prefix.py): cascade attention over each group's shared prompt
    prefix_tile: int = 32,  # the shared-prefix kernel's tile (at most `tile`): smaller tiles, more chunks
    kv_table: tuple[torch.Tensor, torch.Tensor] | None = None,  # CacheAddresses.layer(): the cache found through it
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    _check_offsets(k_cache)
    k_arg, v_arg, table = _cache_args(k_cache, v_cache, kv_table)
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(batch, num_heads * head_dim, dtype=q.dtype, device=q.device)
    dynamic = os.environ.get("TRITON_INTERPRET") != "1"
    max_ctx = block_tables.shape[1] * block_size
    consts = dict(
        HQ=num_heads, HKV=num_kv_heads, GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)),
        D=head_dim, BS=block_size, TILE=tile, IEEE=q.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    scale_log2 = scale * 1.4426950408889634  # log2(e): the kernels use exp2
    num_splits = triton.cdiv(max_ctx, split_tokens) if split_tokens > 0 else 1
    if num_splits == 1:
        if prefix is not None:
            assert q.is_contiguous(), "the shared-prefix state is indexed by row * heads"
            # A 256-token prompt is two 128-token tiles: the prefix kernel's own, smaller tile lets
            # its chunks (one program each) outnumber the SMs.
            ptile = min(prefix_tile, tile)
            max_tiles = triton.cdiv(max_ctx, ptile)
            splits = min(prefix.splits(batch), max_tiles)  # fixed for a captured graph's batch
            assert batch * splits <= prefix.capacity, "SharedPrefix's state buffers are sized for fewer splits"
            # Every running row lies in [0, batch): at most batch // 2 group entries (>= 2 rows each) are in use.
            entries = min(prefix.group_rows.shape[0], max(1, batch // 2))
            members = prefix.group_rows.shape[1]
            group_p = max(triton.next_power_of_2(group), triton.cdiv(16, members))  # >= 16 rows for tl.dot
            span = triton.cdiv(max_tiles, splits) * ptile  # the longest chunk, for the interpreter's loop
            _shared_prefix_kernel[(entries, num_kv_heads, splits)](
                q, k_arg, v_arg, block_tables, block_tables.stride(0), prefix.group_rows, prefix.group_prefix,
                prefix.acc, prefix.ml, scale_log2, splits, **table, SPAN=0 if dynamic else span, DYNAMIC_LOOP=dynamic,
                HQ=num_heads, HKV=num_kv_heads, GROUP=group, GROUP_P=group_p, MEMBERS=members, D=head_dim,
                BS=block_size, TILE=ptile, IEEE=consts["IEEE"], num_warps=num_warps, num_stages=num_stages,
            )  # fmt: skip
            extra = dict(
                pre_ptr=prefix.row_prefix, pacc_ptr=prefix.acc, pml_ptr=prefix.ml, NSPLIT=splits, HAS_PREFIX=True,
                PREFIX_TILE=ptile,
            )
        else:  # unused pointers
            extra = dict(pre_ptr=context_lens, pacc_ptr=out, pml_ptr=out, NSPLIT=1, HAS_PREFIX=False, PREFIX_TILE=tile)
        _paged_decode_kernel[(batch, num_kv_heads)](
            q, k_arg, v_arg, block_tables, block_tables.stride(0), context_lens, out, scale_log2,
            MAX_CTX=0 if dynamic else max_ctx, DYNAMIC_LOOP=dynamic, **extra, **table, **consts,
        )  # fmt: skip
        return out
    assert split_tokens % tile == 0, "split_tokens must be a multiple of the tile"
    acc = torch.empty(batch * num_heads * num_splits, head_dim, dtype=torch.float32, device=q.device)
    ml = torch.empty(batch * num_heads * num_splits, 2, dtype=torch.float32, device=q.device)
    _paged_decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_arg, v_arg, block_tables, block_tables.stride(0), context_lens, acc, ml, scale_log2,
        num_splits, SPLIT=split_tokens, DYNAMIC_LOOP=dynamic, **table, **consts,
    )  # fmt: skip
    _merge_splits_kernel[(batch * num_heads,)](
        acc, ml, out, num_splits, NSPLIT_P=triton.next_power_of_2(num_splits), D=head_dim, num_warps=1
    )
    return out


def rope_paged_decode_attention(
    q: torch.Tensor,  # [B, Hq * D], rows may be strided (column slices of one q|k|v projection)
    k: torch.Tensor,  # [B, Hkv * D]
    v: torch.Tensor,
    positions: torch.Tensor,  # [B] int64: the new token's position; the context is positions + 1
    cos: torch.Tensor,  # [P, D/2] fp32
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,  # Qwen3's per-head norms (None: none)
    k_norm: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,  # [num_blocks, Hkv, bs, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, MB] int32
    scale: float,
    tile: int = DEFAULT_TILE,
    num_warps: int = 4,
    num_stages: int = 2,
    kv_table: tuple[torch.Tensor, torch.Tensor] | None = None,  # as paged_decode_attention's
    new_in_registers: bool = False,  # the new token attended from registers (_rope_paged_decode_kernel)
    prefetch_table: bool = False,  # with new_in_registers: block table entries read a tile ahead
    max_registers: int | None = None,  # per thread (ptxas's maxnreg): more programs resident per SM
) -> torch.Tensor:
    """triton_kernels.qk_rope_write_kv followed by paged_decode_attention (no split, no shared
    prefix), in one kernel; returns [B, Hq * D]."""
    _check_offsets(k_cache)
    k_arg, v_arg, table = _cache_args(k_cache, v_cache, kv_table)
    batch, half, head_dim, num_heads, num_kv_heads = _rope_shapes(q, k, v, cos)
    group = num_heads // num_kv_heads
    out = torch.empty(batch, num_heads * head_dim, dtype=q.dtype, device=q.device)
    dynamic = os.environ.get("TRITON_INTERPRET") != "1"
    has_norm = q_norm is not None
    _rope_paged_decode_kernel[(batch, num_kv_heads)](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), positions, cos, sin,
        q_norm if has_norm else q, k_norm if has_norm else k, eps,
        k_arg, v_arg, block_tables, block_tables.stride(0), out, scale * 1.4426950408889634, **table,
        MAX_CTX=0 if dynamic else block_tables.shape[1] * k_cache.shape[2], DYNAMIC_LOOP=dynamic,
        HQ=num_heads, HKV=num_kv_heads, GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)),
        D=head_dim, HALF=half, HALF_P=triton.next_power_of_2(half), BS=k_cache.shape[2], TILE=tile,
        IEEE=q.dtype == torch.float32, HAS_NORM=has_norm, num_warps=num_warps, num_stages=num_stages,
        NEW_IN_REGISTERS=new_in_registers and half & (half - 1) == 0, PREFETCH_TABLE=prefetch_table,
        **({} if max_registers is None else dict(maxnreg=max_registers)),
    )  # fmt: skip
    return out
