"""Optimizer state kept in CPU memory between steps (train.offload_optimizer): same updates, same checkpoints."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from hybridrl.train.optim import build_optimizer
from hybridrl.train.optim_offload import OffloadedOptimizerState
from hybridrl.train.update import optimizer_step

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _mlp(device, dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(device=device, dtype=dtype)


def _steps(model, opt, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(8, 16, generator=gen).to(next(model.parameters()))
        optimizer_step(model, opt, [x], lambda micro: (model(micro).square().mean(), {}), grad_clip=1.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("master_weights", ["compensated", "fp32", "none"])
def test_offloaded_state_gives_the_same_updates_and_checkpoints(device, master_weights):
    """Every optimizer here, with its moments moved out after each step and back before the next:
    bit-identical weights and optimizer state to the same optimizer without offloading, a state dict
    that loads into either, and training that continues identically from it."""
    dtype = torch.float32 if master_weights == "none" else torch.bfloat16
    plain = _mlp(device, dtype)
    offl = copy.deepcopy(plain)
    kw = dict(lr=1e-2, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8, master_weights=master_weights)
    opt_plain, opt_offl = build_optimizer(plain, **kw), build_optimizer(offl, **kw)
    offload = OffloadedOptimizerState(opt_offl)
    _steps(plain, opt_plain, 3)
    _steps(offl, opt_offl, 3)
    assert offload.is_offloaded()
    for p in (p for group in opt_offl.param_groups for p in group["params"]):  # (fp32 masters under "fp32")
        for key, value in opt_offl.state[p].items():
            if torch.is_tensor(value) and value.numel() == p.numel() > 1:
                assert value.device.type == "cpu" and value is offload._host[(id(p), key)], key
    for a, b in zip(plain.parameters(), offl.parameters()):
        assert torch.equal(a, b)

    def saved(opt):
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    state_plain, state_offl = saved(opt_plain), saved(opt_offl)
    for (ka, a), (kb, b) in zip(sorted(state_plain["state"].items()), sorted(state_offl["state"].items())):
        for key in a:
            va, vb = a[key], b[key]
            assert torch.equal(torch.as_tensor(va).cpu(), torch.as_tensor(vb).cpu()), key
    # resume: a fresh offloaded optimizer loads the plain one's state (sent to host at once) and continues identically
    resumed = copy.deepcopy(plain)
    opt_resumed = build_optimizer(resumed, **kw)
    offload_resumed = OffloadedOptimizerState(opt_resumed)
    opt_resumed.load_state_dict(state_plain)
    assert offload_resumed.is_offloaded()
    _steps(plain, opt_plain, 2, seed=1)
    _steps(resumed, opt_resumed, 2, seed=1)
    for a, b in zip(plain.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_a_skipped_step_leaves_the_state_offloaded_and_remove_brings_it_back():
    model = _mlp("cpu", torch.bfloat16)
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, master_weights="compensated")
    offload = OffloadedOptimizerState(opt)
    _steps(model, opt, 1)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.full((8, 16), float("nan"), dtype=torch.bfloat16)
    result = optimizer_step(model, opt, [x], lambda micro: (model(micro).square().mean(), {}), grad_clip=1.0)
    assert result.skipped and offload.is_offloaded()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    offload.remove()
    assert not offload.is_offloaded()
    _steps(model, opt, 1)  # no hooks left: the state stays where the step wrote it
    assert not offload.is_offloaded()
