"""Forward attention over packed variable-length segments in Triton, query heads of a KV head stacked.

`varlen_forward(q [Tq, H, D], k / v [Tk, Hkv, D], cu_q, cu_k, max_q, scale)` returns what
PyTorch's FlashAttention-2 varlen forward returns (`attention.varlen_attention`'s contract): the
output `[Tq, H, D]` and the natural-log log-sum-exp `[H, Tq]` fp32, causal from the bottom right of
each segment (query i of a segment of Lq queries and Lk keys sees keys j <= i + Lk - Lq). So
FlashAttention-2's backward, which needs only (q, k, v, out, lse), can take this forward's output.

What differs from FlashAttention-2 is the tile's rows. FlashAttention-2 gives each query head its
own programs, so the GROUP query heads that share a KV head each load every K/V tile of their
segment. Here a program's BLOCK_M rows are (token, query head) pairs of one KV head, token-major:
GROUP consecutive rows are one token's query heads, so each K/V tile is loaded once for all of
them, and at W0.5B shapes (7 query heads per KV head, head dim 64) a tile of 128 rows holds ~18
tokens, whose causal limits differ by at most 18 keys. The loop over a block's keys runs unmasked
up to the first row's limit and masked over the last few tiles only. On Hopper `tl.dot` with 128
rows is a warpgroup MMA (wgmma), where PyTorch's FlashAttention-2 uses Ampere's mma.sync.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# (BLOCK_M, BLOCK_N, num_warps, num_stages) by head dim (rounded up to a power of two): rows of
# (token, query head) pairs and keys per tile. Measured on an H200 (bench/flex_attention.py --kernels
# --triton-configs ...; train/NOTES.md, session 20). HYBRIDRL_VARLEN_TILES=M:N:WARPS:STAGES overrides them.
CONFIGS = {64: (128, 64, 4, 3), 128: (64, 64, 4, 3)}
FALLBACK_CONFIG = (64, 64, 4, 2)  # other head dims: smaller tiles, so the accumulator stays in registers


# The kernels' integer arguments that follow the packed row's token count. Triton compiles a kernel
# once per specialization of its integer arguments (equal to 1, divisible by 16, or neither), so
# a step whose token count changes class (a response ending early) would compile the kernel again
# mid-run, ~1 s each time. These arguments only index the log-sum-exp rows and order the programs:
# compiled for sm_90, the forward's PTX code is the same with and without the divisibility, so
# they are never specialized.
VARYING_INTS = ("Tq", "NUM_BLOCKS")


def _tiles_from_env(name: str, kernels: int) -> tuple[tuple[int, int, int, int], ...] | None:
    """The tile override in environment variable `name`: `kernels` comma-separated M:N:WARPS:STAGES
    groups of four integers, or None when the variable is unset or empty."""
    env = os.environ.get(name)
    if not env:
        return None
    parts = [part.split(":") for part in env.split(",")]
    try:
        tiles = tuple(tuple(int(x) for x in part) for part in parts)
    except ValueError:
        tiles = ()
    if len(tiles) != kernels or any(len(t) != 4 for t in tiles):
        example = ",".join(["M:N:WARPS:STAGES"] * kernels)
        raise ValueError(f"{name}={env!r}: expected {example}, four integers for each of {kernels} kernel(s)")
    return tiles


def _config(head_dim_p2: int) -> tuple[int, int, int, int]:
    tiles = _tiles_from_env("HYBRIDRL_VARLEN_TILES", 1)
    if tiles is None:
        return CONFIGS.get(head_dim_p2, CONFIGS[64] if head_dim_p2 < 64 else FALLBACK_CONFIG)
    return tiles[0]


def _dynamic(dynamic_loop: bool | None) -> bool:
    """Whether the kernels loop to run-time bounds: by default, unless under Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET") != "1" if dynamic_loop is None else dynamic_loop


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b, in full fp32 precision for fp32 operands (IEEE), else the tensor cores' default."""
    if IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _segment(cu_q_ptr, cu_k_ptr, seg):
    """(q0, k0, Lq, Lk): where segment `seg`'s queries and keys start, and how many of each."""
    q0 = tl.load(cu_q_ptr + seg)
    k0 = tl.load(cu_k_ptr + seg)
    return q0, k0, tl.load(cu_q_ptr + seg + 1) - q0, tl.load(cu_k_ptr + seg + 1) - k0


