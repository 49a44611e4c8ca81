"""Attention over packed variable-length segments through cuDNN's fused SDPA kernels.

`varlen_forward` / `varlen_backward` serve `attention.varlen_attention`'s contract for
`train.packed_attention=cudnn` (cuDNN's forward, FlashAttention-2's backward) and `cudnn_full` (cuDNN's
forward and backward): q `[Tq, H, D]`, k / v `[Tk, Hkv, D]` (grouped-query attention when Hkv < H),
segments given by `cu_q` / `cu_k`, causal from the bottom right of each segment. They run cuDNN's own
SDPA kernels (on Hopper its sm90 kernels, with wgmma and TMA, where PyTorch's FlashAttention-2 uses
Ampere's mma.sync) through the cudnn-frontend Python graph API (`pip install nvidia-cudnn-frontend`),
against the cuDNN library PyTorch already loaded.

What differs from the other kernels:
- the log-sum-exp: FlashAttention-2's backward reads it as `[H, Tq]`, which the forward makes from
  cuDNN's token-major statistics with one transposing copy (`lse_layout="flash"`); cuDNN's backward
  reads it padded, `[B, H, S_q, 1]` fp32 (B segments, S_q their longest query length, rounded up),
  which the forward then writes directly (`lse_layout="padded"`).
- graphs: a cuDNN graph is built for each (segments, longest query, longest key, heads, head dim)
  shape, once, and cached (`_graph`; the `MAX_GRAPHS` most recently used are kept). So that varying micro-batches reuse them, the segment count is
  rounded up to a multiple of `SEGMENT_ROUND` with empty segments and the longest lengths to a
  multiple of `LENGTH_ROUND`; cuDNN reads each segment's real length from device tensors.
- the per-segment tensors cuDNN reads (lengths, element offsets) are made once per packed row
  (`_metadata`, kept while the row's `cu_q` / `cu_k` tensors are the ones passed), not once a layer.
"""

from __future__ import annotations

import importlib.util
import threading
from collections import OrderedDict

import torch

SEGMENT_ROUND = 8  # segments (batch entries) are padded up to a multiple of this with empty ones
LENGTH_ROUND = 64  # the longest query / key lengths a graph is built for are rounded up to this
TOTAL_ROUND = 4096  # the backward's workspace is sized for a row of up to this many more tokens
MIN_BACKEND = 90600  # cuDNN 9.6: packed (ragged) layouts with bottom-right causal masks and sized backward workspaces

_UID = dict(q=1, k=2, v=3, o=4, stats=5, do=6, dq=7, dk=8, dv=9, seq_q=10, seq_k=11, rag_q=12, rag_k=13, rag_stats=14)
_lock = threading.Lock()
_tls = threading.local()  # cuDNN handles are per thread
# Built graphs by shape, least recently used first; at most MAX_GRAPHS are kept (each holds cuDNN's
# execution plans), so a run whose shapes keep changing rebuilds some instead of growing without bound.
_graphs: OrderedDict[tuple, tuple] = OrderedDict()
MAX_GRAPHS = 128


