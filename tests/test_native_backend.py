"""The native rollout backend on CPU against full-forward references (fp32, tiny random models)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers

from hybridrl.rollout.native import NativeBackend
from hybridrl.rollout.native.backend import finished_sequences
from hybridrl.rollout.native.scheduler import PromptGroup, RunningSequence
from hybridrl.rollout.types import GeneratedSequence, GenerationRequest

VOCAB = 96


pytestmark = pytest.mark.usefixtures("one_thread")


def _config(arch: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False,
                                        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64})
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    raise ValueError(arch)


def _model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    cls = {"qwen2": transformers.Qwen2ForCausalLM, "llama": transformers.LlamaForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM, "mistral": transformers.MistralForCausalLM}[arch]
    model = cls(_config(arch)).eval()
    # Larger weights than the default init make logits peaked, so greedy argmax has no near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length,), generator=g).tolist() for length in (3, 17, 32, 9)]


@torch.no_grad()
def _greedy_reference(model, prompt: list[int], max_tokens: int, stop: set[int] = frozenset()) -> list[int]:
    ids = list(prompt)
    out = []
    for _ in range(max_tokens):
        tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
        if tok in stop:
            break
    return out


@torch.no_grad()
def _full_forward_logprobs(model, prompt, response, temperature):
    logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "mistral"])
def test_greedy_matches_full_forward(arch):
    model = _model(arch)
    prompts, max_tokens = _prompts(), [5, 20, 12, 9]
    backend = NativeBackend(model, block_size=8)
    outs = backend.generate(GenerationRequest(prompts, n=2, max_tokens=max_tokens, temperature=0.0))
    assert [(o.prompt_index, o.sample_index) for o in outs] == [(i, j) for i in range(4) for j in range(2)]
    for o in outs:
        ref = _greedy_reference(model, prompts[o.prompt_index], max_tokens[o.prompt_index])
        assert o.response_ids == ref
        assert o.finish_reason == "length"
        lp = _full_forward_logprobs(model, prompts[o.prompt_index], o.response_ids, 0.0)
        torch.testing.assert_close(torch.tensor(o.response_logprobs), lp, atol=1e-4, rtol=0)


def test_greedy_matches_hf_generate():
    model = _model("qwen2")
    prompts = _prompts()
    outs = NativeBackend(model).generate(GenerationRequest(prompts, n=1, max_tokens=[10] * 4, temperature=0.0))
    for o in outs:
        ids = torch.tensor([prompts[o.prompt_index]])
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                            min_new_tokens=10, eos_token_id=None)
        assert o.response_ids == hf[0, len(prompts[o.prompt_index]):].tolist()


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9, top_k=20)])
def test_sampled_logprobs_match_full_forward(sampling):
    model = _model("qwen3")
    prompts = _prompts()
    outs = NativeBackend(model, block_size=4).generate(
        GenerationRequest(prompts, n=3, max_tokens=[16] * 4, seed=7, **sampling)
    )
    for o in outs:
        lp = _full_forward_logprobs(model, prompts[o.prompt_index], o.response_ids, sampling["temperature"])
        torch.testing.assert_close(torch.tensor(o.response_logprobs), lp, atol=1e-4, rtol=0)
    # The n samples of a prompt are different draws.
    assert outs[0].response_ids != outs[1].response_ids or outs[1].response_ids != outs[2].response_ids


def test_stop_token_ends_sequence():
    model = _model("qwen2")
    prompts = _prompts()
    ref = _greedy_reference(model, prompts[1], 20)
    stop = ref[4]
    outs = NativeBackend(model).generate(
        GenerationRequest(prompts, n=2, max_tokens=[20] * 4, temperature=0.0, stop_token_ids=[stop])
    )
    for o in outs:
        expected = _greedy_reference(model, prompts[o.prompt_index], 20, {stop})
        assert o.response_ids == expected
        assert o.finish_reason == ("stop" if expected[-1] == stop else "length")
    assert outs[2].finish_reason == "stop" and outs[2].response_ids == ref[: ref.index(stop) + 1]


def test_seeds_reproducible_and_independent_of_batch():
    model = _model("llama")
    prompts = _prompts()
    backend = NativeBackend(model, block_size=4)
    req = dict(n=2, temperature=1.0, seed=123)
    a = backend.generate(GenerationRequest(prompts, max_tokens=[12] * 4, **req))
    b = backend.generate(GenerationRequest(prompts, max_tokens=[12] * 4, **req))
    assert [o.response_ids for o in a] == [o.response_ids for o in b]
    # Prompt 2 alone, with the seed that gives its samples the same per-sample seeds as above.
    alone = backend.generate(GenerationRequest([prompts[2]], n=2, max_tokens=[12], temperature=1.0, seed=123 + 2 * 2))
    assert [o.response_ids for o in alone] == [o.response_ids for o in a[4:6]]
    c = backend.generate(GenerationRequest(prompts, max_tokens=[12] * 4, n=2, temperature=1.0, seed=124))
    assert [o.response_ids for o in c] != [o.response_ids for o in a]


def test_continuous_batching_with_few_slots_and_on_finished():
    model = _model("qwen2")
    prompts = _prompts() * 2
    max_tokens = [3, 14, 7, 11] * 2
    backend = NativeBackend(model, block_size=4, max_num_seqs=4, max_batch_tokens=40)
    streamed = []
    outs = backend.generate(
        GenerationRequest(prompts, n=2, max_tokens=max_tokens, temperature=0.0), on_finished=streamed.append
    )
    assert len(outs) == len(streamed) == 16
    assert streamed[0].prompt_index == 0  # the shortest finish first, streamed as they end
    for o in outs:
        assert o.response_ids == _greedy_reference(model, prompts[o.prompt_index], max_tokens[o.prompt_index])


@pytest.mark.parametrize("max_num_seqs", [4, 64])
def test_checks_one_step_ahead_change_no_output(max_num_seqs, monkeypatch):
    """`step_ahead`: each host check reads the flags as of the chunk's end while one more step runs.
    Rows that stopped were frozen through that step and the others' token budgets count it, so the
    samples are the ones checked in step: same tokens, log-probs and finish reasons, with stop tokens
    ending rows at every point of a chunk, rows hitting max_tokens one step after a check, few slots
    (prompts admitted as others finish) and many."""
    model = _model("qwen2")
    prompts = _prompts() * 2
    max_tokens = [13, 24, 17, 21, 28, 15, 22, 19]
    calls = []
    real = NativeBackend._flags_then_step
    monkeypatch.setattr(NativeBackend, "_flags_then_step", lambda self, *a: calls.append(a) or real(self, *a))

    def run(ahead):
        backend = NativeBackend(model, block_size=4, max_num_seqs=max_num_seqs, sync_every=3, step_ahead=ahead)
        request = GenerationRequest(prompts, n=3, max_tokens=max_tokens, temperature=1.0, seed=5, stop_token_ids=[7, 11, 30])
        return backend.generate(request)

    base = run(False)
    assert not calls
    ahead = run(True)
    assert len(calls) >= 3  # the checks did run ahead
    assert {o.finish_reason for o in base} == {"stop", "length"}
    assert [(o.prompt_index, o.sample_index, o.response_ids, o.finish_reason) for o in ahead] == \
        [(o.prompt_index, o.sample_index, o.response_ids, o.finish_reason) for o in base]
    for a, b in zip(ahead, base):
        torch.testing.assert_close(torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs), atol=1e-5, rtol=0)
        assert len(a.response_ids) <= max_tokens[a.prompt_index]


def test_checks_one_step_ahead_match_greedy_references():
    """With the checks ahead, greedy outputs still equal a full forward's, stop tokens included."""
    model = _model("qwen2")
    prompts = _prompts()
    stop = _greedy_reference(model, prompts[1], 20)[4]
    backend = NativeBackend(model, block_size=4, sync_every=2, step_ahead=True)
    outs = backend.generate(GenerationRequest(prompts, n=2, max_tokens=[20, 20, 6, 13], temperature=0.0, stop_token_ids=[stop]))
    for o in outs:
        assert o.response_ids == _greedy_reference(model, prompts[o.prompt_index], [20, 20, 6, 13][o.prompt_index], {stop})