@triton.jit
def _row_block(cu_q_ptr, cu_k_ptr, NUM_BLOCKS):
    """The forward's and dq's program: (blk, kvh, q0, k0, Lq, Lk), its row block (the longest, last
    blocks of each segment first), KV head and segment bounds, from the grid (blocks, segments, KV heads)."""
    blk = NUM_BLOCKS - 1 - tl.program_id(0)
    q0, k0, Lq, Lk = _segment(cu_q_ptr, cu_k_ptr, tl.program_id(1))
    return blk, tl.program_id(2), q0, k0, Lq, Lk


@triton.jit
def _rows(rs, q0, Lq, kvh, H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, BLOCK_M: tl.constexpr):
    """The (token, query head) rows [rs, rs + BLOCK_M) of KV head `kvh` in a segment: each row's
    token and query head, whether it is a real token, and its offsets and load mask in `[Tq, H, D]`."""
    rows = rs + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    valid = tok < Lq
    head = kvh * GROUP + rows % GROUP
    d = tl.arange(0, D_P)
    q_off = ((q0 + tok).to(tl.int64) * H + head)[:, None] * D + d[None, :]
    return tok, valid, head, q_off, valid[:, None] & (d < D)[None, :]


@triton.jit
def _keys(k0, kvh, start, Lk, HKV: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [start, start + BLOCK_N) of KV head `kvh` in a segment: their indices, and their offsets
    and load mask in `[Tk, Hkv, D]`."""
    kj = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D_P)
    off = ((k0 + kj).to(tl.int64) * HKV + kvh)[:, None] * D + d[None, :]
    return kj, off, (kj < Lk)[:, None] & (d < D)[None, :]


@triton.jit
def _key_range(blk, Lq, Lk, shift, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(full, hi) for row block `blk` (a token sees keys up to its index + shift): every row sees
    keys [0, full) (whole BLOCK_N tiles), no row sees a key past hi."""
    first_tok = blk * BLOCK_M // GROUP
    last_tok = tl.minimum((blk * BLOCK_M + BLOCK_M - 1) // GROUP, Lq - 1)
    hi = tl.minimum(Lk, last_tok + shift + 1)
    return tl.maximum(tl.minimum(first_tok + shift + 1, hi), 0) // BLOCK_N * BLOCK_N, hi


@triton.jit
def _tile(
    q, k_ptr, v_ptr, k0, kvh, start, Lk, limit, m_i, l_i, acc, scale_log2,
    HKV: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One online-softmax update of the block's rows with keys [start, start + BLOCK_N)."""
    kj, off, ld_mask = _keys(k0, kvh, start, Lk, HKV, D, D_P, BLOCK_N)
    if MASKED or D != D_P:
        k = tl.load(k_ptr + off, mask=ld_mask, other=0.0)
    else:
        k = tl.load(k_ptr + off)
    s = _dot(q, tl.trans(k), IEEE) * scale_log2  # [BLOCK_M, BLOCK_N], log2 units
    if MASKED:
        s = tl.where(kj[None, :] <= limit[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet keeps its state
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASKED or D != D_P:
        v = tl.load(v_ptr + off, mask=ld_mask, other=0.0)
    else:
        v = tl.load(v_ptr + off)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=VARYING_INTS)
def _varlen_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, Tq, scale_log2, NUM_BLOCKS,
    H: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPAN: tl.constexpr, DYNAMIC_LOOP: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    blk, kvh, q0, k0, Lq, Lk = _row_block(cu_q_ptr, cu_k_ptr, NUM_BLOCKS)
    if blk * BLOCK_M >= Lq * GROUP:
        return
    tok, valid, head, q_off, io_mask = _rows(blk * BLOCK_M, q0, Lq, kvh, H, GROUP, D, D_P, BLOCK_M)
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)
    shift = Lk - Lq
    limit = tl.where(valid, tok + shift, Lk - 1)  # the last key each row sees (padding rows: any)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P], tl.float32)
    full, hi = _key_range(blk, Lq, Lk, shift, GROUP, BLOCK_M, BLOCK_N)
    if DYNAMIC_LOOP:
        for start in range(0, full, BLOCK_N):
            m_i, l_i, acc = _tile(
                q, k_ptr, v_ptr, k0, kvh, start, Lk, limit, m_i, l_i, acc, scale_log2,
                HKV, D, D_P, BLOCK_N, False, IEEE,
            )  # fmt: skip
        for start in range(full, hi, BLOCK_N):
            m_i, l_i, acc = _tile(
                q, k_ptr, v_ptr, k0, kvh, start, Lk, limit, m_i, l_i, acc, scale_log2,
                HKV, D, D_P, BLOCK_N, True, IEEE,
            )  # fmt: skip
    else:  # Triton's CPU interpreter: a fixed loop over SPAN keys, every tile masked
        for start in tl.static_range(0, SPAN, BLOCK_N):
            m_i, l_i, acc = _tile(
                q, k_ptr, v_ptr, k0, kvh, start, Lk, tl.minimum(limit, hi - 1), m_i, l_i, acc, scale_log2,
                HKV, D, D_P, BLOCK_N, True, IEEE,
            )  # fmt: skip
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    tl.store(lse_ptr + head.to(tl.int64) * Tq + q0 + tok, lse, mask=valid)


def varlen_forward(
    q: torch.Tensor,  # [Tq, H, D]
    k: torch.Tensor,  # [Tk, Hkv, D]
    v: torch.Tensor,
    cu_q: torch.Tensor,  # [S + 1] int32: segment starts in q
    cu_k: torch.Tensor,  # [S + 1] int32: segment starts in k / v
    max_q: int,
    max_k: int,
    scale: float,
    config: tuple[int, int, int, int] | None = None,  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    dynamic_loop: bool | None = None,  # loops to run-time bounds (None: unless under Triton's interpreter)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out `[Tq, H, D]` in q's dtype, log-sum-exp `[H, Tq]` fp32) of causal (bottom-right)
    attention within each segment; see the module docstring."""
    Tq, H, D = q.shape
    Hkv = k.shape[1]
    if H % Hkv:
        raise ValueError(f"{H} query heads are not a multiple of {Hkv} KV heads")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    block_m, block_n, num_warps, num_stages = config or _config(triton.next_power_of_2(D))
    group = H // Hkv
    out = torch.empty_like(q)
    lse = torch.empty(H, Tq, dtype=torch.float32, device=q.device)
    num_segments = cu_q.numel() - 1
    if Tq == 0 or num_segments == 0:
        return out, lse
    num_blocks = triton.cdiv(max_q * group, block_m)
    dynamic = _dynamic(dynamic_loop)
    _varlen_fwd_kernel[(num_blocks, num_segments, Hkv)](
        q, k, v, out, lse, cu_q, cu_k, Tq, scale * LOG2E, num_blocks,
        H=H, HKV=Hkv, GROUP=group, D=D, D_P=triton.next_power_of_2(D), BLOCK_M=block_m, BLOCK_N=block_n,
        SPAN=0 if dynamic else triton.cdiv(max_k, block_n) * block_n, DYNAMIC_LOOP=dynamic,
        IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out, lse


# The backward: (dq kernel, dK/dV kernel) tiles, (BLOCK_M, BLOCK_N, num_warps, num_stages) each. In the
# dK/dV kernel a program holds BLOCK_N keys and walks BLOCK_M (token, query head) rows at a time, so
# the gradients of the GROUP query heads that share a key add up in its accumulators (no per-head
# dK / dV to fold afterwards). On an H200 no tile set tried made it faster than FlashAttention-2's
# backward (train/NOTES.md, session 21); HYBRIDRL_VARLEN_BWD_TILES=M:N:W:S,M:N:W:S (dq, then dK/dV)
# overrides them.
BWD_CONFIGS = ((128, 64, 4, 2), (64, 64, 4, 2))


def _bwd_configs() -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    return _tiles_from_env("HYBRIDRL_VARLEN_BWD_TILES", 2) or BWD_CONFIGS  # (dq, then dK/dV)


@triton.jit(do_not_specialize=("Tq", "N_ROWS"))
def _delta_kernel(out_ptr, do_ptr, delta_ptr, Tq, N_ROWS, H: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, BLOCK: tl.constexpr):
    """delta[h, t] = sum_d out[t, h, d] * dout[t, h, d] in fp32: the softmax backward's row term."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # flat t * H + h
    d = tl.arange(0, D_P)
    r_mask = rows < N_ROWS
    mask = r_mask[:, None] & (d < D)[None, :]
    off = rows.to(tl.int64)[:, None] * D + d[None, :]
    o = tl.load(out_ptr + off, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + (rows % H).to(tl.int64) * Tq + rows // H, tl.sum(o * do, axis=1), mask=r_mask)


@triton.jit
def _row_terms(lse_ptr, delta_ptr, head, q0, tok, valid, Tq):
    """A block's rows' log-sum-exp in log2 units (+inf for a row that saw no key, so its p is 0)
    and delta, 0 for padding rows."""
    idx = head.to(tl.int64) * Tq + q0 + tok
    lse = tl.load(lse_ptr + idx, mask=valid, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    return lse2, tl.load(delta_ptr + idx, mask=valid, other=0.0)


@triton.jit
def _dq_tile(
    q, do, lse2, delta, k_ptr, v_ptr, k0, kvh, start, Lk, limit, dq, scale_log2,
    HKV: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """dq of the block's rows from keys [start, start + BLOCK_N): dq += (p * (dp - delta)) @ K."""
    kj, off, ld_mask = _keys(k0, kvh, start, Lk, HKV, D, D_P, BLOCK_N)
    k = tl.load(k_ptr + off, mask=ld_mask, other=0.0)
    v = tl.load(v_ptr + off, mask=ld_mask, other=0.0)
    s = _dot(q, tl.trans(k), IEEE) * scale_log2
    dp = _dot(do, tl.trans(v), IEEE)
    p = tl.exp2(s - lse2[:, None])
    if MASKED:
        p = tl.where(kj[None, :] <= limit[:, None], p, 0.0)
    ds = p * (dp - delta[:, None])
    dq += _dot(ds.to(k.dtype), k, IEEE)
    return dq


@triton.jit(do_not_specialize=VARYING_INTS)
def _varlen_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_q_ptr, cu_k_ptr, Tq, scale_log2, scale, NUM_BLOCKS,
    H: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPAN: tl.constexpr, DYNAMIC_LOOP: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """dq for one block of (token, query head) rows: the forward's walk over the keys."""
    blk, kvh, q0, k0, Lq, Lk = _row_block(cu_q_ptr, cu_k_ptr, NUM_BLOCKS)
    if blk * BLOCK_M >= Lq * GROUP:
        return
    tok, valid, head, q_off, io_mask = _rows(blk * BLOCK_M, q0, Lq, kvh, H, GROUP, D, D_P, BLOCK_M)
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)
    do = tl.load(do_ptr + q_off, mask=io_mask, other=0.0)
    lse2, delta = _row_terms(lse_ptr, delta_ptr, head, q0, tok, valid, Tq)
    shift = Lk - Lq
    limit = tl.where(valid, tok + shift, -1)  # padding rows: no key
    dq = tl.zeros([BLOCK_M, D_P], tl.float32)
    full, hi = _key_range(blk, Lq, Lk, shift, GROUP, BLOCK_M, BLOCK_N)
    if DYNAMIC_LOOP:
        for start in range(0, full, BLOCK_N):
            dq = _dq_tile(q, do, lse2, delta, k_ptr, v_ptr, k0, kvh, start, Lk, limit, dq, scale_log2, HKV, D, D_P, BLOCK_N, False, IEEE)
        for start in range(full, hi, BLOCK_N):
            dq = _dq_tile(q, do, lse2, delta, k_ptr, v_ptr, k0, kvh, start, Lk, limit, dq, scale_log2, HKV, D, D_P, BLOCK_N, True, IEEE)
    else:
        for start in tl.static_range(0, SPAN, BLOCK_N):
            dq = _dq_tile(q, do, lse2, delta, k_ptr, v_ptr, k0, kvh, start, Lk, limit, dq, scale_log2, HKV, D, D_P, BLOCK_N, True, IEEE)
    tl.store(dq_ptr + q_off, (dq * scale).to(dq_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _dkdv_tile(
    k, v, dk, dv, kj, q_ptr, do_ptr, lse_ptr, delta_ptr, q0, kvh, rs, Lq, Tq, shift, scale_log2,
    H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """The block's keys' dK / dV from rows [rs, rs + BLOCK_M): dV += p^T dout, dK += (p * (dp - delta))^T q."""
    tok, valid, head, q_off, io_mask = _rows(rs, q0, Lq, kvh, H, GROUP, D, D_P, BLOCK_M)
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)
    do = tl.load(do_ptr + q_off, mask=io_mask, other=0.0)
    lse2, delta = _row_terms(lse_ptr, delta_ptr, head, q0, tok, valid, Tq)
    s_t = _dot(k, tl.trans(q), IEEE) * scale_log2  # [BLOCK_N, BLOCK_M]
    dp_t = _dot(v, tl.trans(do), IEEE)
    p_t = tl.exp2(s_t - lse2[None, :])
    if MASKED:  # a padding row (q = dout = 0, lse = delta = 0) adds nothing unmasked either
        p_t = tl.where((kj[:, None] <= (tok + shift)[None, :]) & valid[None, :], p_t, 0.0)
    ds_t = p_t * (dp_t - delta[None, :])
    dv += _dot(p_t.to(do.dtype), do, IEEE)
    dk += _dot(ds_t.to(q.dtype), q, IEEE)
    return dk, dv


@triton.jit(do_not_specialize=VARYING_INTS)
def _varlen_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr, Tq, scale_log2, scale,
    NUM_BLOCKS, H: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPAN_Q: tl.constexpr, DYNAMIC_LOOP: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """dK and dV for BLOCK_N keys of one segment and KV head, over every row that sees them."""
    blk = tl.program_id(0)
    seg = tl.program_id(1)
    kvh = tl.program_id(2)
    q0, k0, Lq, Lk = _segment(cu_q_ptr, cu_k_ptr, seg)
    if blk * BLOCK_N >= Lk:
        return
    kj, off, kv_mask = _keys(k0, kvh, blk * BLOCK_N, Lk, HKV, D, D_P, BLOCK_N)
    k = tl.load(k_ptr + off, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + off, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, D_P], tl.float32)
    dv = tl.zeros([BLOCK_N, D_P], tl.float32)
    shift = Lk - Lq
    j_last = tl.minimum(blk * BLOCK_N + BLOCK_N, Lk) - 1
    t_first = tl.maximum(blk * BLOCK_N - shift, 0)  # the first token that sees a key of the block
    t_full = tl.maximum(tl.minimum(j_last - shift, Lq), t_first)  # from here every key is seen
    r0 = t_first * GROUP
    r_end = Lq * GROUP
    if DYNAMIC_LOOP:
        r_mid = r0 + (t_full * GROUP - r0 + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        for rs in range(r0, r_mid, BLOCK_M):
            dk, dv = _dkdv_tile(
                k, v, dk, dv, kj, q_ptr, do_ptr, lse_ptr, delta_ptr, q0, kvh, rs, Lq, Tq, shift, scale_log2,
                H, GROUP, D, D_P, BLOCK_M, True, IEEE,
            )  # fmt: skip
        for rs in range(r_mid, r_end, BLOCK_M):
            dk, dv = _dkdv_tile(
                k, v, dk, dv, kj, q_ptr, do_ptr, lse_ptr, delta_ptr, q0, kvh, rs, Lq, Tq, shift, scale_log2,
                H, GROUP, D, D_P, BLOCK_M, False, IEEE,
            )  # fmt: skip
    else:  # Triton's CPU interpreter: every row of the segment, every tile masked
        for rs in tl.static_range(0, SPAN_Q, BLOCK_M):
            dk, dv = _dkdv_tile(
                k, v, dk, dv, kj, q_ptr, do_ptr, lse_ptr, delta_ptr, q0, kvh, rs, Lq, Tq, shift, scale_log2,
                H, GROUP, D, D_P, BLOCK_M, True, IEEE,
            )  # fmt: skip
    tl.store(dk_ptr + off, (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + off, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


def varlen_backward(
    dout: torch.Tensor,  # [Tq, H, D]
    q: torch.Tensor,
    k: torch.Tensor,  # [Tk, Hkv, D]
    v: torch.Tensor,
    out: torch.Tensor,  # varlen_forward's (or FlashAttention-2's) output
    lse: torch.Tensor,  # [H, Tq] fp32, natural log
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    configs: tuple[tuple[int, int, int, int], tuple[int, int, int, int]] | None = None,  # (dq, dK/dV) tiles
    dynamic_loop: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `varlen_forward`, from its output and log-sum-exp (as FlashAttention-2's
    backward takes them): a delta pass, then one kernel for dq and one for dK / dV."""
    Tq, H, D = q.shape
    Hkv = k.shape[1]
    dout, q, k, v, out = (t.contiguous() for t in (dout, q, k, v, out))
    (bm_q, bn_q, w_q, s_q), (bm_k, bn_k, w_k, s_k) = configs or _bwd_configs()
    group = H // Hkv
    d_p = triton.next_power_of_2(D)
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)  # keys no segment covers: 0
    num_segments = cu_q.numel() - 1
    if Tq == 0 or num_segments == 0:
        return dq, dk, dv
    delta = torch.empty(H, Tq, dtype=torch.float32, device=q.device)
    _delta_kernel[(triton.cdiv(Tq * H, 64),)](out, dout, delta, Tq, Tq * H, H=H, D=D, D_P=d_p, BLOCK=64)
    dynamic = _dynamic(dynamic_loop)
    ieee = q.dtype == torch.float32
    blocks_q = triton.cdiv(max_q * group, bm_q)
    _varlen_dq_kernel[(blocks_q, num_segments, Hkv)](
        q, k, v, dout, lse, delta, dq, cu_q, cu_k, Tq, scale * LOG2E, scale, blocks_q,
        H=H, HKV=Hkv, GROUP=group, D=D, D_P=d_p, BLOCK_M=bm_q, BLOCK_N=bn_q,
        SPAN=0 if dynamic else triton.cdiv(max_k, bn_q) * bn_q, DYNAMIC_LOOP=dynamic, IEEE=ieee,
        num_warps=w_q, num_stages=s_q,
    )  # fmt: skip
    blocks_k = triton.cdiv(max_k, bn_k)
    _varlen_dkdv_kernel[(blocks_k, num_segments, Hkv)](
        q, k, v, dout, lse, delta, dk, dv, cu_q, cu_k, Tq, scale * LOG2E, scale, blocks_k,
        H=H, HKV=Hkv, GROUP=group, D=D, D_P=d_p, BLOCK_M=bm_k, BLOCK_N=bn_k,
        SPAN_Q=0 if dynamic else triton.cdiv(max_q * group, bm_k) * bm_k, DYNAMIC_LOOP=dynamic, IEEE=ieee,
        num_warps=w_k, num_stages=s_k,
    )  # fmt: skip
    return dq, dk, dv