def _round(n: int, step: int) -> int:
    return -(-max(n, 1) // step) * step


def padded_segments(cu_q: torch.Tensor) -> int:
    """The batch size cuDNN's graphs see for a row of `cu_q.numel() - 1` segments."""
    return _round(cu_q.shape[0] - 1, SEGMENT_ROUND)


def padded_length(n: int) -> int:
    return _round(n, LENGTH_ROUND)


def _module():
    """The cudnn-frontend module, bound to the cuDNN library PyTorch loaded (asking torch for its
    version loads it first, so the frontend's lookup by name finds the same library)."""
    torch.backends.cudnn.version()
    import cudnn

    return cudnn


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `cudnn` can run here: the frontend package, an sm80+ GPU, bf16 / fp16, a head dim that is
    a multiple of 8 up to 128 (cuDNN's fused kernels for training), cuDNN >= 9.6."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or head_dim % 8 or head_dim > 128:
        return False
    if importlib.util.find_spec("cudnn") is None or not torch.backends.cudnn.is_available():
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False
    try:
        return _module().backend_version() >= MIN_BACKEND
    except Exception:  # a frontend that cannot bind the library here
        return False


def _handle(cudnn, device: torch.device):
    handles = getattr(_tls, "handles", None)
    if handles is None:
        handles = _tls.handles = {}
    if device not in handles:
        with torch.cuda.device(device):
            handles[device] = cudnn.create_handle()
    handle = handles[device]
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
    return handle


class _Metadata:
    """What cuDNN reads about a packed row's segments: lengths `[B, 1, 1, 1]` int32 and element
    offsets `[B + 1, 1, 1, 1]` int64 of q / o (and their gradients), of k / v and of the token-major
    statistics, padded to B segments with empty ones."""

    def __init__(self, cu_q: torch.Tensor, cu_k: torch.Tensor, q_row: int, k_row: int, heads: int):
        self.key = (cu_q, cu_k, cu_q._version, cu_k._version, q_row, k_row, heads)
        n = cu_q.shape[0] - 1
        batch = padded_segments(cu_q)

        def padded(cu: torch.Tensor) -> torch.Tensor:  # empty segments at the end: the last offset repeated
            cu = cu.to(torch.int64)
            return torch.cat([cu, cu[-1:].expand(batch - n)]) if batch > n else cu

        pq, pk = padded(cu_q), padded(cu_k)
        self.seq_q = (pq[1:] - pq[:-1]).to(torch.int32).view(batch, 1, 1, 1)
        self.seq_k = (pk[1:] - pk[:-1]).to(torch.int32).view(batch, 1, 1, 1)
        self.rag_q = (pq * q_row).view(batch + 1, 1, 1, 1)
        self.rag_k = (pk * k_row).view(batch + 1, 1, 1, 1)
        self.rag_stats = (pq * heads).view(batch + 1, 1, 1, 1)


def _metadata(cu_q: torch.Tensor, cu_k: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> _Metadata:
    """The row's metadata, made again only when other `cu_q` / `cu_k` tensors (or changed ones) come:
    every layer of a forward and of its backward passes the same two."""
    H, D, Hkv = q.shape[1], q.shape[2], k.shape[1]
    last = getattr(_tls, "metadata", None)
    if last is not None:
        a, b, va, vb, qr, kr, h = last.key
        if a is cu_q and b is cu_k and va == cu_q._version and vb == cu_k._version and (qr, kr, h) == (H * D, Hkv * D, H):
            return last
    _tls.metadata = meta = _Metadata(cu_q, cu_k, H * D, Hkv * D, H)
    return meta


def _tensor(graph, name, dim, stride, dtype, ragged=None):
    t = graph.tensor(name=name, dim=dim, stride=stride, data_type=dtype, uid=_UID[name])
    if ragged is not None:
        t.set_ragged_offset(ragged)
    return t


def _build(cudnn, handle, backward: bool, dtype: torch.dtype, B: int, H: int, Hkv: int, D: int, S_q: int, S_k: int,
           scale: float, total_q: int, total_k: int, deterministic: bool, token_major_stats: bool):  # fmt: skip
    io = cudnn.data_type.BFLOAT16 if dtype == torch.bfloat16 else cudnn.data_type.HALF
    g = cudnn.pygraph(handle=handle, io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT)  # fmt: skip
    i32, i64, f32 = cudnn.data_type.INT32, cudnn.data_type.INT64, cudnn.data_type.FLOAT
    meta = [1, 1, 1, 1]
    seq_q = _tensor(g, "seq_q", [B, 1, 1, 1], meta, i32)
    seq_k = _tensor(g, "seq_k", [B, 1, 1, 1], meta, i32)
    rag_q = _tensor(g, "rag_q", [B + 1, 1, 1, 1], meta, i64)
    rag_k = _tensor(g, "rag_k", [B + 1, 1, 1, 1], meta, i64)
    # Token-major packed layouts: [T, heads, D] seen as [B, heads, S, D]; each segment starts at its ragged offset.
    q_stride, k_stride = [S_q * H * D, D, H * D, 1], [S_k * Hkv * D, D, Hkv * D, 1]
    q = _tensor(g, "q", [B, H, S_q, D], q_stride, io, rag_q)
    k = _tensor(g, "k", [B, Hkv, S_k, D], k_stride, io, rag_k)
    v = _tensor(g, "v", [B, Hkv, S_k, D], k_stride, io, rag_k)
    stats_dim = [B, H, S_q, 1]
    stats_stride = [S_q * H, 1, H, 1] if token_major_stats else [H * S_q, S_q, 1, 1]
    causal = dict(diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, diagonal_band_right_bound=0)
    uids = ["q", "k", "v", "o", "stats", "seq_q", "seq_k", "rag_q", "rag_k"]
    if not backward:
        o, stats = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, attn_scale=scale, use_padding_mask=True,
                          seq_len_q=seq_q, seq_len_kv=seq_k, **causal)  # fmt: skip
        o.set_output(True).set_dim([B, H, S_q, D]).set_stride(q_stride).set_data_type(io).set_uid(_UID["o"])
        o.set_ragged_offset(rag_q)
        stats.set_output(True).set_dim(stats_dim).set_stride(stats_stride).set_data_type(f32).set_uid(_UID["stats"])
        if token_major_stats:  # [Tq, H] packed like q's rows
            stats.set_ragged_offset(_tensor(g, "rag_stats", [B + 1, 1, 1, 1], meta, i64))
            uids.append("rag_stats")
    else:
        o = _tensor(g, "o", [B, H, S_q, D], q_stride, io, rag_q)
        do = _tensor(g, "do", [B, H, S_q, D], q_stride, io, rag_q)
        stats = _tensor(g, "stats", stats_dim, stats_stride, f32)
        dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=q, k=k, v=v, o=o, dO=do, stats=stats, attn_scale=scale,
                                     use_padding_mask=True, seq_len_q=seq_q, seq_len_kv=seq_k,
                                     max_total_seq_len_q=total_q, max_total_seq_len_kv=total_k,
                                     use_deterministic_algorithm=deterministic, **causal)  # fmt: skip
        for t, name, dim, stride, rag in ((dq, "dq", [B, H, S_q, D], q_stride, rag_q), (dk, "dk", [B, Hkv, S_k, D], k_stride, rag_k),
                                          (dv, "dv", [B, Hkv, S_k, D], k_stride, rag_k)):  # fmt: skip
            t.set_output(True).set_dim(dim).set_stride(stride).set_data_type(io).set_uid(_UID[name])
            t.set_ragged_offset(rag)
        uids += ["do", "dq", "dk", "dv"]
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, g.get_workspace_size(), [_UID[name] for name in uids]


def _graph(backward: bool, q: torch.Tensor, k: torch.Tensor, B: int, S_q: int, S_k: int, scale: float, total_q: int = 0,
           total_k: int = 0, deterministic: bool = False, token_major_stats: bool = False):  # fmt: skip
    cudnn = _module()
    handle = _handle(cudnn, q.device)
    H, D, Hkv = q.shape[1], q.shape[2], k.shape[1]
    key = (backward, q.dtype, q.device, B, H, Hkv, D, S_q, S_k, scale, total_q, total_k, deterministic, token_major_stats)
    with _lock:
        entry = _graphs.get(key)
        if entry is not None:
            _graphs.move_to_end(key)
            return handle, entry
        entry = _graphs[key] = _build(cudnn, handle, backward, q.dtype, B, H, Hkv, D, S_q, S_k, scale, total_q, total_k,
                                      deterministic, token_major_stats)  # fmt: skip
        while len(_graphs) > MAX_GRAPHS:
            _graphs.popitem(last=False)
    return handle, entry


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """cuDNN reads 16-byte-aligned, densely packed rows."""
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


def varlen_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, lse_layout: str = "flash") -> tuple[torch.Tensor, torch.Tensor]:
    """(out `[Tq, H, D]`, natural-log log-sum-exp fp32), causal from the bottom right of each segment.
    The log-sum-exp is `[H, Tq]` for FlashAttention-2's backward (`lse_layout="flash"`), or `[B, H, S_q, 1]`
    for `varlen_backward` (`"padded"`; B = `padded_segments(cu_q)`, S_q = `padded_length(max_q)`)."""
    q, k, v = _contiguous(q), _contiguous(k), _contiguous(v)
    token_major = lse_layout == "flash"
    meta = _metadata(cu_q, cu_k, q, k)
    H, B, S_q, S_k = q.shape[1], meta.seq_q.shape[0], padded_length(max_q), padded_length(max_k)
    handle, (graph, workspace_size, uids) = _graph(False, q, k, B, S_q, S_k, scale, token_major_stats=token_major)
    out = torch.empty_like(q)
    shape = (q.shape[0], H) if token_major else (B, H, S_q, 1)
    stats = torch.empty(shape, dtype=torch.float32, device=q.device)
    workspace = torch.empty(max(workspace_size, 1), dtype=torch.uint8, device=q.device)
    tensors = (q, k, v, out, stats, meta.seq_q, meta.seq_k, meta.rag_q, meta.rag_k) + ((meta.rag_stats,) if token_major else ())
    graph.execute({uid: t.data_ptr() for uid, t in zip(uids, tensors)}, workspace.data_ptr(), handle=handle)
    return out, (stats.t().contiguous() if token_major else stats)


def varlen_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, scale: float):
    """(dq, dk, dv) of `varlen_forward`, from its output and its padded log-sum-exp (`lse_layout="padded"`)."""
    q, k, v, out, grad_out = (_contiguous(t) for t in (q, k, v, out, grad_out))
    meta = _metadata(cu_q, cu_k, q, k)
    B, S_q, S_k = meta.seq_q.shape[0], padded_length(max_q), padded_length(max_k)
    total_q, total_k = _round(q.shape[0], TOTAL_ROUND), _round(k.shape[0], TOTAL_ROUND)
    deterministic = torch.are_deterministic_algorithms_enabled()
    handle, (graph, workspace_size, uids) = _graph(True, q, k, B, S_q, S_k, scale, total_q, total_k, deterministic)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    workspace = torch.empty(max(workspace_size, 1), dtype=torch.uint8, device=q.device)
    tensors = (q, k, v, out, lse, meta.seq_q, meta.seq_k, meta.rag_q, meta.rag_k, grad_out, dq, dk, dv)
    graph.execute({uid: t.data_ptr() for uid, t in zip(uids, tensors)}, workspace.data_ptr(), handle=handle)
    return dq, dk, dv