@pytest.mark.parametrize("fuse_weights", [False, True])
def test_sleep_wake_and_in_place_weight_updates(fuse_weights):
    model = _model("qwen2")
    prompts = _prompts()
    backend = NativeBackend(model, fuse_weights=fuse_weights)
    req = GenerationRequest(prompts, n=1, max_tokens=[8] * 4, temperature=0.0)
    first = [o.response_ids for o in backend.generate(req)]
    backend.sleep()
    assert backend.cache is None
    backend.wake()
    assert [o.response_ids for o in backend.generate(req)] == first
    # An in-place update of the trainer's weights (an optimizer step) is seen by the next call.
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    loss = model(torch.tensor([prompts[1]]), labels=torch.tensor([prompts[1]])).loss
    loss.backward()
    opt.step()
    updated = [o.response_ids for o in backend.generate(req)]
    assert updated != first
    assert updated == [_greedy_reference(model, p, 8) for p in prompts]


def test_supports():
    assert NativeBackend.supports(_model("qwen2"))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert not NativeBackend.supports(gpt2)
    with pytest.raises(ValueError, match="backend='hf'"):
        NativeBackend(gpt2)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_fused_weights_are_the_parameters_not_a_copy(arch):
    """fuse_weights (the GPU default) moves q/k/v and gate/up into one tensor per layer and points
    the modules' parameters at slices of it: the decode step reads the trained tensors themselves."""
    from hybridrl.rollout.native.fused import span

    model = _model(arch)
    reference = _model(arch)  # same seed: same weights, left unfused
    before = sum(p.numel() for p in model.parameters())
    backend = NativeBackend(model, fuse_weights=True)
    assert sum(p.numel() for p in model.parameters()) == before
    for layer, ref in zip(model.model.layers, reference.model.layers):
        a, m = layer.self_attn, layer.mlp
        assert _storage(a.q_proj.weight) == _storage(a.k_proj.weight) == _storage(a.v_proj.weight)
        assert _storage(m.gate_proj.weight) == _storage(m.up_proj.weight)
        assert span([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]) is not None
        assert all(p.is_leaf and p.requires_grad for p in (a.q_proj.weight, a.k_proj.weight, m.up_proj.weight))
        assert torch.equal(a.v_proj.weight, ref.self_attn.v_proj.weight) and torch.equal(m.up_proj.weight, ref.mlp.up_proj.weight)
    prompts = _prompts()
    req = GenerationRequest(prompts, n=2, max_tokens=[8] * 4, temperature=0.0)
    outs = backend.generate(req)
    fused = backend.decoder.fused
    assert fused.copied == 0
    for i, layer in enumerate(model.model.layers):
        assert fused.qkv_w[i].data_ptr() == layer.self_attn.q_proj.weight.data_ptr()
        assert fused.gate_up_w[i].data_ptr() == layer.mlp.gate_proj.weight.data_ptr()
    for o in outs:
        assert o.response_ids == _greedy_reference(reference, prompts[o.prompt_index], 8)


