"""The decode step's products (and, --attention, its attention) as one persistent kernel over every
layer, against the engine's kernels.

    python bench/decode_persistent.py [--size 0.5B] [--configs all|NAME,...] [--form barrier,dataflow]
                                      [--prefetch off,on] [--tma off,on] [--pair off,on] [--order phase,row]
                                      [--attention [--items head,row] [--context 512]] [--phases]

The decode step is bound by its kernels' fixed costs (rollout/native/NOTES.md, sessions 19-38): ~9
launches a layer, each paying a launch, a pipeline fill and one wave's tail, ~37 of a W0.5B layer's
~56 us. A persistent kernel runs every layer in one launch, its programs all resident, with a
grid-wide barrier wherever the next product needs the whole of the last one's output. This measures
how far that goes, for the products and for the attention between them:

- `now`: what the engine launches for a layer (NativeDecoder._qkv / _attend / _mlp): q|k|v, (with
  --attention) the fused rotary + KV write + paged attention kernel at the engine's settings, o_proj,
  gate|up, SiLU * up, down (cuBLAS; its own split-K reduce where it chooses one).
- `persistent`: one Triton kernel per step. A layer is four phases, each a persistent loop over its
  output tiles, with a grid barrier after each: q|k|v; o_proj; gate|up with SiLU * up applied to the
  tile in registers (gate and up rounded to the model dtype first, as the separate kernels round;
  --pair on: both products in one K loop, each A tile read once); down, its K split over SPLIT
  programs whose fp32 partials the last program to finish a tile sums in a fixed order (so the output
  does not depend on which finishes first). Configurations (CONFIGS) set the tiles, warps, pipeline
  stages and programs per SM. With --prefetch on, a program asks L2 for the weight rows of its next
  phase's first tile before it waits at the barrier; with --tma on, the products read their operands
  through TMA descriptors instead of pointers.
- `dataflow` (`--form dataflow`): the same tiles with no grid barrier. Every tile of every layer is an
  item of one list in dependency order, dealt round-robin to the programs; an item waits only for the
  row block it reads (per-row-block counters), so row blocks move through the layers on their own and
  one phase's last tiles overlap the next phase's first. `--order row` lists a layer's items row block
  by row block instead of phase by phase. With --attention, the engine's attention code
  (triton_attention._rope_attend_row) runs as items between q|k|v and o_proj, one per (row, KV head)
  as the engine's programs, or (`--items row`) one per row with all its KV heads
  (_rope_attend_row_heads), over a paged cache laid out as the rollout's: --prompts groups of
  rows / prompts samples sharing their prompt's blocks, every row at --context.
- `barriers only`: the barrier form's launch with every phase's work skipped: what its barriers cost.
  `--phases` times the best barrier configuration with one phase at a time (all barriers kept).

The chain stands in for a layer's data flow (without --attention, the attention output is replaced by
q's columns of q|k|v; the norms and the residual are left out on both sides): products of the real
shapes, each on the previous one's output, over every layer's own weights (and cache) so they stream
from HBM as in the rollout. Both sides are timed in one CUDA graph, best of several replays;
microseconds per layer. Each configuration is first checked against the engine's chain over two
layers (without norms the chain's scale drifts further down), and with --attention the attention
items' own output too.

The grid barrier needs every program resident at once: nothing else runs beside the kernel, and
programs per SM are capped in registers to fit. A barrier gives up after ~2^22 polls and raises a
flag (checked after each run), so a launch that breaks this fails in seconds instead of hanging.

Measured on one H200 (rollout/native/NOTES.md, sessions 39-40), W0.5B, us a layer:
- products only: 4 barriers a layer cost 4.5-5.6 us; the best barrier configuration (64 x 64 tiles,
  down split 4, 2 programs per SM, 5 stages) 39.77-40.21, the dataflow form 35.28-35.47 and with
  --pair 34.79-35.13, against 32.14-32.46 for the engine's kernels. The small products gain (q|k|v
  ~3.1, o_proj ~2.9 against ~5 each as launches), gate|up and down lose more: Triton's main loops.
- with the attention (context 512): the engine 51.22-51.78, the dataflow form 55.18-55.44 (items per
  (row, KV head)), 58.50 (per row), 100.51-100.53 (--order row). The attention costs as much inside the
  persistent kernel as in its own launch (~20 us a layer): its time is each program's chain of
  dependent tile loads, which no launch boundary adds to. Not used.
"""

from __future__ import annotations

import argparse
import itertools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from decode_gemm import SHAPES  # bench/ is on the path when a bench script runs
from hybridrl.kernels.cublaslt import time_graph_us
from hybridrl.rollout.native.triton_attention import _rope_attend_row, _softmax_update, rope_paged_decode_attention
from hybridrl.rollout.native.triton_kernels import _rms_rope_heads, _rope_at, _rope_write_kv
from hybridrl.rollout.native.triton_kernels import silu_mul


@triton.jit
def _wait_count(ptr, need, err_ptr, FENCE: tl.constexpr):
    """Waits until the counter at ptr reaches `need`; the gpu-scope acquire orders the loads after it.
    After ~2^22 polls it gives up and sets the error flag, and once the flag is set nothing waits: a
    launch whose programs are not all resident ends in seconds, wrong, instead of hanging the GPU."""
    seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    polls = tl.load(err_ptr, volatile=True) * 4194304
    while (seen < need) & (polls < 4194304):
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    if seen < need:
        tl.store(err_ptr, 1)
    if FENCE:  # what is read next through the async proxy (TMA) was stored by others through the generic one
        tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r,r", [need], dtype=tl.int32,
                                  is_pure=False, pack=1)  # fmt: skip
    tl.debug_barrier()


@triton.jit
def _signal(ptr):
    """Counts one arrival at ptr (a finished tile, or a program at a barrier), after every thread's stores
    (CTA barrier, then a gpu-scope release)."""
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release", scope="gpu")


@triton.jit
def _grid_sync(bar_ptr, err_ptr, target, FENCE: tl.constexpr):
    """Waits until `target` arrivals have been counted at bar_ptr, this program's included."""
    _signal(bar_ptr)
    _wait_count(bar_ptr, target, err_ptr, FENCE)


