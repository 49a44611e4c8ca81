"""The native backend on a CUDA GPU: Triton + CUDA-graph path against full forwards; memory."""

from __future__ import annotations

import gc

import pytest
import torch
import transformers

from hybridrl.rollout.native import NativeBackend
from hybridrl.rollout.types import GenerationRequest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _model(dtype, arch="qwen2", weight_scale=3.0):
    common = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    if arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=64))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(weight_scale)  # peaked logits: greedy has no near-ties
    return model.to("cuda", dtype).eval()


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (5, 40, 16, 100, 77, 1)]


@torch.no_grad()
def _logprob_diffs(model, prompts, outs, temperature):
    diffs = []
    for o in outs:
        ids = torch.tensor([prompts[o.prompt_index] + o.response_ids], device="cuda")
        logits = model(ids).logits[0, len(prompts[o.prompt_index]) - 1 : -1].float()
        lp = torch.log_softmax(logits / (temperature or 1.0), -1).gather(-1, ids[0, len(prompts[o.prompt_index]):, None])[:, 0]
        diffs.append((lp.cpu() - torch.tensor(o.response_logprobs)).abs())
    return torch.cat(diffs)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_fp32_greedy_matches_full_forward(arch, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = _model(torch.float32, arch)
    prompts = _prompts()
    outs = NativeBackend(model).generate(GenerationRequest(prompts, n=2, max_tokens=[24] * 6, temperature=0.0))
    for o in outs:
        ids = list(prompts[o.prompt_index])
        for tok in o.response_ids:
            assert tok == int(model(torch.tensor([ids], device="cuda")).logits[0, -1].argmax())
            ids.append(tok)
    assert _logprob_diffs(model, prompts, outs, 0.0).max() < 1e-3


def test_checks_one_step_ahead_on_the_gpu_change_no_sample(monkeypatch):
    """rollout.step_ahead on CUDA (pinned copies of the flags behind an event, one decode step queued
    before the host reads them): with stop tokens ending rows between and at checks, few slots (prompts
    admitted as rows finish) and CUDA graphs, the same tokens and finish reasons as with the checks in
    step, and greedy tokens equal to a full forward's."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = _model(torch.float32)
    prompts = _prompts()
    first = NativeBackend(model).generate(GenerationRequest(prompts, n=1, max_tokens=[40] * 6, temperature=0.0))
    stops = sorted({o.response_ids[k] for o in first for k in (3, 11, 20) if len(o.response_ids) > k})[:6]
    calls = []
    real = NativeBackend._flags_then_step
    monkeypatch.setattr(NativeBackend, "_flags_then_step", lambda self, *a: calls.append(a) or real(self, *a))
    req = GenerationRequest(prompts, n=2, max_tokens=[40, 33, 40, 27, 40, 38], temperature=0.0, stop_token_ids=stops)
    ahead = NativeBackend(model, max_num_seqs=8, sync_every=4).generate(req)
    assert calls, "the checks did not run ahead"
    in_step = NativeBackend(model, max_num_seqs=8, sync_every=4, step_ahead=False).generate(req)
    assert any(o.finish_reason == "stop" for o in ahead)
    assert [(o.response_ids, o.finish_reason) for o in ahead] == [(o.response_ids, o.finish_reason) for o in in_step]
    for o in ahead:
        ids = list(prompts[o.prompt_index])
        for tok in o.response_ids:
            assert tok == int(model(torch.tensor([ids], device="cuda")).logits[0, -1].argmax())
            ids.append(tok)
        assert (o.response_ids[-1] in stops) == (o.finish_reason == "stop")
    assert _logprob_diffs(model, prompts, ahead, 0.0).max() < 1e-3


def test_bf16_sampled_logprobs_and_graphs_equal_eager():
    model = _model(torch.bfloat16, weight_scale=1.0)  # the default init, like the W0.5B benchmark
    prompts = _prompts()
    req = GenerationRequest(prompts, n=4, max_tokens=[64, 30, 64, 50, 64, 64], temperature=1.0, seed=3)
    graphed = NativeBackend(model).generate(req)
    eager = NativeBackend(model, cuda_graphs=False).generate(req)
    assert [o.response_ids for o in graphed] == [o.response_ids for o in eager]
    diffs = _logprob_diffs(model, prompts, graphed, 1.0)
    assert diffs.mean() < 1e-2, diffs.mean()
    # top-p / top-k go through the PyTorch sampler inside the graph
    filtered = NativeBackend(model).generate(
        GenerationRequest(prompts, n=2, max_tokens=[16] * 6, temperature=0.8, top_p=0.9, top_k=50, seed=1)
    )
    assert _logprob_diffs(model, prompts, filtered, 0.8).mean() < 1e-2


def test_shared_prefix_attention_samples_the_same_in_bf16_graphs():
    """Cascade attention (rollout.shared_prefix_attention) inside CUDA graphs: the same samples as
    per-row attention, up to bf16 rounding of the attention output, over prompts with shared blocks."""
    model = _model(torch.bfloat16, weight_scale=1.0)
    prompts = _prompts()
    req = GenerationRequest(prompts, n=8, max_tokens=[48] * len(prompts), temperature=1.0, seed=3)
    plain = NativeBackend(model).generate(req)
    backend = NativeBackend(model, shared_prefix_attention=True)
    cascade = backend.generate(req)
    assert backend.decoder.prefix is not None
    same = sum(a.response_ids == b.response_ids for a, b in zip(cascade, plain)) / len(plain)
    assert same > 0.8, same  # a bf16 rounding flip changes a sample from there on
    assert _logprob_diffs(model, prompts, cascade, 1.0).mean() < 1e-2


def test_sleep_releases_memory():
    model = _model(torch.bfloat16)
    # The baseline without what earlier tests left: engines a collection inside this test would free,
    # and cuBLAS workspaces of their streams, which sleep() clears with ours.
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    backend = NativeBackend(model, kv_cache_fraction=0.05, keep_graphs=False)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    backend.wake()
    assert torch.cuda.memory_allocated() > before
    backend.generate(GenerationRequest(_prompts(), n=4, max_tokens=[32] * 6, temperature=1.0, seed=0))
    backend.sleep()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    assert abs(after - before) <= 0.01 * before, (before, after)
    backend.generate(GenerationRequest(_prompts(), n=1, max_tokens=[8] * 6, temperature=0.0))  # wakes itself


def test_kept_graphs_are_replayed_after_sleep_wherever_the_cache_comes_back():
    """keep_graphs (the default): sleep() frees the KV cache and keeps the decode graphs with the
    small buffers they read; the next generate replays them (no capture) even when the new KV cache
    lies elsewhere, since the kernels find it through the address table; a change of another baked-in
    address (longer rope tables) captures again. The samples are a fresh engine's every time."""
    model = _model(torch.bfloat16, weight_scale=1.0)
    req = GenerationRequest(_prompts(), n=4, max_tokens=[40] * 6, temperature=1.0, seed=5)
    # A cache (~330 MB) well above what sleep keeps (cuBLAS workspaces are tens of MiB).
    want = [o.response_ids for o in NativeBackend(model, keep_graphs=False, num_kv_blocks=20000).generate(req)]
    backend = NativeBackend(model, num_kv_blocks=20000)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    assert [o.response_ids for o in backend.generate(req)] == want
    assert backend.stats["capture_s"] > 0 and backend.stats["graphs_reused"] == 0
    kv_bytes = backend.cache.k.numel() * backend.cache.k.element_size() * 2
    backend.sleep()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    assert backend.cache is None and kept < 96 * 2**20 and kept < kv_bytes / 3, (kept, kv_bytes)
    assert [o.response_ids for o in backend.generate(req)] == want
    assert backend.stats["graphs_reused"] == 1 and backend.stats["capture_s"] == 0.0
    # The cache at another address (the old one is still held): replayed on all the same.
    held = backend.cache
    backend.sleep()
    assert [o.response_ids for o in backend.generate(req)] == want
    assert backend.cache.k.data_ptr() != held.k.data_ptr()
    assert backend.stats["graphs_reused"] == 1 and backend.stats["capture_s"] == 0.0
    del held
    # Longer responses need longer rope tables: a new address the graphs baked in, so captured again.
    longer = GenerationRequest(_prompts(), n=4, max_tokens=[400] * 6, temperature=1.0, seed=5)
    fresh = [o.response_ids for o in NativeBackend(model, keep_graphs=False, num_kv_blocks=20000).generate(longer)]
    backend.sleep()
    assert [o.response_ids for o in backend.generate(longer)] == fresh
    assert backend.stats["graphs_reused"] == 0 and backend.stats["capture_s"] > 0


@torch.no_grad()
def test_prefill_never_waits_for_the_gpu():
    """With the real tokens' index built on the host, a prefill queues its work without a single
    device-to-host sync (a boolean mask cost two per layer)."""
    model = _model(torch.bfloat16)
    backend = NativeBackend(model, block_size=16)
    prompts = _prompts()
    backend.generate(GenerationRequest(prompts, n=1, max_tokens=[2] * len(prompts), temperature=0.0))  # cache, rope tables
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = torch.tensor(p)
    slots = torch.arange(len(prompts) * width).view(len(prompts), width)  # any slots: the cache is scratch here
    index = torch.cat([torch.arange(r * width, r * width + n) for r, n in enumerate(lengths)])
    args = [t.cuda() for t in (ids, torch.tensor(lengths), slots, index)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = backend.decoder.prefill(*args[:3], backend.cache, valid_index=args[3])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.shape == (len(prompts), 1000) and logits.isfinite().all()