def test_fused_weights_fall_back_to_a_copy_when_a_parameter_moves():
    """Something that gives a parameter new storage (`p.data = ...`, `model.to(...)`) breaks the
    sharing; the next generate notices and copies the current weights, so it never reads stale ones."""
    model = _model("qwen2")
    backend = NativeBackend(model, fuse_weights=True)
    prompts = _prompts()
    req = GenerationRequest(prompts, n=1, max_tokens=[8] * 4, temperature=0.0)
    backend.generate(req)
    k = model.model.layers[1].self_attn.k_proj.weight
    with torch.no_grad():
        k.data = k.data.clone() * 3.0  # new storage, different values
    outs = backend.generate(req)
    assert backend.decoder.fused.copied == 1
    assert [o.response_ids for o in outs] == [_greedy_reference(model, p, 8) for p in prompts]
    with torch.no_grad():  # and a later in-place update of the moved parameter is seen too
        k.mul_(-1.0)
    outs = backend.generate(req)
    assert [o.response_ids for o in outs] == [_greedy_reference(model, p, 8) for p in prompts]


@torch.no_grad()
def test_fp32_residual_is_closer_to_the_exact_logprobs():
    """bf16 weights: carrying the residual stream in fp32 (`fp32_residual`) lowers the error of the
    rollout's log-probs against the same weights run in fp32; in fp32 the option changes nothing."""
    from hybridrl.models.synthetic import random_model

    exact = random_model("tiny", "cpu", num_hidden_layers=8, vocab_size=VOCAB, seed=0)
    model = copy.deepcopy(exact).to(torch.bfloat16)
    exact.load_state_dict({k: v.float() for k, v in model.state_dict().items()})  # the same (bf16) weights
    prompts = _prompts()
    request = GenerationRequest(prompts, n=2, max_tokens=[24] * 4, temperature=1.0, seed=5)
    errors = {}
    for fp32_residual in (False, True):
        outs = NativeBackend(model, fp32_residual=fp32_residual).generate(request)
        errors[fp32_residual] = torch.cat([
            (torch.tensor(o.response_logprobs) - _full_forward_logprobs(exact, prompts[o.prompt_index], o.response_ids, 1.0)).abs()
            for o in outs
        ]).mean().item()  # fmt: skip
    assert errors[True] < 0.75 * errors[False], errors  # measured: about 0.6x

    plain = NativeBackend(exact).generate(request)
    wide = NativeBackend(exact, fp32_residual=True).generate(request)
    assert [o.response_ids for o in plain] == [o.response_ids for o in wide]
    torch.testing.assert_close([torch.tensor(o.response_logprobs) for o in wide], [torch.tensor(o.response_logprobs) for o in plain])