@triton.jit
def _prefetch_rows(w_ptr, row0, K: tl.constexpr, BN: tl.constexpr, LINES: tl.constexpr):
    """Asks L2 for rows [row0, row0 + BN) of a row-major [*, K] bf16 weight, one address per 128-byte line."""
    rows = row0 + tl.arange(0, BN)
    cols = tl.minimum(tl.arange(0, LINES) * 64, K - 1)
    ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _dot_tile(a_src, LDA: tl.constexpr, w_src, K0, KLEN: tl.constexpr, LDW: tl.constexpr, off_m, w_row,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """fp32 [BM, BN] tile of A[off_m:, K0:K0+KLEN] @ W[w_row:, K0:K0+KLEN]^T (A and W row-major bf16), read
    through pointers (A's rows LDA apart, W's LDW) or, TMA, through tensor descriptors."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if TMA:
        for k in range(0, KLEN, BK):
            a = a_src.load([off_m, K0 + k])
            w = w_src.load([w_row, K0 + k])
            acc = tl.dot(a, tl.trans(w), acc)
    else:
        rm = off_m + tl.arange(0, BM)
        rn = w_row + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        a_rows = a_src + rm.to(tl.int64)[:, None] * LDA
        w_rows = w_src + rn.to(tl.int64)[:, None] * LDW
        for k in range(0, KLEN, BK):
            a = tl.load(a_rows + (K0 + k + rk)[None, :], cache_modifier=".cg")  # written by other programs: past L1
            w = tl.load(w_rows + (K0 + k + rk)[None, :])
            acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def _dot_tile_pair(a_src, LDA: tl.constexpr, w_src, K: tl.constexpr, off_m, row_1, row_2, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """The fp32 [BM, BN] tiles of A[off_m:, :K] @ W[row_1:, :K]^T and of A[off_m:, :K] @ W[row_2:, :K]^T in one
    K loop: each A tile is read once for both, and the pipeline fills once."""
    acc_1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc_2 = tl.zeros((BM, BN), dtype=tl.float32)
    if TMA:
        for k in range(0, K, BK):
            a = a_src.load([off_m, k])
            acc_1 = tl.dot(a, tl.trans(w_src.load([row_1, k])), acc_1)
            acc_2 = tl.dot(a, tl.trans(w_src.load([row_2, k])), acc_2)
    else:
        rk = tl.arange(0, BK)
        a_rows = a_src + (off_m + tl.arange(0, BM)).to(tl.int64)[:, None] * LDA
        w_rows_1 = w_src + (row_1 + tl.arange(0, BN)).to(tl.int64)[:, None] * K
        w_rows_2 = w_src + (row_2 + tl.arange(0, BN)).to(tl.int64)[:, None] * K
        for k in range(0, K, BK):
            a = tl.load(a_rows + (k + rk)[None, :], cache_modifier=".cg")
            acc_1 = tl.dot(a, tl.trans(tl.load(w_rows_1 + (k + rk)[None, :])), acc_1)
            acc_2 = tl.dot(a, tl.trans(tl.load(w_rows_2 + (k + rk)[None, :])), acc_2)
    return acc_1, acc_2


@triton.jit
def _product_tile(a_src, LDA: tl.constexpr, K: tl.constexpr, w_src, w_row0, N: tl.constexpr, out_ptr, off_m, off_n,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """out[off_m:, off_n:] tile of a[M, :K] @ w[w_row0:w_row0 + N, K]^T in bf16 (a's rows LDA apart)."""
    acc = _dot_tile(a_src, LDA, w_src, 0, K, K, off_m, w_row0 + off_n, BM, BN, BK, TMA)
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty))


