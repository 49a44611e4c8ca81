"""No wasted passes: skipping the old-log-prob pass on-policy changes no result; the reference pass
shares the old-log-prob forward structure and can be offloaded."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridrl.config import AlgorithmConfig, TrainConfig
from hybridrl.train.attention import enable_packed_attention
from hybridrl.train.batch import build_sequence_batch
from hybridrl.train.optim import build_optimizer, build_scheduler
from hybridrl.train.policy import PolicyTrainer, batched_logprobs
from hybridrl.train.reference import OffloadedWeights, StageGate, forward_stages, weights_on_device
from hybridrl.train.setup import LayerGroup, grouped_decoder_forward


def _batch(packed: bool):
    g = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for i in range(4):
        prompt = torch.randint(5, 100, (4 + i,), generator=g).tolist()
        for _ in range(4):
            prompts.append(prompt)
            responses.append(torch.randint(5, 100, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist())
    batch = dataclasses.replace(build_sequence_batch(prompts, responses, pad_id=0), packed=packed)
    batch["advantages"] = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    return batch


def _trainer(model, **train):
    cfg = TrainConfig(batch_size=16, micro_batch_size=8, lr=1e-3, **train)
    opt = build_optimizer(model, lr=cfg.lr, weight_decay=0.0, betas=cfg.adam_betas, eps=cfg.adam_eps)
    sched = build_scheduler(opt, warmup_steps=0, total_steps=10, schedule="constant")
    return PolicyTrainer(model, opt, sched, cfg, AlgorithmConfig(kl_coef=0.1), temperature=1.0)


@pytest.mark.parametrize("packed", [False, True])
def test_skipping_the_old_logprob_pass_on_policy_changes_no_result(tiny_model_path, packed):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    enable_packed_attention(base)
    reference = copy.deepcopy(base).requires_grad_(False)
    with_pass, skipped = copy.deepcopy(base), copy.deepcopy(base)
    batch = _batch(packed)
    batch["ref_logprobs"], _ = batched_logprobs(reference, batch, micro_batch_size=8, temperature=1.0, max_tokens=40)

    full = copy.copy(batch)
    full.tensors = dict(batch.tensors)
    full["old_logprobs"], _ = batched_logprobs(with_pass, batch, micro_batch_size=8, temperature=1.0, max_tokens=40)
    metrics_a, _ = _trainer(with_pass, max_tokens_per_micro_batch=40).update(full, shuffle_seed=0)
    metrics_b, _ = _trainer(skipped, max_tokens_per_micro_batch=40).update(batch, shuffle_seed=0)

    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/kl", "actor/entropy", "actor/grad_norm"):
        assert metrics_a[key] == pytest.approx(metrics_b[key], abs=1e-6), key
    assert metrics_a["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-7)
    for pa, pb in zip(with_pass.parameters(), skipped.parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=0)


def test_reference_offload_keeps_weights_off_device_between_uses(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval().requires_grad_(False)
    expected = [p.detach().clone() for p in model.parameters()]
    batch = _batch(packed=False)
    want, _ = batched_logprobs(model, batch, micro_batch_size=8, temperature=1.0)
    offloaded = OffloadedWeights(model)  # on CPU the "device" is the host: checked on a GPU in test_train_gpu.py
    with weights_on_device(offloaded):
        got, _ = batched_logprobs(model, batch, micro_batch_size=8, temperature=1.0)
    assert [p.data_ptr() for p in model.parameters()] == [h.data_ptr() for h in offloaded.host]
    assert all(torch.equal(p, e) for p, e in zip(model.parameters(), expected))
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_offloaded_weights_share_one_aligned_buffer_per_dtype():
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 7)).to(torch.bfloat16)
    model.register_parameter("scale", torch.nn.Parameter(torch.randn(3)))  # fp32: a buffer of its own
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    offloaded = OffloadedWeights(model)
    assert set(offloaded.flat) == {torch.bfloat16, torch.float32}
    for (name, p), host in zip(model.named_parameters(), offloaded.host):
        assert p.data_ptr() == host.data_ptr() and torch.equal(p, expected[name]), name
        flat = offloaded.flat[p.dtype]
        offset = (p.data_ptr() - flat.data_ptr()) // p.element_size()
        assert offset % 64 == 0 and 0 <= offset and offset + p.numel() <= flat.numel(), name
    views = [p.data_ptr() for p in model.parameters()]
    assert len(set(views)) == len(views)  # no two parameters overlap (distinct aligned slices)
    with weights_on_device(offloaded):  # on CPU the "device" is the host: the same views
        assert all(torch.equal(p, expected[n]) for n, p in model.named_parameters())
    offloaded.prefetch()  # off CUDA: nothing to copy
    assert not offloaded.prefetched



def test_offloaded_weights_are_laid_out_in_the_order_the_forward_reaches_them(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval().requires_grad_(False)
    expected = [p.detach().clone() for p in model.parameters()]
    names = {id(p): n for n, p in model.named_parameters()}
    offloaded = OffloadedWeights(model, streamed=True)
    layers = model.model.layers
    assert offloaded.streamed and len(offloaded.stages) == len(layers) + 2
    stage_names = [[names[id(offloaded.params[i])] for i in stage] for stage in offloaded.stages]
    assert stage_names[0] == ["model.embed_tokens.weight"]
    for i, stage in enumerate(stage_names[1:-1]):
        assert stage and all(n.startswith(f"model.layers.{i}.") for n in stage), stage
    assert set(stage_names[-1]) <= {"model.norm.weight", "lm_head.weight"} and "model.norm.weight" in stage_names[-1]
    # Each stage is one slice of the flat buffer, the slices in stage order, every parameter inside its own.
    flat = offloaded.flat[torch.float32]
    previous_end = 0
    for stage, ranges in zip(offloaded.stages, offloaded._ranges):
        lo, hi = ranges[torch.float32]
        assert lo == previous_end and hi > lo
        previous_end = hi
        for i in stage:
            offset = (offloaded.host[i].data_ptr() - flat.data_ptr()) // 4
            assert lo <= offset and offset + offloaded.host[i].numel() <= hi
    assert previous_end == flat.numel()
    assert [p.data_ptr() for p in model.parameters()] == [h.data_ptr() for h in offloaded.host]
    assert all(torch.equal(p, e) for p, e in zip(model.parameters(), expected))


def test_forward_stages_fall_back_to_one_stage_where_the_order_is_unknown(tiny_model_path):
    plain = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 7))
    assert forward_stages(plain, list(plain.parameters())) == [[0, 1, 2, 3]]
    assert not OffloadedWeights(plain, streamed=True).streamed
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.model.register_parameter("scale", torch.nn.Parameter(torch.ones(3)))  # a weight the forward might read anywhere
    params = list(model.parameters())
    assert forward_stages(model, params) == [list(range(len(params)))]


class _RecordingStream:
    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


def test_stage_gate_waits_once_per_stage_and_only_forward():
    stream = _RecordingStream()
    gate = StageGate(["embed", "layer0", "layer1", "layer2", "rest"], stream)
    gate.before_stage(0)
    gate.before_stage(0)
    gate.before_stage(3)
    gate.before_stage(2)  # covered by stage 3's event: the copies run in stage order on one stream
    gate.before_stage(9)  # past the last stage: the last
    gate.wait_all()
    assert stream.waited == ["embed", "layer2", "rest"]


def test_stage_gate_sends_the_rest_of_the_weights_when_the_pass_first_asks():
    stream, sent = _RecordingStream(), []
    gate = StageGate(["embed", "layer0", "rest"], stream, send_rest=lambda: sent.append(list(stream.waited)))
    assert sent == []
    gate.before_stage(0)
    gate.before_stage(1)
    gate.wait_all()
    assert sent == [[]]  # once, before the first wait


class _RecordingGate:
    def __init__(self):
        self.calls = []

    def before_stage(self, stage):
        self.calls.append(stage)

    def wait_all(self):
        self.calls.append("all")


def test_the_grouped_forward_asks_for_each_stage_before_it_runs(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval().requires_grad_(False)
    base, layers = model.model, model.model.layers
    assert len(layers) >= 2
    ids = torch.randint(5, 100, (1, 12))
    positions = torch.arange(12)[None]
    want = base(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    base._hybridrl_layer_groups = [LayerGroup(list(layers[:1])), LayerGroup(list(layers[1:]))]
    base._hybridrl_weights_gate = gate = _RecordingGate()
    got = grouped_decoder_forward(base, ids, positions)
    assert gate.calls == [0, 1, len(layers), "all"]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("packed", [False, True])
def test_an_ungrouped_pass_waits_for_all_the_streamed_weights_first(tiny_model_path, packed):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval().requires_grad_(False)
    enable_packed_attention(model)
    batch = _batch(packed)
    want, _ = batched_logprobs(model, batch, micro_batch_size=8, temperature=1.0)
    gate = model.model._hybridrl_weights_gate = _RecordingGate()
    model.model.embed_tokens.register_forward_pre_hook(lambda *_: gate.calls.append("embed"))
    got, _ = batched_logprobs(model, batch, micro_batch_size=8, temperature=1.0)
    passes = gate.calls.count("embed")
    assert passes >= 1 and gate.calls == ["all", "embed"] * passes  # each forward waits for everything, then reads
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    "algo",
    [
        dict(kl_coef=0.1, kl_estimator="k3"),
        dict(kl_coef=0.1, kl_estimator="k1", loss_agg="seq-mean-token-mean", entropy_coef=0.01),
        dict(kl_coef=0.05, kl_estimator="k2", loss_agg="seq-mean-token-sum-norm", dual_clip=3.0, clip_high=0.28),
        dict(kl_coef=0.0, loss_agg="seq-mean-token-sum", entropy_coef=0.02),
    ],
)
@pytest.mark.parametrize("off_policy", [False, True])
def test_gradient_made_in_the_lm_head_forward_changes_no_result(tiny_model_path, packed, algo, off_policy):
    """train.fused_logprob_grad: the policy loss's gradient made in the lm_head's forward pass gives
    the update the two-pass lm_head gives: metrics and parameters after two PPO epochs over
    token-budget micro-batches, on-policy and against other old log-probs (the clip then acts)."""
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    enable_packed_attention(base)
    reference = copy.deepcopy(base).requires_grad_(False)
    batch = _batch(packed)
    batch["ref_logprobs"], _ = batched_logprobs(reference, batch, micro_batch_size=8, temperature=1.0, max_tokens=40)
    if off_policy:
        noise = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(3))
        batch["old_logprobs"] = batch["ref_logprobs"] + 0.5 * noise * batch.response_mask
    models, results = [copy.deepcopy(base), copy.deepcopy(base)], []
    for model, fused in zip(models, (False, True)):
        cfg = TrainConfig(batch_size=16, micro_batch_size=8, lr=1e-3, max_tokens_per_micro_batch=40, ppo_epochs=2,
                          fused_logprob_grad=fused)  # fmt: skip
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # the update is the gradient: compared as it is
        sched = build_scheduler(opt, warmup_steps=0, total_steps=10, schedule="constant")
        trainer = PolicyTrainer(model, opt, sched, cfg, AlgorithmConfig(**algo), temperature=0.9)
        results.append(trainer.update(batch, shuffle_seed=0)[0])
    assert results[0].keys() == results[1].keys()
    for key in (k for k in results[0] if not k.startswith("timing/")):  # timings: the host's clock
        assert results[1][key] == pytest.approx(results[0][key], rel=1e-5, abs=1e-6), key
    assert (results[0]["actor/pg_clipfrac"] > 0) == off_policy
    for pa, pb in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(pb, pa, atol=1e-6, rtol=1e-5)
    assert any((pa - pb0).abs().max() > 1e-4 for pa, pb0 in zip(models[0].parameters(), base.parameters()))  # it moved


def test_an_estimator_without_a_closed_form_derivative_takes_the_two_pass_lm_head(tiny_model_path, monkeypatch):
    import hybridrl.train.policy as policy_module

    monkeypatch.setattr(policy_module, "KL_ESTIMATOR_GRADS", {})
    calls, two_pass = [], policy_module.response_logprobs
    monkeypatch.setattr(policy_module, "response_logprobs", lambda *a, **k: (calls.append(1), two_pass(*a, **k))[1])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    enable_packed_attention(model)
    batch = _batch(True)
    batch["ref_logprobs"] = torch.zeros(batch.response_mask.shape)
    metrics, _ = _trainer(model, max_tokens_per_micro_batch=40).update(batch, shuffle_seed=0)
    assert calls and math.isfinite(metrics["actor/kl"])


@pytest.mark.parametrize(
    "options",
    [
        dict(clip_low=0.2, clip_high=0.2, dual_clip=None, kl_coef=0.04, kl_estimator="k3", entropy_coef=0.0),
        dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01),
        dict(clip_low=0.1, clip_high=0.3, dual_clip=None, kl_coef=0.0, kl_estimator=None, entropy_coef=0.0),
    ],
)
def test_compiled_token_derivatives_equal_the_eager_ones(options):
    """With train.compile on a GPU the policy update's per-token derivatives run as one compiled
    graph (policy._compiled_token_loss_derivatives) for every chunk length: the same numbers as
    token_loss_derivatives op by op, on- and off-policy, clip, dual clip and KL bounds reached."""
    from hybridrl.train.policy import _compiled_token_loss_derivatives, token_loss_derivatives

    compiled = _compiled_token_loss_derivatives()
    g = torch.Generator().manual_seed(1)
    for n in (1024, 300):  # a full chunk, then the shorter last one: one graph serves both
        lp = -torch.rand(n, generator=g) * 5
        old = lp + torch.randn(n, generator=g) * 0.3
        old[:4] = lp[:4] + 30.0  # log-ratios beyond the clamp
        ref = lp + torch.randn(n, generator=g)
        ref[4:8] = lp[4:8] + 25.0  # past the k3 exponent bound
        weight, adv = torch.rand(n, generator=g), torch.randn(n, generator=g)
        for old_arg in (None, old):
            want = token_loss_derivatives(lp, weight, adv, old_arg, ref, **options)
            got = compiled(lp, weight, adv, old_arg, ref, **options)
            torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
            assert (got[1] is None) == (want[1] is None)
            if want[1] is not None:
                torch.testing.assert_close(got[1], want[1])
            assert want[0].abs().sum() > 0