def test_native_options_reach_only_the_native_backend():
    from hybridrl.rollout.engine import RolloutEngine

    model = _model("qwen2")
    native = RolloutEngine(model, None, backend="native", native_options={"fp32_residual": True, "kv_cache_fraction": 0.5})
    assert native.backend.decoder.fp32_residual and native.backend.kv_cache_fraction == 0.5
    hf = RolloutEngine(model, None, backend="hf", native_options={"fp32_residual": True})
    assert hf.backend_name == "hf"
    # Given as a plain keyword, a native option is not silently dropped by the hf backend.
    with pytest.raises(TypeError, match="native_options"):
        RolloutEngine(model, None, backend="hf", kv_cache_fraction=0.5)


def test_generate_reports_where_its_time_went():
    from hybridrl.rollout.engine import RolloutEngine

    model = _model("qwen2")
    engine = RolloutEngine(model, None, backend="native")
    request = GenerationRequest(_prompts(), n=2, max_tokens=[12] * 4, temperature=1.0, seed=0, stop_token_ids=[9])
    engine.backend.generate(request)
    stats = engine.backend.stats
    assert set(stats) == {"prepare_s", "prefill_s", "decode_s", "capture_s", "host_syncs", "graphs_reused"}
    assert stats["prefill_s"] > 0 and stats["decode_s"] > 0 and stats["host_syncs"] >= 2
    assert stats["capture_s"] == 0.0 and stats["graphs_reused"] == 0  # no CUDA graphs on CPU


def test_shared_prefix_tables_group_rows_by_their_shared_prompt_blocks():
    """Cascade attention's tables (shared_prefix.py): a group entry per prompt with >= 2 running rows
    and >= 1 full shared block; every other row attends to its whole context alone (prefix 0)."""
    from hybridrl.rollout.native.scheduler import PromptGroup, RunningSequence
    from hybridrl.rollout.native.shared_prefix import SharedPrefix

    a = PromptGroup(0, [1] * 40, 8, 3, shared_blocks=[5, 6])  # 2 full blocks of 16 shared
    b = PromptGroup(1, [1] * 20, 8, 3, shared_blocks=[7])  # only one of its rows still runs
    c = PromptGroup(2, [1] * 9, 8, 3, shared_blocks=[])  # shorter than a block: nothing to share
    running = {0: RunningSequence(a, 0, 0), 4: RunningSequence(a, 2, 4), 2: RunningSequence(a, 1, 2),
               1: RunningSequence(b, 0, 1), 3: RunningSequence(c, 0, 3), 5: RunningSequence(c, 1, 5)}  # fmt: skip
    prefix = SharedPrefix(8, 3, num_heads=4, num_kv_heads=2, head_dim=16, device=torch.device("cpu"))
    assert prefix.members == 4
    assert prefix.update(running, block_size=16) == 1
    assert prefix.row_prefix.tolist() == [32, 0, 32, 0, 32, 0, 0, 0]
    assert prefix.group_rows[0].tolist() == [0, 2, 4, -1]
    assert prefix.group_prefix.tolist() == [32, 0, 0, 0]
    assert (prefix.group_rows[1:] == -1).all()
    # Rows finish and move: the tables follow.
    del running[4]
    running[1] = RunningSequence(a, 2, 1)
    assert prefix.update(running, block_size=16) == 1
    assert prefix.row_prefix.tolist() == [32, 32, 32, 0, 0, 0, 0, 0]
    assert prefix.group_rows[0].tolist() == [0, 1, 2, -1]
    assert prefix.fits(8, 4, 4, 2, 16) and not prefix.fits(8, 5, 4, 2, 16) and not prefix.fits(8, 4, 4, 2, 16, splits=2)