@triton.jit
def _product_phase(a_src, LDA: tl.constexpr, K: tl.constexpr, w_src, w_row0, N: tl.constexpr, out_ptr, pid,
                   M: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NPROG: tl.constexpr,
                   TMA: tl.constexpr):  # fmt: skip
    """out[M, N] = a[M, :K] @ w[w_row0:w_row0 + N, K]^T, tiles spread over the programs."""
    TM: tl.constexpr = M // BM
    TILES: tl.constexpr = TM * (N // BN)
    for t0 in range(0, TILES, NPROG):  # (range(pid, ...) would not run under Triton's interpreter)
        t = t0 + pid
        if t < TILES:
            _product_tile(a_src, LDA, K, w_src, w_row0, N, out_ptr, (t % TM) * BM, (t // TM) * BN, BM, BN, BK, TMA)


@triton.jit
def _gate_up_tile(a_src, H: tl.constexpr, w_src, w_row0, I: tl.constexpr, out_ptr, off_m, off_n, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr, PAIR: tl.constexpr):  # fmt: skip
    """out[off_m:, off_n:] tile of silu(a @ gate^T) * (a @ up^T), gate and up the two row halves of
    w[w_row0:w_row0 + 2I, H]; PAIR: both products in one K loop (_dot_tile_pair), else one after the other."""
    dtype = out_ptr.dtype.element_ty
    if PAIR:
        g, u = _dot_tile_pair(a_src, H, w_src, H, off_m, w_row0 + off_n, w_row0 + off_n + I, BM, BN, BK, TMA)
    else:
        g = _dot_tile(a_src, H, w_src, 0, H, H, off_m, w_row0 + off_n, BM, BN, BK, TMA)
        u = _dot_tile(a_src, H, w_src, 0, H, H, off_m, w_row0 + off_n + I, BM, BN, BK, TMA)
    # As the engine rounds: gate and up to the model dtype (the product's output), silu(gate) to it, the product.
    g = g.to(dtype).to(tl.float32)
    u = u.to(dtype).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * I + rn[None, :], (act * u).to(dtype))


@triton.jit
def _gate_up_phase(a_src, H: tl.constexpr, w_src, w_row0, I: tl.constexpr, out_ptr, pid, M: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NPROG: tl.constexpr, TMA: tl.constexpr,
                   PAIR: tl.constexpr):  # fmt: skip
    """out[M, I] = silu(a @ gate^T) * (a @ up^T), tiles spread over the programs."""
    TM: tl.constexpr = M // BM
    TILES: tl.constexpr = TM * (I // BN)
    for t0 in range(0, TILES, NPROG):
        t = t0 + pid
        if t < TILES:
            _gate_up_tile(a_src, H, w_src, w_row0, I, out_ptr, (t % TM) * BM, (t // TM) * BN, BM, BN, BK, TMA, PAIR)


@triton.jit
def _down_phase(a_src, I: tl.constexpr, w_src, w_row0, H: tl.constexpr, out_ptr, part_ptr, cnt_ptr, pid,
                M: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                NPROG: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """out[M, H] = a[M, I] @ w[H, I]^T, K split SPLIT ways (_down_unit), units spread over the programs."""
    TM: tl.constexpr = M // BM
    UNITS: tl.constexpr = TM * (H // BN) * SPLIT
    for u0 in range(0, UNITS, NPROG):
        u = u0 + pid
        if u < UNITS:
            tile = u // SPLIT
            _down_unit(a_src, I, w_src, w_row0, H, out_ptr, part_ptr, cnt_ptr, tile, u % SPLIT, (tile % TM) * BM,
                       (tile // TM) * BN, M, BM, BN, BK, SPLIT, TMA)  # fmt: skip


@triton.jit
def _down_unit(a_src, I: tl.constexpr, w_src, w_row0, H: tl.constexpr, out_ptr, part_ptr, cnt_ptr, tile, s, off_m,
               off_n, M: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
               TMA: tl.constexpr):  # fmt: skip
    """Split s of out[off_m:, off_n:] = a @ w[w_row0:, :]^T over K = I: the split's fp32 partial is stored,
    and the last split to finish the tile (cnt_ptr[tile] counts them) sums the partials in split order
    and stores the tile. Returns 1 where this call stored the tile."""
    KLEN: tl.constexpr = I // SPLIT
    dtype = out_ptr.dtype.element_ty
    acc = _dot_tile(a_src, I, w_src, s * KLEN, KLEN, I, off_m, w_row0 + off_n, BM, BN, BK, TMA)
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    offs = rm.to(tl.int64)[:, None] * H + rn[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + offs, acc.to(dtype))
        stored = tl.full([], 1, tl.int32)
    else:
        tl.store(part_ptr + s * M * H + offs, acc)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        stored = (done == SPLIT - 1).to(tl.int32)
        if done == SPLIT - 1:
            total = tl.load(part_ptr + offs, cache_modifier=".cg")
            for j in range(1, SPLIT):
                total += tl.load(part_ptr + j * M * H + offs, cache_modifier=".cg")
            tl.store(out_ptr + offs, total.to(dtype))
    return stored


@triton.jit
def _persistent_layers_kernel(
    y_ptr, qkv_ptr, o_ptr, act_ptr, part_ptr, cnt_ptr, bar_ptr, err_ptr,
    wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr,
    y_ld, qkv_ld, o_ld, act_ld, wqkv_ld, wo_ld, wgu_ld, wd_ld,  # what the products read: the pointers again, or descriptors
    L: tl.constexpr,
    M: tl.constexpr, H: tl.constexpr, QKV: tl.constexpr, I: tl.constexpr,
    BM_QKV: tl.constexpr, BN_QKV: tl.constexpr, BM_O: tl.constexpr, BN_O: tl.constexpr,
    BM_GU: tl.constexpr, BN_GU: tl.constexpr, BM_D: tl.constexpr, BN_D: tl.constexpr, SPLIT: tl.constexpr,
    BK: tl.constexpr, NPROG: tl.constexpr, PHASES: tl.constexpr, PREFETCH: tl.constexpr, LINES: tl.constexpr,
    TMA: tl.constexpr, FENCE: tl.constexpr, PAIR: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    D_TILES: tl.constexpr = (M // BM_D) * (H // BN_D)
    for layer in range(L):
        wqkv = wqkv_ptr + layer * (QKV * H)  # < 2^31 elements at every size benched
        wo = wo_ptr + layer * (H * H)
        wgu = wgu_ptr + layer * (2 * I * H)
        wd = wd_ptr + layer * (H * I)
        base = layer * 4 * NPROG
        if PHASES & 1:  # q|k|v = y @ Wqkv^T
            _product_phase(y_ld, H, H, wqkv_ld, layer * QKV, QKV, qkv_ptr, pid, M, BM_QKV, BN_QKV, BK, NPROG, TMA)
        if PREFETCH:
            if pid < (M // BM_O) * (H // BN_O):
                _prefetch_rows(wo, (pid // (M // BM_O)) * BN_O, H, BN_O, LINES)
        _grid_sync(bar_ptr, err_ptr, base + NPROG, FENCE)
        if PHASES & 2:  # o = q @ Wo^T (q's columns of q|k|v stand in for the attention output)
            _product_phase(qkv_ld, QKV, H, wo_ld, layer * H, H, o_ptr, pid, M, BM_O, BN_O, BK, NPROG, TMA)
        if PREFETCH:
            if pid < (M // BM_GU) * (I // BN_GU):
                row = (pid // (M // BM_GU)) * BN_GU
                _prefetch_rows(wgu, row, H, BN_GU, LINES)
                _prefetch_rows(wgu, row + I, H, BN_GU, LINES)
        _grid_sync(bar_ptr, err_ptr, base + 2 * NPROG, FENCE)
        if PHASES & 4:  # act = silu(o @ gate^T) * (o @ up^T)
            _gate_up_phase(o_ld, H, wgu_ld, layer * (2 * I), I, act_ptr, pid, M, BM_GU, BN_GU, BK, NPROG, TMA, PAIR)
        _grid_sync(bar_ptr, err_ptr, base + 3 * NPROG, FENCE)
        if PHASES & 8:  # y = act @ Wd^T
            _down_phase(act_ld, I, wd_ld, layer * H, H, y_ptr, part_ptr, cnt_ptr + layer * D_TILES, pid, M, BM_D, BN_D, BK,
                        SPLIT, NPROG, TMA)  # fmt: skip
        if PREFETCH:
            if layer + 1 < L:
                if pid < (M // BM_QKV) * (QKV // BN_QKV):
                    _prefetch_rows(wqkv + QKV * H, (pid // (M // BM_QKV)) * BN_QKV, H, BN_QKV, LINES)
        _grid_sync(bar_ptr, err_ptr, base + 4 * NPROG, FENCE)


@triton.jit
def _attend_tile_heads(q, kc_ptr, vc_ptr, bt_ptr, bt_stride, row, ctx, start, m_i, l_i, acc, scale_log2,
                       HKV: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
                       IEEE: tl.constexpr):  # fmt: skip
    """One online-softmax update of every KV head's queries (q [HKV * GROUP_P, D], state [HKV * GROUP_P] /
    [HKV * GROUP_P, D]) with the TILE cached tokens of `row` from `start` (those at or past ctx masked):
    the keys of all heads as one [HKV * TILE, D] operand, each query's scores against other heads' keys
    masked out (products of 2D operands; the wasted half costs less than a batched product's layouts)."""
    tok = start + tl.arange(0, TILE)
    t_mask = tok < ctx
    block = tl.load(bt_ptr + row * bt_stride + tok // BS, mask=t_mask, other=0).to(tl.int64)
    kv = tl.arange(0, HKV)
    slot = tl.reshape((block * (HKV * BS) + tok % BS)[None, :] + (kv * BS)[:, None], (HKV * TILE,))  # (head, token)
    key_ok = tl.reshape(t_mask[None, :] & (kv[:, None] >= 0), (HKV * TILE,))
    off = slot[:, None] * D + tl.arange(0, D)[None, :]
    same = (tl.arange(0, HKV * GROUP_P) // GROUP_P)[:, None] == (tl.arange(0, HKV * TILE) // TILE)[None, :]
    return _softmax_update(q, kc_ptr, vc_ptr, off, key_ok, same & key_ok[None, :], m_i, l_i, acc, scale_log2, IEEE)


@triton.jit
def _rope_attend_row_heads(
    qkv_ptr, QKV: tl.constexpr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, bt_ptr, bt_stride, out_ptr, scale_log2, row,
    MAX_CTX: tl.constexpr, DYNAMIC_LOOP: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, GROUP_P: tl.constexpr,
    D: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """_rope_attend_row's work for every KV head of `row` in one program (HKV a power of two, no q/k norms):
    the queries [HKV, GROUP_P, D] (each KV head's group of query heads, padded), every head's new key and
    value written to the cache and attended from registers first, then the cached tokens a tile at a time
    with one batched product per tile for all heads. One block-table read and one chain of tiles serve
    every head, each tile's loads HKV times as wide: the same arithmetic (and rounding) as the engine's
    kernel, with HKV heads' loads in flight per step of the chain instead of one."""
    HALF: tl.constexpr = D // 2
    GROUP: tl.constexpr = HQ // HKV
    dtype = out_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + row)
    hd, hd_mask, c, s = _rope_at(cos_ptr, sin_ptr, pos, HALF, HALF)
    kv = tl.arange(0, HKV)
    g = tl.arange(0, GROUP_P)
    head = tl.reshape(kv[:, None] * GROUP + g[None, :], (HKV * GROUP_P,))
    valid = tl.reshape((g[None, :] < GROUP) & (kv[:, None] >= 0), (HKV * GROUP_P,))
    q_off = head[:, None] * D + hd[None, :]
    q_mask = valid[:, None] & hd_mask[None, :]
    q_row = qkv_ptr + row * QKV
    q1 = tl.load(q_row + q_off, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_row + q_off + HALF, mask=q_mask, other=0.0).to(tl.float32)
    o1, o2 = _rms_rope_heads(q1, q2, qkv_ptr, c, s, hd, hd_mask, 1e-6, D, HALF, False, dtype)  # [HKV * GROUP_P, HALF]
    nk1, nk2, nv1, nv2 = _rope_write_kv(  # every KV head's new key and value: [HKV, HALF] each
        qkv_ptr + HQ * D, qkv_ptr + (HQ + HKV) * D, QKV, QKV, qkv_ptr, 1e-6, row, pos, kv[:, None],
        (kv[:, None] >= 0) & hd_mask[None, :], c, s, hd, hd_mask, kc_ptr, vc_ptr, bt_ptr, bt_stride, HKV, D, HALF, BS,
        False, dtype,
    )  # fmt: skip
    # the softmax state starts from the new token: its score in fp32, its weight 1 scaling its value
    QP: tl.constexpr = HKV * GROUP_P
    m_i = tl.reshape(tl.sum(tl.reshape(o1.to(tl.float32), (HKV, GROUP_P, HALF)) * nk1.to(tl.float32)[:, None, :], axis=2)
                     + tl.sum(tl.reshape(o2.to(tl.float32), (HKV, GROUP_P, HALF)) * nk2.to(tl.float32)[:, None, :], axis=2),
                     (QP,)) * scale_log2  # fmt: skip
    l_i = tl.full([QP], 1.0, tl.float32)
    new_v = tl.reshape(tl.permute(tl.join(nv1.to(tl.float32), nv2.to(tl.float32)), (0, 2, 1)), (HKV, D))
    acc = tl.reshape(tl.broadcast_to(new_v[:, None, :], (HKV, GROUP_P, D)), (QP, D))
    q = tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), (QP, D))  # [q1 | q2] per head
    if DYNAMIC_LOOP:
        for start in range(0, pos, TILE):
            m_i, l_i, acc = _attend_tile_heads(q, kc_ptr, vc_ptr, bt_ptr, bt_stride, row, pos, start, m_i, l_i, acc,
                                               scale_log2, HKV, GROUP_P, D, BS, TILE, IEEE)  # fmt: skip
    else:  # (the interpreter: a constant bound, tiles past the context fully masked)
        for start in tl.static_range(0, MAX_CTX, TILE):
            m_i, l_i, acc = _attend_tile_heads(q, kc_ptr, vc_ptr, bt_ptr, bt_stride, row, pos, start, m_i, l_i, acc,
                                               scale_log2, HKV, GROUP_P, D, BS, TILE, IEEE)  # fmt: skip
    out = acc / l_i[:, None]
    o_off = head[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(out_ptr + row * (HQ * D) + o_off, out.to(dtype), mask=valid[:, None])


@triton.jit
def _dataflow_layers_kernel(
    y_ptr, qkv_ptr, o_ptr, act_ptr, part_ptr, tile_cnt_ptr, ready_ptr, err_ptr,
    y_ld, qkv_ld, o_ld, act_ld, wqkv_ld, wo_ld, wgu_ld, wd_ld, attn_ld,
    attn_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, bt_ptr, bt_stride, scale_log2, cache_stride,
    L: tl.constexpr, M: tl.constexpr, H: tl.constexpr, QKV: tl.constexpr, I: tl.constexpr, BM: tl.constexpr,
    BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_D: tl.constexpr, SPLIT: tl.constexpr,
    BK: tl.constexpr, NPROG: tl.constexpr, TMA: tl.constexpr, FENCE: tl.constexpr, PAIR: tl.constexpr,
    ATTN: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr,
    HALF_P: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr, MAX_CTX: tl.constexpr, DYNAMIC_LOOP: tl.constexpr,
    IEEE: tl.constexpr, ROW_MAJOR: tl.constexpr, ATTN_ROWS: tl.constexpr,
):  # fmt: skip
    """The same chain with no grid barrier: every item of every layer is one entry of a list in
    dependency order (layer, then phase, then row block; ROW_MAJOR: layer, then row block, then phase,
    so that one row block's attention runs beside the next one's products), dealt round-robin to the programs, and an
    item waits only for the row block it reads: q|k|v for the last layer's down tiles of its rows, o_proj
    for its rows' q|k|v tiles, gate|up for its rows' o_proj tiles, a down split for the gate|up tiles of
    its K range. Row blocks move through the layers on their own, and one phase's last tiles overlap the
    next phase's first.

    ATTN: between q|k|v and o_proj, the engine's rotary + KV write + paged attention
    (triton_attention._rope_attend_row) as items of one (row, KV head) each, or (ATTN_ROWS) of one row
    with all its KV heads (_rope_attend_row_heads), waiting for their row block's q|k|v tiles, over this layer's slice of the paged cache (cache_stride elements a layer);
    o_proj then reads their output and waits for all of its row block's. Without ATTN, q's columns of
    q|k|v stand in for the attention output.

    ready_ptr holds per layer and row block: down tiles stored, q|k|v tiles, o_proj tiles, (ATTN)
    attention items, then gate|up tiles per down split. Each program takes its items in list order,
    and an item depends only on earlier ones, so the earliest unfinished item can always run: no
    deadlock."""
    pid = tl.program_id(0)
    TM: tl.constexpr = M // BM
    TN_Q: tl.constexpr = QKV // BN_QKV
    TN_O: tl.constexpr = H // BN_O
    TN_G: tl.constexpr = I // BN_GU
    TN_D: tl.constexpr = H // BN_D
    NQ: tl.constexpr = TM * TN_Q
    NA: tl.constexpr = (M if ATTN_ROWS else M * HKV) if ATTN else 0
    NO: tl.constexpr = TM * TN_O
    NG: tl.constexpr = TM * TN_G
    ND: tl.constexpr = TM * TN_D * SPLIT
    PER: tl.constexpr = NQ + NA + NO + NG + ND
    A: tl.constexpr = 4 if ATTN else 3  # the first gate|up counter of a row block
    NR: tl.constexpr = A + SPLIT
    KLEN: tl.constexpr = I // SPLIT
    GROUP: tl.constexpr = HQ // HKV
    for it0 in range(0, L * PER, NPROG):
        it = it0 + pid
        if it < L * PER:
            layer = it // PER
            r = it % PER
            if ROW_MAJOR:  # the list is (layer, row block, phase): r becomes the phase-major index of the same item
                rb = r // (PER // TM)
                q = r % (PER // TM)
                if q < TN_Q:
                    r = rb * TN_Q + q
                elif q < TN_Q + NA // TM:
                    r = NQ + rb * (NA // TM) + q - TN_Q
                elif q < TN_Q + NA // TM + TN_O:
                    r = NQ + NA + rb * TN_O + q - TN_Q - NA // TM
                elif q < TN_Q + NA // TM + TN_O + TN_G:
                    r = NQ + NA + NO + rb * TN_G + q - TN_Q - NA // TM - TN_O
                else:
                    r = NQ + NA + NO + NG + rb * (TN_D * SPLIT) + q - TN_Q - NA // TM - TN_O - TN_G
            ready = ready_ptr + layer * (TM * NR)
            if r < NQ:  # q|k|v = y @ Wqkv^T
                tm = r // TN_Q
                if layer > 0:
                    _wait_count(ready - TM * NR + tm * NR, TN_D, err_ptr, FENCE)
                _product_tile(y_ld, H, H, wqkv_ld, layer * QKV, QKV, qkv_ptr, tm * BM, (r % TN_Q) * BN_QKV, BM, BN_QKV,
                              BK, TMA)  # fmt: skip
                _signal(ready + tm * NR + 1)
            elif r < NQ + NA:  # attn[row, kvh's query heads] = attention of row's rotated queries over its context
                if ATTN:  # (compiled only with ATTN: NA is 0 without)
                    r = r - NQ
                    cache = layer.to(tl.int64) * cache_stride
                    if ATTN_ROWS:  # every KV head of row r
                        tm = r // BM
                        _wait_count(ready + tm * NR + 1, TN_Q, err_ptr, False)
                        _rope_attend_row_heads(
                            qkv_ptr, QKV, pos_ptr, cos_ptr, sin_ptr, kc_ptr + cache, vc_ptr + cache, bt_ptr, bt_stride,
                            attn_ptr, scale_log2, r.to(tl.int64), MAX_CTX, DYNAMIC_LOOP, HQ, HKV, GROUP_P, D, BS, TILE,
                            IEEE,
                        )  # fmt: skip
                    else:  # one (row, KV head), as the engine's kernel's programs
                        row = r // HKV
                        tm = row // BM
                        _wait_count(ready + tm * NR + 1, TN_Q, err_ptr, False)
                        _rope_attend_row(
                            qkv_ptr, qkv_ptr + HQ * D, qkv_ptr + (HQ + HKV) * D, QKV, QKV, QKV, pos_ptr, cos_ptr,
                            sin_ptr, qkv_ptr, qkv_ptr, 1e-6, kc_ptr + cache, vc_ptr + cache, bt_ptr, bt_stride, attn_ptr,
                            scale_log2, row.to(tl.int64), r % HKV, MAX_CTX, DYNAMIC_LOOP, HQ, HKV, GROUP, GROUP_P, D,
                            D // 2, HALF_P, BS, TILE, IEEE, False, True, True,
                        )  # fmt: skip
                    _signal(ready + tm * NR + 3)
            elif r < NQ + NA + NO:  # o = attn @ Wo^T (or q @ Wo^T)
                r = r - NQ - NA
                tm = r // TN_O
                if ATTN:
                    _wait_count(ready + tm * NR + 3, NA // TM, err_ptr, FENCE)
                    _product_tile(attn_ld, H, H, wo_ld, layer * H, H, o_ptr, tm * BM, (r % TN_O) * BN_O, BM, BN_O, BK,
                                  TMA)  # fmt: skip
                else:
                    _wait_count(ready + tm * NR + 1, TN_Q, err_ptr, FENCE)
                    _product_tile(qkv_ld, QKV, H, wo_ld, layer * H, H, o_ptr, tm * BM, (r % TN_O) * BN_O, BM, BN_O, BK,
                                  TMA)  # fmt: skip
                _signal(ready + tm * NR + 2)
            elif r < NQ + NA + NO + NG:  # act = silu(o @ gate^T) * (o @ up^T)
                r = r - NQ - NA - NO
                tm = r // TN_G
                off_n = (r % TN_G) * BN_GU
                _wait_count(ready + tm * NR + 2, TN_O, err_ptr, FENCE)
                _gate_up_tile(o_ld, H, wgu_ld, layer * (2 * I), I, act_ptr, tm * BM, off_n, BM, BN_GU, BK, TMA, PAIR)
                _signal(ready + tm * NR + A + off_n // KLEN)
            else:  # y = act @ Wd^T, split s of a tile
                r = r - NQ - NA - NO - NG
                tile = r // SPLIT
                split = r % SPLIT
                tm = tile // TN_D
                _wait_count(ready + tm * NR + A + split, KLEN // BN_GU, err_ptr, FENCE)
                stored = _down_unit(act_ld, I, wd_ld, layer * H, H, y_ptr, part_ptr, tile_cnt_ptr + layer * (TM * TN_D),
                                    tile, split, tm * BM, (tile % TN_D) * BN_D, M, BM, BN_D, BK, SPLIT, TMA)  # fmt: skip
                if stored != 0:
                    _signal(ready + tm * NR)


@dataclass
class Attention:
    """What the attention items read and write, as the engine lays it out: the new token's position per
    row, the rotary tables ([P, D / 2] fp32), every layer's paged K / V cache ([L, blocks, Hkv, bs, D]) and
    the rows' block tables ([rows, max blocks] int32). The engine's settings for head dim <= 64
    (ops_triton.TritonOps): 64-token tiles, the new token in registers, the block table read a tile ahead."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    heads: int
    tile: int = 64

    @property
    def kv_heads(self) -> int:
        return self.k_cache.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k_cache.shape[4]

    def engine(self, q, k, v, layer: int) -> torch.Tensor:
        """The engine's fused kernel for one layer (what `now` launches)."""
        return rope_paged_decode_attention(
            q, k, v, self.positions, self.cos, self.sin, None, None, 1e-6, self.k_cache[layer], self.v_cache[layer],
            self.block_tables, self.head_dim**-0.5, tile=self.tile, num_warps=4, num_stages=3,
            new_in_registers=True, prefetch_table=True,
        )  # fmt: skip


class Persistent:
    """The persistent kernel's buffers and launch; `run(y)` replaces y [M, H] with the chain's output
    after every layer."""

    def __init__(self, rows, hidden, qkv, inter, layers, wqkv, wo, wgu, wd, *, bm_qkv=64, bn_qkv=64, bm_o=64,
                 bn_o=64, bm_gu=64, bn_gu=64, bm_d=64, bn_d=64, split=2, bk=64, num_warps=4, num_stages=3,
                 phases=15, prefetch=False, per_sm=1, tma=False, form="barrier", nprog=None, pair=False,
                 attention: Attention | None = None, row_major=False, attention_rows=False):  # fmt: skip
        dev = wqkv.device
        assert form in ("barrier", "dataflow"), form
        if form == "dataflow":  # row blocks are the unit of dependency: one block height for every phase
            assert bm_qkv == bm_o == bm_gu == bm_d, "the dataflow form needs one row block for every phase"
            assert (inter // split) % bn_gu == 0, "a down split's K range must be whole gate|up tiles"
            assert phases == 15 and not prefetch, "the dataflow form runs every phase, without prefetch"
        assert attention is None or form == "dataflow", "attention items run in the dataflow form only"
        self.form = form
        for total, block in ((rows, bm_qkv), (rows, bm_o), (rows, bm_gu), (rows, bm_d), (qkv, bn_qkv), (hidden, bn_o),
                             (inter, bn_gu), (hidden, bn_d), (hidden, bk), (inter, bk * split)):  # fmt: skip
            assert total % block == 0, f"{total} is not a multiple of {block}"
        # per_sm programs on every SM, all resident at once (per_sm > 1 caps the registers to fit them)
        self.nprog = nprog or per_sm * torch.cuda.get_device_properties(dev).multi_processor_count
        self.layers = layers
        dt = wqkv.dtype
        self.qkv = torch.empty(rows, qkv, dtype=dt, device=dev)
        self.o = torch.empty(rows, hidden, dtype=dt, device=dev)
        self.act = torch.empty(rows, inter, dtype=dt, device=dev)
        self.attn = torch.empty(rows, hidden, dtype=dt, device=dev) if attention is not None else self.o
        self.attention = attention
        self.part = torch.empty(max(split, 1), rows, hidden, dtype=torch.float32, device=dev)
        d_tiles = (rows // bm_d) * (hidden // bn_d)
        self.ready_at = 2 + layers * d_tiles
        # zeroed per launch: [0] the barrier's arrivals, [1] the error flag, each layer's down tiles' split
        # counters, then (dataflow) each layer's and row block's ready counts (_dataflow_layers_kernel)
        self.ready_per_block = (3 if attention is None else 4) + split
        ready = layers * (rows // bm_d) * self.ready_per_block
        self.counters = torch.zeros(self.ready_at + ready, dtype=torch.int32, device=dev)
        self.weights = (wqkv, wo, wgu, wd)
        self.tma = tma
        self.pair = pair
        self.row_major = row_major
        self.attention_rows = attention_rows  # an attention item is a row (all KV heads), not a (row, KV head)
        assert not row_major or form == "dataflow", "the item order is the dataflow form's"
        self.blocks = dict(y=(bm_qkv, bk), qkv=(bm_o, bk), o=(bm_gu, bk), act=(bm_d, bk), wqkv=(bn_qkv, bk), wo=(bn_o, bk),
                           wgu=(bn_gu, bk), wd=(bn_d, bk), attn=(bm_o, bk))  # fmt: skip
        self._sources: dict[int, tuple] = {}  # y's address -> what the products read
        self.consts = dict(
            M=rows, H=hidden, QKV=qkv, I=inter, BM_QKV=bm_qkv, BN_QKV=bn_qkv, BM_O=bm_o, BN_O=bn_o, BM_GU=bm_gu,
            BN_GU=bn_gu, BM_D=bm_d, BN_D=bn_d, SPLIT=split, BK=bk, NPROG=self.nprog, PHASES=phases, PREFETCH=prefetch,
            LINES=triton.next_power_of_2(max(hidden // 64, 1)),
            num_warps=num_warps, num_stages=num_stages,
            **({} if per_sm == 1 else dict(maxnreg=65536 // (per_sm * num_warps * 32) // 8 * 8)),
        )  # fmt: skip

    def _read_through(self, y: torch.Tensor) -> tuple:
        """The products' operands: the tensors themselves, or (tma) TMA descriptors of them, weights as [L * N, K]."""
        key = y.data_ptr()
        if key not in self._sources:
            tensors = dict(y=y, qkv=self.qkv, o=self.o, act=self.act, wqkv=self.weights[0], wo=self.weights[1],
                           wgu=self.weights[2], wd=self.weights[3], attn=self.attn)  # fmt: skip
            if self.tma:
                from triton.tools.tensor_descriptor import TensorDescriptor

                def desc(name):
                    t = tensors[name]
                    t = t.reshape(-1, t.shape[-1])
                    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(self.blocks[name]))

                self._sources[key] = tuple(desc(name) for name in tensors)
            else:
                self._sources[key] = tuple(tensors.values())
        return self._sources[key]

    def run(self, y: torch.Tensor) -> None:
        c = self.counters
        c.zero_()
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        fence = self.tma and not interpreted  # (no inline PTX in the interpreter)
        if self.form == "dataflow":
            k = self.consts
            a = self.attention
            if a is None:  # (the attention's arguments unused: anything of the right kind)
                attn_args = (y, c, y, y, y, y, c, 0, 1.0, 0)
                attn_consts = dict(HQ=1, HKV=1, GROUP_P=16, D=16, HALF_P=8, BS=16, TILE=16, MAX_CTX=0)
            else:
                attn_args = (self.attn, a.positions, a.cos, a.sin, a.k_cache, a.v_cache, a.block_tables,
                             a.block_tables.stride(0), a.head_dim**-0.5 * 1.4426950408889634, a.k_cache[0].numel())  # fmt: skip
                attn_consts = dict(
                    HQ=a.heads, HKV=a.kv_heads, GROUP_P=max(16, triton.next_power_of_2(a.heads // a.kv_heads)),
                    D=a.head_dim, HALF_P=triton.next_power_of_2(a.head_dim // 2), BS=a.k_cache.shape[3], TILE=a.tile,
                    MAX_CTX=a.block_tables.shape[1] * a.k_cache.shape[3] if interpreted else 0,
                )  # fmt: skip
            _dataflow_layers_kernel[(self.nprog,)](
                y, self.qkv, self.o, self.act, self.part, c[2:], c[self.ready_at :], c[1:], *self._read_through(y),
                *attn_args, self.layers, M=k["M"], H=k["H"], QKV=k["QKV"], I=k["I"], BM=k["BM_D"], BN_QKV=k["BN_QKV"],
                BN_O=k["BN_O"], BN_GU=k["BN_GU"], BN_D=k["BN_D"], SPLIT=k["SPLIT"], BK=k["BK"], NPROG=self.nprog,
                TMA=self.tma, FENCE=fence, PAIR=self.pair, ATTN=a is not None, **attn_consts,
                DYNAMIC_LOOP=not interpreted, IEEE=y.dtype == torch.float32, ROW_MAJOR=self.row_major,
                ATTN_ROWS=self.attention_rows,
                num_warps=k["num_warps"],
                num_stages=k["num_stages"], **({"maxnreg": k["maxnreg"]} if "maxnreg" in k else {}),
            )  # fmt: skip
            return
        _persistent_layers_kernel[(self.nprog,)](
            y, self.qkv, self.o, self.act, self.part, c[2:], c[0:], c[1:], *self.weights, *self._read_through(y)[:8],
            self.layers, **self.consts, TMA=self.tma, FENCE=fence, PAIR=self.pair,
        )  # fmt: skip

    def failed(self) -> bool:
        return bool(self.counters[1].item())


CONFIGS = {  # name: (bm_qkv, bn_qkv, bm_o, bn_o, bm_gu, bn_gu, bm_d, bn_d, split, bk, warps, stages, programs per SM)
    "64x64 s2": (64, 64, 64, 64, 64, 64, 64, 64, 2, 64, 4, 3, 1),
    "64x64 s4": (64, 64, 64, 64, 64, 64, 64, 64, 4, 64, 4, 3, 1),
    "64x32 s2": (64, 32, 64, 32, 64, 64, 64, 32, 2, 64, 4, 3, 1),
    "128x64 s4 8w": (128, 64, 128, 64, 128, 64, 128, 64, 4, 64, 8, 3, 1),
    "gu128x64 s2 8w": (64, 64, 64, 64, 128, 64, 64, 64, 2, 64, 8, 3, 1),
    "64x64 s2 2/SM": (64, 64, 64, 64, 64, 64, 64, 64, 2, 64, 4, 3, 2),
    "64x64 s4 2/SM": (64, 64, 64, 64, 64, 64, 64, 64, 4, 64, 4, 3, 2),
    "64x64 s4 2/SM 4st": (64, 64, 64, 64, 64, 64, 64, 64, 4, 64, 4, 4, 2),
    "64x64 s4 3/SM": (64, 64, 64, 64, 64, 64, 64, 64, 4, 64, 4, 3, 3),
    "64x64 s4 4/SM": (64, 64, 64, 64, 64, 64, 64, 64, 4, 64, 4, 3, 4),
    "128x64 s4 8w 2/SM": (128, 64, 128, 64, 128, 64, 128, 64, 4, 64, 8, 3, 2),
    "64x64 s4 2/SM 5st": (64, 64, 64, 64, 64, 64, 64, 64, 4, 64, 4, 5, 2),
    "gu64x32 2/SM 4st": (64, 64, 64, 64, 64, 32, 64, 64, 4, 64, 4, 4, 2),
    "gu128x32 2/SM 4st": (64, 64, 64, 64, 128, 32, 64, 64, 4, 64, 4, 4, 2),
    "gu64x32 d64x32s2 2/SM 4st": (64, 64, 64, 64, 64, 32, 64, 32, 2, 64, 4, 4, 2),
    "gu64x32 d64x32s4 2/SM 4st": (64, 64, 64, 64, 64, 32, 64, 32, 4, 64, 4, 4, 2),
    "gu64x32 d128x64s4 2/SM 4st": (64, 64, 64, 64, 64, 32, 128, 64, 4, 64, 4, 4, 2),
}
PHASE_NAMES = {1: "q|k|v", 2: "o_proj", 4: "gate|up + SiLU * up", 8: "down"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SHAPES), default="0.5B")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--configs", default="all", help="comma-separated names of CONFIGS, or all")
    ap.add_argument("--prefetch", default="off,on", help="off, on or off,on")
    ap.add_argument("--form", default="barrier", help="barrier, dataflow or barrier,dataflow")
    ap.add_argument("--tma", default="off", help="off, on or off,on: the products read through TMA descriptors")
    ap.add_argument("--pair", default="off", help="off, on or off,on: gate|up's two products in one K loop")
    ap.add_argument("--order", default="phase", help="phase, row or phase,row: the dataflow form's item list by "
                    "(layer, phase, row block) or by (layer, row block, phase)")  # fmt: skip
    ap.add_argument("--attention", action="store_true",
                    help="the engine's rotary + paged attention between q|k|v and o_proj on both sides (dataflow form "
                         "only), over a paged cache laid out as the rollout's (the rows of each of --prompts prompts sharing its "
                         "blocks)")  # fmt: skip
    ap.add_argument("--items", default="head", help="with --attention: head, row or head,row: an attention item is "
                    "one (row, KV head), as the engine's programs, or one row with all its KV heads")  # fmt: skip
    ap.add_argument("--context", type=int, default=512, help="with --attention: every row's context (new token included)")
    ap.add_argument("--prompts", type=int, default=32, help="with --attention: prompts; rows / prompts samples each")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--phases", action="store_true", help="also time the best configuration with one phase at a time")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    hidden, inter, heads, kv_heads, head_dim, layers, _ = SHAPES[args.size]
    qkv = (heads + 2 * kv_heads) * head_dim
    assert heads * head_dim == hidden
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16

    def weight(n, k, gain=1.0):
        return (torch.randn(layers, n, k, device=dev) * (gain / k**0.5)).to(dt)

    # Without norms the chain's scale drifts from layer to layer (SiLU(g) * u is quadratic in it), so the
    # output is checked after two layers, where it is still near unit size; the timed runs do all of them.
    wqkv, wo, wgu, wd = weight(qkv, hidden), weight(hidden, hidden), weight(2 * inter, hidden), weight(hidden, inter, 1.7)
    x = torch.randn(args.rows, hidden, device=dev).to(dt)
    att = None
    if args.attention:
        from decode_attention import BLOCK, block_tables

        assert args.rows % args.prompts == 0 and args.context > args.prompt_len
        max_ctx = -(-args.context // BLOCK) * BLOCK
        bt, blocks = block_tables(args.prompts, args.rows // args.prompts, args.prompt_len, max_ctx,
                                  torch.Generator().manual_seed(0))  # fmt: skip
        cache = [torch.randn(layers, blocks, kv_heads, BLOCK, head_dim, device=dev).to(dt) for _ in range(2)]
        ang = torch.rand(max_ctx, head_dim // 2, device=dev) * 6
        att = Attention(torch.full((args.rows,), args.context - 1, device=dev), ang.cos(), ang.sin(), *cache, bt.to(dev),
                        heads)  # fmt: skip

    last = {}  # the engine's last attention output

    def engine_layer(y: torch.Tensor, i: int) -> torch.Tensor:  # NativeDecoder._qkv / _attend / _mlp's launches
        if att is None:
            a = F.linear(y, wqkv[i])[:, :hidden]
        else:
            a = att.engine(*F.linear(y, wqkv[i]).split([hidden, kv_heads * head_dim, kv_heads * head_dim], -1), i)
            last["attn"] = a
        o = F.linear(a, wo[i])
        g, u = F.linear(o, wgu[i]).split([inter, inter], -1)
        return F.linear(silu_mul(g, u), wd[i])

    def engine(y: torch.Tensor, n: int = layers) -> torch.Tensor:
        for i in range(n):
            y = engine_layer(y, i)
        return y

    check_layers = 2
    ref = engine(x, check_layers).float()
    ref_attn = last["attn"].float() if att is not None else None  # the second layer's
    scale = ref.abs().max().item()
    assert 1e-3 < scale < 1e3, f"the check's reference is out of range ({scale})"
    now = time_graph_us(lambda: engine(x), layers, args.reps)
    what = "q|k|v, rotary + paged attention" if att is not None else "q|k|v"
    print(f"{args.size}, {args.rows} rows, {layers} layers, us per layer ({what} {qkv}x{hidden}, o_proj, gate|up "
          f"{2 * inter}x{hidden} + SiLU * up, down {hidden}x{inter})"
          + (f"; every row at context {args.context}, {args.prompts} prompts of {args.prompt_len}" if att else ""))  # fmt: skip
    print(f"  now (cuBLAS products{' + the attention kernel' if att else ''} + SiLU * up, "
          f"{'6-7' if att else '5-6'} launches a layer): {now:.2f}", flush=True)  # fmt: skip
    names = list(CONFIGS) if args.configs == "all" else args.configs.split(",")
    y = x.clone()
    results, bare_us = [], {}
    for form, name, prefetch, tma, pair, order, items in itertools.product(
        args.form.split(","), names, args.prefetch.split(","), args.tma.split(","), args.pair.split(","),
        args.order.split(","), args.items.split(",") if att is not None else ["head"],
    ):  # fmt: skip
        if order == "row" and form != "dataflow":
            continue
        if form == "dataflow" and (prefetch == "on" or len(set(CONFIGS[name][0:8:2])) > 1):
            continue  # (the dataflow form: one row block height, no prefetch)
        if att is not None and form != "dataflow":
            continue
        bm_qkv, bn_qkv, bm_o, bn_o, bm_gu, bn_gu, bm_d, bn_d, split, bk, warps, stages, per_sm = CONFIGS[name]
        kw = dict(bm_qkv=bm_qkv, bn_qkv=bn_qkv, bm_o=bm_o, bn_o=bn_o, bm_gu=bm_gu, bn_gu=bn_gu, bm_d=bm_d, bn_d=bn_d,
                  split=split, bk=bk, num_warps=warps, num_stages=stages, prefetch=prefetch == "on", per_sm=per_sm,
                  tma=tma == "on", form=form, pair=pair == "on", attention=att, row_major=order == "row",
                  attention_rows=items == "row")  # fmt: skip
        label = (f"{form} {name}{' prefetch' if prefetch == 'on' else ''}{' tma' if tma == 'on' else ''}"
                 f"{' pair' if pair == 'on' else ''}{' row-major' if order == 'row' else ''}"
                 f"{' row items' if items == 'row' else ''}")  # fmt: skip
        try:
            check = Persistent(args.rows, hidden, qkv, inter, check_layers, wqkv, wo, wgu, wd, **kw)
            y.copy_(x)
            check.run(y)
            torch.cuda.synchronize()
            failed = check.failed()
            err = (y.float() - ref).abs().max().item() / scale
            if att is not None:  # and the attention items' own output, the second layer's
                err = max(err, (check.attn.float() - ref_attn).abs().max().item() / ref_attn.abs().max().item())
            p = Persistent(args.rows, hidden, qkv, inter, layers, wqkv, wo, wgu, wd, **kw)
            y.copy_(x)
            p.run(y)
            torch.cuda.synchronize()
            failed = failed or p.failed()
        except Exception as e:  # out of shared memory or registers: skip the configuration
            print(f"  {label}: failed ({type(e).__name__}: {str(e).splitlines()[0][:100]})", flush=True)
            continue
        if failed:
            print(f"  {label}: a wait gave up (programs not all resident?), not timed", flush=True)
            continue
        if not err <= 2e-2:  # (NaN fails too)
            print(f"  {label}: wrong after {check_layers} layers (relative {err:.2e}), not timed", flush=True)
            continue

        def launch(p=p):
            y.copy_(x)
            p.run(y)

        t = time_graph_us(launch, layers, args.reps)
        if (warps, per_sm) not in bare_us:  # the same launch with no work: 4 barriers a layer
            bare = Persistent(args.rows, hidden, qkv, inter, layers, wqkv, wo, wgu, wd,
                              **{**kw, "prefetch": False, "tma": False, "form": "barrier", "attention": None,
                                 "row_major": False, "attention_rows": False},
                              phases=0)  # fmt: skip
            bare_us[warps, per_sm] = time_graph_us(lambda: bare.run(y), layers, args.reps)
        results.append((t, label, kw))
        print(f"  {label}: {t:.2f} (barriers only {bare_us[warps, per_sm]:.2f}), relative difference "
              f"{err:.2e} after {check_layers} layers", flush=True)  # fmt: skip
    if not results:
        return
    t, label, kw = min(results, key=lambda r: r[0])
    print(f"best persistent: {label} {t:.2f} us a layer against {now:.2f} us now: {now - t:+.2f} us a layer "
          f"({(now - t) * layers * 511 / 1e3:+.1f} ms over a rollout of 511 decode steps)")  # fmt: skip
    barrier = [r for r in results if r[2]["form"] == "barrier"]
    if args.phases and barrier:  # the best barrier form, each phase alone with all four barriers (the others' tiles skipped)
        t, label, kw = min(barrier, key=lambda r: r[0])
        parts = []
        for bit, what in PHASE_NAMES.items():
            one = Persistent(args.rows, hidden, qkv, inter, layers, wqkv, wo, wgu, wd, **kw, phases=bit)
            parts.append(f"{what} {time_graph_us(lambda one=one: one.run(y), layers, args.reps):.2f}")
        print(f"  {label}, one phase at a time (us a layer, barriers included): " + ", ".join(parts))


if __name__ == "__main__":
    main()
