"""Mixed precision: bf16 model, fp32 master weights, gradients and AdamW state."""

from __future__ import annotations

import pytest
import torch

from hybridrl.train.optim import build_optimizer, grad_params
from hybridrl.train.precision import MasterWeightAdamW
from hybridrl.train.update import optimizer_step

ADAM = dict(lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)


def _model(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(dtype)


def _loss(model, x):
    return model(x).float().pow(2).mean()


def test_build_optimizer_picks_master_weights_for_low_precision_models():
    assert type(build_optimizer(_model(torch.float32), **ADAM)) is torch.optim.AdamW
    assert type(build_optimizer(_model(), **ADAM)) is MasterWeightAdamW
    assert type(build_optimizer(_model(), **ADAM, master_weights="none")) is torch.optim.AdamW


def test_small_updates_survive_in_master_weights_and_reach_the_bf16_model():
    """lr 1e-6: every AdamW step on bf16 weights rounds away; with fp32 masters the steps add up."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    plain_model, model = _model(), _model()
    plain = build_optimizer(plain_model, **ADAM, master_weights="none")
    master = build_optimizer(model, **ADAM)
    start = [p.detach().clone() for p in model.parameters()]
    for _ in range(200):
        for m, opt in ((plain_model, plain), (model, master)):
            opt.zero_grad()
            _loss(m, x).backward()
            opt.step()
    unchanged = sum((p == s).sum().item() for p, s in zip(plain_model.parameters(), start))
    assert unchanged / sum(p.numel() for p in start) > 0.9  # bf16 AdamW: nearly every update was lost
    start_of = {id(p): s for p, s in zip(model.parameters(), start)}
    moved = [(m - start_of[id(p)].float()).abs().max().item() for p, m in zip(master.model_params, master.master_params)]
    assert all(1e-4 < d < 3e-4 for d in moved)  # ~200 steps of ~lr each
    for p, m in zip(master.model_params, master.master_params):
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
        assert torch.equal(p, m.to(torch.bfloat16))  # the model computes with the rounded masters
    assert any(not torch.equal(p, s) for p, s in zip(model.parameters(), start))


def test_gradients_accumulate_in_fp32_and_leave_no_bf16_grads():
    model = _model()
    opt = build_optimizer(model, **ADAM)
    xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16) for i in range(3)]
    expected = [torch.zeros_like(m) for m in opt.master_params]
    for x in xs:  # the fp32 sum of each micro-batch's bf16 gradient
        grads = torch.autograd.grad(_loss(model, x), opt.model_params)
        expected = [e + g.float() for e, g in zip(expected, grads)]
    opt.zero_grad()
    for x in xs:
        _loss(model, x).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(a is b for a, b in zip(grad_params(model, opt), opt.masters(model.parameters())))
    for m, e in zip(opt.master_params, expected):
        assert m.grad.dtype == torch.float32
        torch.testing.assert_close(m.grad, e, atol=0, rtol=0)


def test_state_dict_round_trip_restores_masters_exactly():
    model = _model()
    opt = build_optimizer(model, **ADAM)
    x = torch.randn(4, 16).to(torch.bfloat16)
    for _ in range(3):
        opt.zero_grad()
        _loss(model, x).backward()
        opt.step()
    state = opt.state_dict()
    other = _model(seed=5)
    restored = build_optimizer(other, **ADAM)
    restored.load_state_dict(state)
    for a, b in zip(restored.master_params, opt.master_params):
        assert torch.equal(a, b)
    for a, b in zip(other.parameters(), model.parameters()):
        assert torch.equal(a, b)  # the model now holds the restored masters, rounded
    assert "master_params" in state  # the caller's dict is not consumed
    # A state without masters (e.g. written before) starts them from the model's weights.
    legacy = {k: v for k, v in state.items() if k != "master_params"}
    third = _model(seed=7)
    fresh = build_optimizer(third, **ADAM)
    fresh.load_state_dict(legacy)
    assert all(torch.equal(m, p.float()) for m, p in zip(fresh.master_params, fresh.model_params))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradients_skip_the_update(bad):
    model = _model()
    opt = build_optimizer(model, **ADAM)
    before = [m.clone() for m in opt.master_params]
    x = torch.randn(4, 16).to(torch.bfloat16)
    poisoned = x.clone()
    poisoned[0, 0] = bad
    result = optimizer_step(model, opt, [x, poisoned], lambda micro: (_loss(model, micro), {}), grad_clip=1.0)
    assert result.skipped
    assert all(torch.equal(m, b) for m, b in zip(opt.master_params, before))
    result = optimizer_step(model, opt, [x, x], lambda micro: (_loss(model, micro), {}), grad_clip=1.0)
    assert not result.skipped and result.grad_norm > 0
    assert any(not torch.equal(m, b) for m, b in zip(opt.master_params, before))


def test_step_hooks_run_once_per_step_after_a_plain_adamw_exists():
    """torch wraps a class's `step` with the hook runner when its first instance is built, so once any plain
    AdamW exists, AdamW.step runs hooks too. MasterWeightAdamW's step must not run them a second time through
    it: a post hook (the trainer's preemption and optimizer-offload hooks) sees one finished step, with the
    model's bf16 weights already updated."""
    torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())  # patches AdamW.step, as any other AdamW in the process does
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    opt = MasterWeightAdamW([{"params": list(model.parameters())}], lr=0.1)
    before = model.weight.detach().clone()
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append(("post", torch.equal(model.weight, before))))
    model(torch.randn(2, 4, dtype=torch.bfloat16)).float().square().sum().backward()
    opt.step()
    assert calls == ["pre", ("post", False)]  # once each; the post hook sees the updated model weights