def test_shared_prefix_splits_fill_the_gpu():
    """The prefix is split into enough chunks per group for two programs per SM (132 off a GPU),
    a group counted per n rows, at most MAX_SPLITS; the state buffers hold every batch's (row, chunk)."""
    from hybridrl.rollout.native.shared_prefix import MAX_SPLITS, SharedPrefix

    prefix = SharedPrefix(512, 8, num_heads=14, num_kv_heads=2, head_dim=64, device=torch.device("cpu"))
    assert [prefix.splits(b) for b in (256, 512, 128, 8)] == [5, 3, 9, MAX_SPLITS]  # 32 x 2 x 5 = 320 >= 264
    assert prefix.capacity == max(b * prefix.splits(b) for b in range(1, 513)) == 1536
    assert prefix.acc.shape == (1536 * 14, 64) and prefix.ml.shape == (1536 * 14, 2)
    fixed = SharedPrefix(512, 8, num_heads=14, num_kv_heads=2, head_dim=64, device=torch.device("cpu"), splits=2)
    assert fixed.splits(8) == fixed.splits(512) == 2 and fixed.capacity == 1024


def _chi2_bound(dof: int, z: float = 4.753) -> float:
    """Upper 1e-6 quantile of chi-square(dof) (Wilson-Hilferty; z: the normal's 1e-6 quantile)."""
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def test_two_level_sampler_draws_from_the_softmax():
    """The two-level draw (a chunk by Gumbel-max over the chunks' log-masses, then a token of it)
    has the distribution softmax(logits / T): 20k draws (varying step and key) of a 50-token
    vocabulary in 7 chunks of 8 (the last one partial) pass a chi-square test, which the same
    draw with a uniform chunk choice fails by far."""
    from hybridrl.rollout.native.sampling import SamplingParams, sample

    vocab, chunk, temperature, draws = 50, 8, 0.8, 20_000
    g = torch.Generator().manual_seed(11)
    # Chunks of very different masses, tokens of different weights within each chunk.
    offsets = torch.tensor([-1.0, 0.5, 2.0, -2.0, 0.0, 1.0, 1.5]).repeat_interleave(chunk)[:vocab]
    logits = torch.randn(vocab, generator=g) * 1.2 + offsets
    p = torch.softmax(logits / temperature, dim=-1).double()
    keys = torch.tensor([7, 0xDEADBEEF, 12345, 0xFFFFFFFF]).repeat_interleave(draws // 4)
    steps = torch.arange(draws // 4).repeat(4)
    params = SamplingParams(temperature=temperature)

    def chi2(rows_logits: torch.Tensor):
        tokens, logprobs = sample(rows_logits.expand(draws, vocab), keys, steps, params, chunk=chunk)
        counts = torch.bincount(tokens, minlength=vocab).double()
        return float(((counts - draws * p) ** 2 / (draws * p)).sum()), tokens, logprobs

    stat, tokens, logprobs = chi2(logits)
    assert stat < _chi2_bound(vocab - 1), stat
    torch.testing.assert_close(logprobs, torch.log(p).float()[tokens], atol=1e-5, rtol=0)
    # The chunk marginal alone, with its 6 degrees of freedom.
    chunk_of = torch.arange(vocab) // chunk
    chunk_p = torch.zeros(7, dtype=torch.float64).index_add_(0, chunk_of, p)
    chunk_counts = torch.bincount(chunk_of[tokens], minlength=7).double()
    assert float(((chunk_counts - draws * chunk_p) ** 2 / (draws * chunk_p)).sum()) < _chi2_bound(6)

    # A wrong sampler: every chunk given the same log-mass (a uniform chunk choice), the same
    # tokens within a chunk. Its draws are measured against the softmax all the same.
    scaled = logits / temperature
    log_mass = torch.stack([scaled[chunk_of == c].logsumexp(0) for c in range(7)])
    uniform_chunks = (scaled - log_mass[chunk_of]) * temperature
    wrong, _, _ = chi2(uniform_chunks)
    assert wrong > 20 * _chi2_bound(vocab - 1), wrong


def test_sampled_token_is_a_function_of_seed_step_and_logits_only():
    """Same (key, step, logits) -> same token and log-prob, whichever rows share the batch, in
    which order; another step or key -> another draw (for at least some rows)."""
    from hybridrl.rollout.native.sampling import SamplingParams, sample

    g = torch.Generator().manual_seed(2)
    batch, vocab = 9, 5000
    logits = torch.randn(batch, vocab, generator=g) * 2
    keys = torch.randint(0, 2**32, (batch,), generator=g)
    steps = torch.randint(0, 1000, (batch,), generator=g)
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.6)):
        tok, lp = sample(logits, keys, steps, params)
        for row in range(batch):
            others = torch.randn(4, vocab, generator=g)
            mixed_logits = torch.cat([others[:2], logits[row : row + 1], others[2:]])
            mixed_keys = torch.cat([keys[row : row + 1].repeat(2) + 1, keys[row : row + 1], keys[:2]])
            mixed_steps = torch.cat([steps[:2], steps[row : row + 1], steps[row : row + 1].repeat(2)])
            t, l = sample(mixed_logits, mixed_keys, mixed_steps, params)
            assert t[2] == tok[row] and l[2] == lp[row]
            alone, _ = sample(logits[row : row + 1], keys[row : row + 1], steps[row : row + 1], params)
            assert alone.item() == tok[row].item()
        assert not torch.equal(sample(logits, keys, steps + 1, params)[0], tok)
        assert not torch.equal(sample(logits, keys ^ 1, steps, params)[0], tok)


