"""train.packed_attention=cudnn's host side on CPU: the per-segment tensors cuDNN reads and the graph cache.
The kernels themselves run on a GPU only (tests/test_train_gpu.py -k cudnn)."""

from __future__ import annotations

import torch

from hybridrl.train import cudnn_varlen


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def test_metadata_pads_with_empty_segments_and_offsets_whole_rows():
    cu_q, cu_k = _cu([3, 5, 1]), _cu([3, 9, 4])
    heads, kv_heads, dim = 4, 2, 8
    q, k = torch.zeros(9, heads, dim), torch.zeros(16, kv_heads, dim)
    meta = cudnn_varlen._metadata(cu_q, cu_k, q, k)
    batch = cudnn_varlen.padded_segments(cu_q)
    assert batch == 8  # 3 segments, rounded up to SEGMENT_ROUND
    assert meta.seq_q.shape == meta.seq_k.shape == (batch, 1, 1, 1) and meta.seq_q.dtype == torch.int32
    assert meta.seq_q.flatten().tolist() == [3, 5, 1, 0, 0, 0, 0, 0]
    assert meta.seq_k.flatten().tolist() == [3, 9, 4, 0, 0, 0, 0, 0]
    # element offsets: each segment's first token times the elements of a token's row; empty segments start at the end
    assert meta.rag_q.flatten().tolist() == [t * heads * dim for t in [0, 3, 8, 9, 9, 9, 9, 9, 9]]
    assert meta.rag_k.flatten().tolist() == [t * kv_heads * dim for t in [0, 3, 12, 16, 16, 16, 16, 16, 16]]
    assert meta.rag_stats.flatten().tolist() == [t * heads for t in [0, 3, 8, 9, 9, 9, 9, 9, 9]]
    assert meta.rag_q.dtype == meta.rag_k.dtype == torch.int64


def test_metadata_is_made_once_per_row_and_again_for_a_new_or_changed_row():
    cu_q, cu_k = _cu([2, 2]), _cu([2, 4])
    q, k = torch.zeros(4, 2, 8), torch.zeros(6, 1, 8)
    first = cudnn_varlen._metadata(cu_q, cu_k, q, k)
    assert cudnn_varlen._metadata(cu_q, cu_k, q, k) is first  # every layer of the pass passes the same tensors
    other = cudnn_varlen._metadata(cu_q.clone(), cu_k, q, k)  # equal values, another tensor: made again
    assert other is not first
    again = cudnn_varlen._metadata(cu_q, cu_k, q, k)
    assert cudnn_varlen._metadata(cu_q, cu_k, q, k) is again
    cu_q[1] = 1  # changed in place: its version moves, so the lengths are read again
    changed = cudnn_varlen._metadata(cu_q, cu_k, q, k)
    assert changed is not again and changed.seq_q.flatten()[:2].tolist() == [1, 3]
    wider = cudnn_varlen._metadata(cu_q, cu_k, torch.zeros(4, 4, 8), k)  # other heads: other offsets
    assert wider.rag_q.flatten()[1].item() == 1 * 4 * 8


def test_lengths_round_up_to_the_graph_buckets():
    assert [cudnn_varlen.padded_length(n) for n in (1, 64, 65, 512, 768, 769)] == [64, 64, 128, 512, 768, 832]
    assert cudnn_varlen.padded_segments(_cu([1] * 8)) == 8 and cudnn_varlen.padded_segments(_cu([1] * 9)) == 16


def test_graph_cache_builds_each_shape_once_and_keeps_the_most_recently_used(monkeypatch):
    builds = []

    def fake_build(cudnn, handle, backward, dtype, B, H, Hkv, D, S_q, S_k, *rest):
        builds.append((B, S_q, S_k))
        return (object(), 0, [])

    monkeypatch.setattr(cudnn_varlen, "_module", lambda: None)
    monkeypatch.setattr(cudnn_varlen, "_handle", lambda cudnn, device: "handle")
    monkeypatch.setattr(cudnn_varlen, "_build", fake_build)
    monkeypatch.setattr(cudnn_varlen, "_graphs", type(cudnn_varlen._graphs)())
    monkeypatch.setattr(cudnn_varlen, "MAX_GRAPHS", 2)
    q, k = torch.zeros(4, 2, 8), torch.zeros(4, 1, 8)

    def graph(S_q):
        return cudnn_varlen._graph(False, q, k, 8, S_q, 64, 0.125)[1]

    a = graph(64)
    assert graph(64) is a and builds == [(8, 64, 64)]  # built once
    b = graph(128)
    assert graph(64) is a  # a is now the most recently used
    graph(192)  # a third shape: b, the least recently used, goes
    assert len(builds) == 3 and len(cudnn_varlen._graphs) == 2
    assert graph(64) is a and len(builds) == 3
    assert graph(128) is not b and len(builds) == 4  # b was evicted: built again
    # the backward and the statistics layout are other graphs of the same shape
    cudnn_varlen._graph(True, q, k, 8, 64, 64, 0.125, 4096, 4096)
    cudnn_varlen._graph(False, q, k, 8, 64, 64, 0.125, token_major_stats=True)
    assert len(builds) == 6
