"""Micro-batch metrics read once per optimizer step; the no-grad passes' token budget."""

import torch

from conftest import small_config
from hybridrl.cli.commands import build_trainer
from hybridrl.train import update
from hybridrl.trainer import rl_step


def test_micro_batch_metrics_are_summed_on_device_and_read_once(monkeypatch):
    """Tensor metrics are accumulated without a host sync per micro-batch and come out as floats:
    sums for losses, means for the rest, maxima for "/max" keys, floats and tensors mixed."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    values = [1.0, 3.0, 2.0]

    def loss_fn(i):
        loss = model(torch.ones(1, 2)).sum() * 0.0
        v = torch.tensor(values[i])
        return loss, {"a/loss": v, "a/frac": v * 2, "a/diff/max": v, "a/plain": float(i)}

    reads = []
    real_stack = torch.stack
    monkeypatch.setattr(update.torch, "stack", lambda ts, *a, **k: reads.append(len(ts)) or real_stack(ts, *a, **k))
    result = update.optimizer_step(model, optimizer, [0, 1, 2], loss_fn, grad_clip=0.0)
    m = result.metrics
    assert m["a/loss"] == 6.0 and m["a/frac"] == 4.0 and m["a/diff/max"] == 3.0 and m["a/plain"] == 1.0
    assert all(isinstance(v, float) for v in m.values())
    assert 3 in reads  # the three tensor metrics were read in one stacked transfer


def test_grad_norm_is_reported_with_and_without_clipping():
    """grad_clip > 0 scales the gradients to that norm before the update; grad_clip = 0 applies them
    as they are. Both report the norm before clipping."""
    def run(grad_clip):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        x = torch.randn(8, 4)
        grads = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
        result = update.optimizer_step(model, optimizer, [x], lambda m: (model(m).square().sum(), {}), grad_clip=grad_clip)
        steps = [b - p.detach() for b, p in zip(before, model.parameters())]  # lr 1: the applied gradients
        return result, norm, grads, steps

    result, norm, grads, steps = run(0.0)
    assert abs(result.grad_norm - norm) < 1e-4 and norm > 1.0
    for g, s in zip(grads, steps):
        torch.testing.assert_close(s, g)
    result, norm, grads, steps = run(1.0)
    assert abs(result.grad_norm - norm) < 1e-4
    applied = torch.linalg.vector_norm(torch.stack([s.norm() for s in steps])).item()
    assert abs(applied - 1.0) < 1e-3


def test_no_grad_passes_use_their_own_token_budget(tmp_path, arith_data, monkeypatch):
    budgets = []
    real = rl_step.batched_logprobs

    def spy(model, batch, **kwargs):
        budgets.append(kwargs["max_tokens"])
        return real(model, batch, **kwargs)

    monkeypatch.setattr(rl_step, "batched_logprobs", spy)
    cfg = small_config(tmp_path, arith_data, **{"train.total_steps": 1, "train.max_tokens_per_micro_batch": 64,
                                                "train.max_tokens_per_forward": 512, "trainer.eval_every": 0})  # fmt: skip
    build_trainer(cfg).fit()
    assert budgets == [512]  # the reference pass (on-policy: no old-log-prob pass)
    budgets.clear()
    cfg = small_config(tmp_path / "b", arith_data, **{"train.total_steps": 1, "train.max_tokens_per_micro_batch": 64,
                                                      "trainer.eval_every": 0})  # fmt: skip
    build_trainer(cfg).fit()
    assert budgets == [64]  # unset: the training budget


def test_rollout_metrics_come_from_host_data():
    """`rollout_metrics` reads the scores, lengths and groups the host holds (no device tensor is
    touched), and counts a group flat when its rewards are all equal, also where a standard deviation
    of the equal floats comes out a rounding error above zero (0.9, 0.9, 0.9 in fp32)."""
    from types import SimpleNamespace

    from hybridrl.train.batch import build_sequence_batch

    responses = [[1, 2, 3], [4], [5, 6], [7, 8], [9], [1, 1, 1, 1]]
    batch = build_sequence_batch([[1]] * 6, responses, pad_id=0)
    batch.response_mask = batch.input_ids = batch.attention_mask = None  # only the host view may be read
    batch.host = build_sequence_batch([[1]] * 6, responses, pad_id=0).host_view()
    samples = [SimpleNamespace(prompt_index=p, finish_reason=f) for p, f in
               zip([0, 0, 0, 2, 2, 5], ["length", "stop", "stop", "stop", "length", "stop"])]  # fmt: skip
    scores = torch.tensor([0.9, 0.9, 0.9, 1.0, 0.0, 0.5])
    assert scores[:3].std(unbiased=False) > 0  # the old test (fp32 std == 0) missed this group
    m = rl_step.rollout_metrics(batch, samples, scores)
    assert m["reward/frac_zero_std_groups"] == 2 / 3  # groups 0 (all 0.9) and 5 (one response)
    assert m["reward/mean"] == float(scores.double().mean())
    assert abs(m["reward/std"] - float(scores.std(unbiased=False))) < 1e-7
    assert abs(m["rollout/response_length/mean"] - 13 / 6) < 1e-6
    assert m["rollout/response_length/max"] == 4.0 and m["rollout/response_length/min"] == 1.0
    assert m["rollout/clipped_ratio"] == 2 / 6