def _reference_finished_sequences(seqs, tokens, logprobs, lengths, stop_set):
    """The per-row torch version `_collect` had before it read the rows as numpy slices."""
    out = []
    for r, seq in enumerate(seqs):
        response = tokens[r, : lengths[r]].tolist()
        out.append(GeneratedSequence(
            prompt_index=seq.group.prompt_index, sample_index=seq.sample_index, response_ids=response,
            response_logprobs=logprobs[r, : lengths[r]].tolist(),
            finish_reason="stop" if response[-1] in stop_set else "length",
        ))  # fmt: skip
    return out


@pytest.mark.parametrize("seed", range(50))
def test_finished_sequences_match_the_per_row_reference(seed):
    """Finished rows (lengths 1 .. the block's width, stopped or not) become the same sequences:
    same ids and log-probs (floats bit for bit), finish reasons, order."""
    g = torch.Generator().manual_seed(seed)
    rows, width = int(torch.randint(1, 20, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
    tokens = torch.randint(0, 8, (rows, width + 1), generator=g)
    logprobs = -torch.rand(rows, width + 1, generator=g) * 10
    lengths = torch.randint(1, width + 1, (rows,), generator=g).tolist()
    groups = [PromptGroup(i, [1, 2], width, 4) for i in range(3)]
    seqs = [RunningSequence(groups[r % 3], r // 3, slot=r) for r in range(rows)]
    stop_set = {0, 3} if seed % 2 else set()
    got = finished_sequences(seqs, tokens, logprobs, lengths, stop_set)
    assert got == _reference_finished_sequences(seqs, tokens, logprobs, lengths, stop_set)
    for s in got:  # the same values as numpy arrays, for the trainer's batch layout
        ids, lps = s.arrays
        assert ids.dtype == np.int64 and lps.dtype == np.float32
        assert ids.tolist() == s.response_ids and lps.tolist() == s.response_logprobs
    assert all(type(x) is int for s in got for x in s.response_ids)
    assert all(type(x) is float for s in got for x in s.response_logprobs)


@pytest.mark.parametrize("vocab,chunk", [(102, 8192), (8192, 8192), (5, 64)])
def test_a_vocabulary_of_one_chunk_draws_by_token_noise_alone(vocab, chunk):
    """With one chunk the chunk draw has a single choice, so the two-level draw is the one-level
    Gumbel-max over the vocabulary's token noise (no noise for the padding past it)."""
    from hybridrl.rollout.native.sampling import gumbel_noise, two_level_gumbel_max

    g = torch.Generator().manual_seed(vocab)
    scaled = torch.randn(64, vocab, generator=g) * 2
    keys = torch.randint(0, 2**32, (64,), generator=g)
    steps = torch.randint(0, 2**31, (64,), generator=g)
    expected = (scaled + gumbel_noise(keys, steps, vocab)).argmax(dim=-1)
    assert torch.equal(two_level_gumbel_max(scaled, keys, steps, chunk), expected)


def test_prefill_picks_the_real_tokens_by_a_host_built_index():
    """The engine hands the prefill the flat places of the prompts' real tokens (no boolean mask,
    whose size a GPU would have to send back); samples equal those of the mask path."""
    model = _model("qwen2")
    prompts = _prompts()  # lengths 3, 17, 32, 9: padded to 32
    request = GenerationRequest(prompts, n=2, max_tokens=[8] * 4, temperature=1.0, seed=5)
    backend = NativeBackend(model, block_size=4)
    prefill, seen = backend.decoder.prefill, []

    def spy(*args, valid_index=None, **kwargs):
        seen.append(valid_index.clone())
        return prefill(*args, valid_index=valid_index, **kwargs)

    backend.decoder.prefill = spy
    got = backend.generate(request)
    expected = [r * 32 + t for r, n in enumerate(len(p) for p in prompts) for t in range(n)]
    assert seen[0].tolist() == expected

    def mask_path(input_ids, lengths, slots, cache, valid_index):  # the index from a boolean mask, on the device
        valid = torch.arange(input_ids.shape[1])[None] < lengths[:, None]
        return prefill(input_ids, lengths, slots, cache, valid_index=valid.flatten().nonzero()[:, 0])

    backend.decoder.prefill = mask_path
    want = backend.generate(request)
    assert [o.response_ids for o in got] == [o.response_ids for o in want]
    assert [o.response_logprobs for o in got] == [o.response_logprobs for o in want]


class _FreeListAllocator:
    """The allocator as it was: a free list of every block id, lowest popped first, a count per id."""

    def __init__(self, num_blocks):
        self._free = list(range(num_blocks - 1, 0, -1))
        self._refs = [0] * num_blocks

    def allocate(self, count):
        blocks = [self._free.pop() for _ in range(count)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, blocks, extra_refs):
        for b in blocks:
            self._refs[b] += extra_refs

    def release(self, blocks):
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)


@pytest.mark.parametrize("seed", range(20))
def test_block_allocator_hands_out_the_ids_a_free_list_did(seed):
    """The counter-and-returns allocator hands out the same ids in the same order as a free list of
    every id, through random allocations, sharing and releases; it counts what is free and refuses a
    block released more often than it was held."""
    from hybridrl.rollout.native.kv_cache import BlockAllocator

    rng = np.random.default_rng(seed)
    num_blocks = int(rng.integers(2, 300))
    new, old = BlockAllocator(num_blocks), _FreeListAllocator(num_blocks)
    held: list[list[int]] = []  # one entry per reference
    for _ in range(400):
        if held and rng.random() < 0.45:
            blocks = held.pop(int(rng.integers(len(held))))
            new.release(blocks)
            old.release(blocks)
        elif new.num_free:
            count = int(rng.integers(1, new.num_free + 1))
            got = new.allocate(count)
            assert got == old.allocate(count)
            held.append(got)
            if rng.random() < 0.3:
                extra = int(rng.integers(1, 4))
                new.share(got, extra)
                old.share(got, extra)
                held.extend([got] * extra)
        assert new.num_free == len(old._free)
        assert 0 not in new._refs and all(1 <= b < num_blocks for b in new._refs)
    for blocks in held:
        new.release(blocks)
    assert new.num_free == num_blocks - 1
    with pytest.raises(AssertionError, match="released twice"):
        new.release([1])


def test_cache_size_past_the_attention_offsets_is_refused():
    """A fixed KV cache whose layers would pass the decode attention's 32-bit offsets is refused with
    the largest block count that fits (the automatic size is capped there instead)."""
    from hybridrl.rollout.native.kv_cache import PagedKVCache

    model = _model("qwen2")
    s = NativeBackend(model, block_size=16).weights.spec
    most = PagedKVCache.max_blocks(s.num_kv_heads, 16, s.head_dim)
    assert NativeBackend(model, block_size=16, num_kv_blocks=most)._gpu_num_blocks() == most
    with pytest.raises(ValueError, match=f"set num_kv_blocks to at most {most:,}"):
        NativeBackend(model, block_size=16, num_kv_blocks=most + 1)._gpu_num_blocks()
