"""Compensated bf16 AdamW: bf16 weights + bf16 Kahan compensation, bf16 moments (v stochastically rounded)."""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch

from conftest import TINY_MODEL, small_config
from hybridrl.config import ConfigError, load_config
from hybridrl.train import triton_adamw
from hybridrl.train.optim import build_optimizer, build_scheduler, grad_params
from hybridrl.train.precision import CompensatedAdamW, MasterWeightAdamW, stochastic_round
from hybridrl.train.update import optimizer_step

ADAM = dict(betas=(0.9, 0.999), eps=1e-8)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _mlp(dtype=torch.bfloat16, seed=0, device="cpu"):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 32))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.to(device=device, dtype=dtype)


def _grads(model, steps, seed=1):
    """Per step, one bf16 gradient per parameter: a fixed direction plus noise (so Adam moves ~lr a step)."""
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(p.shape, generator=gen) for p in model.parameters()]
    return [[(b + 0.5 * torch.randn(b.shape, generator=gen)).mul(1e-3).to(torch.bfloat16) for b in base] for _ in range(steps)]


def _run(model, opt, grads, scheduler=None):
    for step_grads in grads:
        opt.zero_grad(set_to_none=True)
        for p, g in zip(model.parameters(), step_grads):
            p.grad = g.to(device=p.device, dtype=p.dtype)
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _effective(model, opt):
    """Weights as fp32: p + comp under CompensatedAdamW, else p."""
    out = []
    for p in model.parameters():
        comp = opt.state[p].get("comp") if isinstance(opt, CompensatedAdamW) else None
        out.append(p.detach().float() + (comp.float() if comp is not None else 0))
    return [t.cpu() for t in out]


def _three_runs(lr, weight_decay, steps, warmup, device="cpu"):
    """fp32 reference AdamW, compensated bf16 AdamW and plain bf16 AdamW on the same bf16 gradients."""
    bf16 = _mlp(device=device)
    start = [p.detach().float().cpu() for p in bf16.parameters()]
    grads = _grads(bf16, steps)
    results = {}
    for mode in ("reference", "compensated", "none"):
        model = copy.deepcopy(bf16).float() if mode == "reference" else copy.deepcopy(bf16)
        opt = build_optimizer(model, lr=lr, weight_decay=weight_decay, master_weights=mode if mode != "reference" else "fp32", **ADAM)
        sched = build_scheduler(opt, warmup_steps=warmup, total_steps=steps, schedule="constant")
        _run(model, opt, grads, sched)
        results[mode] = (model, opt)
    return start, results


@pytest.mark.parametrize("device", DEVICES)
def test_small_updates_accumulate_like_fp32_adamw(device):
    """lr 1e-6 on weights ~N(0, 0.02): every update is below half a bf16 ulp. Compensated AdamW's
    effective weights follow fp32 AdamW; plain bf16 AdamW loses most of the displacement."""
    start, runs = _three_runs(lr=1e-6, weight_decay=0.1, steps=50, warmup=10, device=device)
    ref_model, ref_opt = runs["reference"]
    assert type(ref_opt) is torch.optim.AdamW and next(ref_model.parameters()).dtype == torch.float32
    ref = _effective(*runs["reference"])
    comp = _effective(*runs["compensated"])
    plain = _effective(*runs["none"])
    assert isinstance(runs["compensated"][1], CompensatedAdamW)

    moved = torch.cat([(r - s).flatten() for r, s in zip(ref, start)])
    err = torch.cat([(c - r).flatten() for c, r in zip(comp, ref)])
    assert 3e-5 < moved.abs().max() < 5e-5  # ~45 steps of ~lr after the warm-up
    assert err.abs().max() < 0.05 * moved.abs().max()
    assert err.abs().mean() < 0.01 * moved.abs().mean()

    kept = sum((p - s).abs().sum() for p, s in zip(plain, start)) / moved.abs().sum()
    assert kept < 0.3  # bf16 AdamW: most of the displacement was rounded away

    # The bf16 weights the model computes with are the effective weights rounded to nearest:
    # the compensation is at most half a bf16 ulp of the weight.
    model, opt = runs["compensated"]
    for p in model.parameters():
        comp_buf = opt.state[p]["comp"]
        assert p.dtype == comp_buf.dtype == torch.bfloat16
        w = p.detach().float()
        ulp = torch.exp2(torch.floor(torch.log2(w.abs())) - 7)
        assert (comp_buf.float().abs() <= ulp / 2)[w != 0].all()


def test_groups_weight_decay_and_lambda_lr_match_fp32_adamw():
    """At a large lr (no rounding problem) with decay on matrices only and an lr warm-up, the
    compensated run is AdamW: within bf16 noise of the fp32 run, and biases see no decay."""
    start, runs = _three_runs(lr=1e-2, weight_decay=0.5, steps=20, warmup=5)
    ref, comp = _effective(*runs["reference"]), _effective(*runs["compensated"])
    for r, c, s in zip(ref, comp, start):
        assert (c - r).abs().max() < 0.02 * (r - s).abs().max()
    opt = runs["compensated"][1]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2)  # LambdaLR set it after the warm-up
    # lr 0 (LambdaLR's multiplier 0) leaves the weights alone, decay included.
    model = copy.deepcopy(runs["compensated"][0])
    opt = build_optimizer(model, lr=1.0, weight_decay=0.5, master_weights="compensated", **ADAM)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0)
    before = [p.detach().clone() for p in model.parameters()]
    _run(model, opt, _grads(model, 3))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(not opt.state[p]["comp"].any() for p in model.parameters())


def test_fp32_parameters_get_exact_adamw():
    model = _mlp(torch.float32)
    ref = copy.deepcopy(model)
    opt = CompensatedAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, **ADAM)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, foreach=False, **ADAM)
    grads = _grads(model, 10)
    _run(model, opt, grads)
    _run(ref, ref_opt, grads)
    assert all(opt.state[p]["exp_avg_sq"].dtype == torch.float32 for p in model.parameters())
    for a, b in zip(_effective(model, opt), ref.parameters()):
        torch.testing.assert_close(a, b.detach(), atol=1e-7, rtol=1e-6)


@pytest.mark.gpu
def test_triton_kernel_matches_the_pytorch_path():
    """Same weights and gradients, three steps each way. Only the random bits differ (and fp32
    rounding, fused multiply-adds): stored values within a few bf16 ulps, weights within 2% of
    the displacement."""
    shapes = [(3000, 1000), (4097,), (1,)]

    def start(i, shape):
        return (torch.randn(shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(i)) * 0.02).to(torch.bfloat16)

    runs = {}
    for fused in (True, False):
        params = [torch.nn.Parameter(start(i, s)) for i, s in enumerate(shapes)]
        opt = CompensatedAdamW(params, lr=1e-4, weight_decay=0.1, fused=fused, **ADAM)
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = start(100 * step + i + 1, p.shape) * 0.05
            opt.step()
        runs[fused] = (params, opt)
    (kp, kopt), (tp, topt) = runs[True], runs[False]
    for i, (a, b) in enumerate(zip(kp, tp)):
        ka, ta = kopt.state[a], topt.state[b]
        eff_k, eff_t = a.float() + ka["comp"].float(), b.float() + ta["comp"].float()
        moved = (eff_t - start(i, shapes[i]).float()).abs().max()
        assert (eff_k - eff_t).abs().max() < 0.02 * moved
        for key in ("exp_avg", "exp_avg_sq"):  # each step's rounding may differ by an ulp: at most 4 after 3 steps
            ref = ta[key].float()
            diff = ka[key].float() - ref
            assert (diff.abs() <= 2**-5 * ref.abs() + 1e-3 * ref.abs().max()).all(), key
            if ref.numel() > 100_000:
                assert diff.mean().abs() <= 1e-3 * ref.abs().mean(), key  # no bias between the two
    assert not torch.equal(kopt.state[kp[0]]["exp_avg_sq"], topt.state[tp[0]]["exp_avg_sq"])  # other bits


KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: under TRITON_INTERPRET=1
kernel_runs = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1") or not triton_adamw.available(),
    reason="needs Triton and a CUDA GPU or TRITON_INTERPRET=1",
)


@kernel_runs
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_kernel_launch_over_many_tensors_equals_one_per_tensor(dtype):
    """The kernel finds each program's tensor in its table: one launch over tensors of sizes around
    the block edges gives, bit for bit, what one launch per tensor gives (the random bits are keyed
    by tensor seed and 8-element group within the tensor, so they do not depend on the launch), and matches
    AdamW's formula in fp32 where no random bits are involved."""
    block = triton_adamw.BLOCK
    sizes = [1, block - 1, block, block + 1, 3 * block + 7, 5]
    gen = torch.Generator().manual_seed(0)

    def groups():
        out = []
        for n in sizes:
            p = torch.randn(n, generator=gen) * 0.02
            m, g = torch.randn(n, generator=gen) * 1e-3, torch.randn(n, generator=gen) * 1e-3
            v = torch.rand(n, generator=gen) * 1e-5
            out.append([t.to(device=KERNEL_DEVICE, dtype=dtype) for t in (p, torch.zeros(n), m, v, g)])
        return out

    together = groups()
    apart = [[t.clone() for t in group] for group in together]
    before = [[t.clone() for t in group] for group in together]
    seeds = [3, 1 << 40, 5, (1 << 62) - 1, 11, 0]
    hp = dict(lr=1e-3, weight_decay=0.1, b1=0.9, b2=0.999, eps=1e-8, step=4)
    triton_adamw.step(together, seeds, **hp)
    for group, seed in zip(apart, seeds):
        triton_adamw.step([group], [seed], **hp)
    for a, b in zip(together, apart):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    if dtype == torch.float32:  # fp32 state: no stochastic rounding, AdamW's formula up to fma rounding
        for (p, c, m, v, g), (p1, c1, m1, v1, _) in zip(before, together):
            m_ref = 0.9 * m + 0.1 * g
            v_ref = 0.999 * v + 0.001 * g * g
            x = p * (1 - 1e-3 * 0.1) - 1e-3 / (1 - 0.9**4) * m_ref / ((v_ref / (1 - 0.999**4)).sqrt() + 1e-8)
            torch.testing.assert_close(m1, m_ref, rtol=1e-5, atol=1e-9)
            torch.testing.assert_close(v1, v_ref, rtol=1e-5, atol=1e-12)
            torch.testing.assert_close(p1.double() + c1.double(), x.double(), rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="one size, dtype and device"):
        triton_adamw.step([[together[0][0], together[1][1], *together[0][2:]]], [1], **hp)


@kernel_runs
def test_kernel_rounds_v_unbiased_with_independent_bits_per_element():
    """The kernel's stochastic rounding of v draws one Philox call per 8 elements: with v landing
    0.3 of a bf16 ulp above a bf16 number (g = 0, v = 1: v' = b2), 30% of elements round up, in
    every position of the 8-element groups, and neighbours (the two halves of one random word, two words of one call,
    two calls) round up independently; a second tensor with another seed draws other bits."""
    n, frac = 1 << 16, 0.3
    low = 1.0 - 2**-8  # the bf16 number below 1
    hp = dict(lr=0.0, weight_decay=0.0, b1=0.9, b2=low + frac * 2**-8, eps=1e-8, step=1)
    groups = [[torch.zeros(n, dtype=torch.bfloat16, device=KERNEL_DEVICE) for _ in range(5)] for _ in range(2)]
    for g in groups:
        g[3].fill_(1.0)
    triton_adamw.step(groups, [12345, 678], **hp)
    ups = [(g[3].float() > low).float().cpu() for g in groups]
    sigma = (frac * (1 - frac) / n) ** 0.5
    for g, up in zip(groups, ups):
        assert set(g[3].float().unique().tolist()) == {low, 1.0}
        assert abs(up.mean().item() - frac) < 5 * sigma
        by_position = up.view(-1, 8).mean(0)
        assert (by_position - frac).abs().max() < 5 * sigma * 8**0.5
        for lag in (1, 2, 8):  # halves of a word, words of a call, calls
            both = (up[:-lag] * up[lag:]).mean().item()
            assert abs(both - frac**2) < 5 * (frac**2 * (1 - frac**2) / n) ** 0.5, lag
    agree = (ups[0] == ups[1]).float().mean().item()
    assert abs(agree - (frac**2 + (1 - frac) ** 2)) < 0.02  # independent seeds: agreement by chance only


def test_stochastic_rounding_is_unbiased():
    lo = torch.tensor(1.0 + 2**-5)  # a bf16 number; its ulp is 2**-7
    gen = torch.Generator().manual_seed(0)
    for sign in (1.0, -1.0):
        for frac in (0.3, 0.001):
            x = sign * (lo + frac * 2**-7)
            draws = stochastic_round(x.expand(1_000_000), gen).float()
            assert set(draws.unique().tolist()) <= {sign * lo.item(), sign * (lo.item() + 2**-7)}
            up = ((draws.abs() > lo).float().mean()).item()
            assert abs(up - frac) < 5 * (frac * (1 - frac) / 1e6) ** 0.5 + 1e-4
            assert abs(draws.double().mean().item() - x.item()) < 3e-5 * 2**-7 / 0.005
    # Values bf16 holds exactly, zeros, inf and NaN (also a NaN whose payload is only in the low
    # 16 bits, which truncation would turn into inf) come through unchanged.
    nan_low = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)
    special = torch.cat([torch.tensor([0.0, -0.0, 1.5, -2.0**-100, float("inf"), -float("inf"), float("nan")]), nan_low])
    out = stochastic_round(special.repeat(1000), gen).float().view(1000, -1)
    assert torch.equal(out[:, :6], special[:6].expand(1000, -1))
    assert torch.signbit(out[:, 1]).all() and out[:, 6:].isnan().all()


@pytest.mark.parametrize("device", DEVICES)
def test_second_moment_tracks_the_fp32_ema_where_round_to_nearest_freezes(device):
    """beta2 0.999, 2000 steps of a slowly varying gradient over four orders of magnitude."""
    steps, n, b2 = 2000, 4096, 0.999
    scale = torch.logspace(-4, 0, n)
    p = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16, device=device))
    opt = CompensatedAdamW([p], lr=0.0, betas=(0.9, b2), weight_decay=0.0)
    exact = torch.zeros(n, dtype=torch.float64)
    nearest = torch.zeros(n, dtype=torch.bfloat16)
    for t in range(steps):
        g = (scale * (1 + 0.5 * torch.sin(torch.tensor(t / 300.0)))).to(torch.bfloat16)
        p.grad = g.to(device)
        opt.step()
        g2 = g.double() ** 2
        exact = b2 * exact + (1 - b2) * g2
        nearest = (b2 * nearest.float() + (1 - b2) * g2.float()).to(torch.bfloat16)
    rel = opt.state[p]["exp_avg_sq"].cpu().double() / exact - 1
    assert rel.mean().abs() < 0.005  # unbiased
    # Each element carries zero-mean noise of a few percent (~3.5% std: rounding noise of about
    # half an ulp a step, summed over the EMA's ~1000-step memory); sqrt(v) halves it.
    assert rel.abs().mean() < 0.04 and rel.abs().quantile(0.99) < 0.15 and rel.abs().max() < 0.25
    rel_nearest = nearest.double() / exact - 1
    assert rel_nearest.mean() < -0.15  # round-to-nearest stalls far below the EMA


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trip_continues_bit_exactly(device):
    grads = _grads(_mlp(), 10)

    def fresh(seed):
        model = _mlp(seed=seed, device=device)
        opt = build_optimizer(model, lr=1e-5, weight_decay=0.1, master_weights="compensated", **ADAM)
        return model, opt, build_scheduler(opt, warmup_steps=4, total_steps=10, schedule="cosine")

    model, opt, sched = fresh(0)
    _run(model, opt, grads, sched)

    half, half_opt, half_sched = fresh(0)
    _run(half, half_opt, grads[:5], half_sched)
    buf = io.BytesIO()
    torch.save({"model": half.state_dict(), "optimizer": half_opt.state_dict(), "scheduler": half_sched.state_dict()}, buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True, map_location="cpu")  # as CheckpointManager does
    assert "sr_generator" in saved["optimizer"]

    def resume(optimizer_state):
        model2, opt2, sched2 = fresh(3)  # other initial weights: everything comes from the checkpoint
        model2.load_state_dict(saved["model"])
        opt2.load_state_dict(optimizer_state)
        sched2.load_state_dict(saved["scheduler"])
        _run(model2, opt2, grads[5:], sched2)
        return model2, opt2

    resumed, resumed_opt = resume(saved["optimizer"])
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), resumed.parameters()):
        for key in ("comp", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[a][key], resumed_opt.state[b][key]), key
        assert opt.state[a]["step"] == resumed_opt.state[b]["step"] == 10
    # The generator state is what makes it exact: without it, stochastic rounding draws other bits.
    other, other_opt = resume({k: v for k, v in saved["optimizer"].items() if k != "sr_generator"})
    assert any(not torch.equal(opt.state[a]["exp_avg_sq"], other_opt.state[b]["exp_avg_sq"]) for a, b in zip(model.parameters(), other.parameters()))


def test_loads_a_master_weight_state_as_weight_plus_compensation():
    model = _mlp()
    master = build_optimizer(model, lr=1e-5, weight_decay=0.0, master_weights="fp32", **ADAM)
    x = torch.randn(8, 64).to(torch.bfloat16)
    for _ in range(5):
        master.zero_grad()
        model(x).float().pow(2).mean().backward()
        master.step()
    state = torch.load(io.BytesIO(_saved(master.state_dict())), weights_only=True)
    other = _mlp(seed=4)
    comp = build_optimizer(other, lr=1e-5, weight_decay=0.0, master_weights="compensated", **ADAM)
    comp.load_state_dict(state)
    params = [p for g in comp.param_groups for p in g["params"]]  # the masters' order
    for p, m in zip(params, master.master_params):
        residual = (m - m.to(torch.bfloat16).float()).abs().max()
        assert residual > 0
        assert (p.float() + comp.state[p]["comp"].float() - m).abs().max() < 0.01 * residual
    _run(other, comp, _grads(other, 2))  # steps on: the moments came across, cast to bf16
    assert all(comp.state[p]["step"] == 7 for p in other.parameters())


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_ten_bytes_per_parameter():
    model = _mlp()
    opt = build_optimizer(model, lr=1e-6, weight_decay=0.0, master_weights="compensated", **ADAM)
    _run(model, opt, _grads(model, 1))
    n = sum(p.numel() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    assert state / n == 6  # m, v and the compensation, bf16 each
    weight_and_grad = sum(p.numel() * p.element_size() + p.grad.numel() * p.grad.element_size() for p in model.parameters())
    assert (weight_and_grad + state) / n == 10
    assert grad_params(model, opt) == list(model.parameters())

    master_model = _mlp()
    master = build_optimizer(master_model, lr=1e-6, weight_decay=0.0, master_weights="fp32", **ADAM)
    (master_model(torch.randn(2, 64).to(torch.bfloat16)).float().sum()).backward()
    master.step()
    held = sum(p.numel() * p.element_size() for p in master_model.parameters())
    held += sum(m.numel() * m.element_size() + m.grad.numel() * m.grad.element_size() for m in master.master_params)
    held += sum(t.numel() * t.element_size() for s in master.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    assert held / n == 18


def test_clip_grad_norm_over_bf16_grads_is_accurate_to_bf16():
    model = _mlp()
    grads = _grads(model, 1)[0]
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    exact = torch.linalg.vector_norm(torch.cat([g.float().flatten() for g in grads]))
    norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1e-3)
    assert abs(norm.float() / exact - 1) < 2**-7  # torch reduces bf16 in fp32, returns bf16
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    assert abs(clipped / 1e-3 - 1) < 0.01


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradients_skip_the_update(bad):
    model = _mlp()
    opt = build_optimizer(model, lr=1e-6, weight_decay=0.0, master_weights="compensated", **ADAM)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 64).to(torch.bfloat16)
    poisoned = x.clone()
    poisoned[0, 0] = bad

    def loss(micro):
        return model(micro).float().pow(2).mean(), {}

    assert optimizer_step(model, opt, [x, poisoned], loss, grad_clip=1.0).skipped
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) and not opt.state
    result = optimizer_step(model, opt, [x, x], loss, grad_clip=1.0)
    assert not result.skipped and result.grad_norm > 0
    assert all(p.grad is None for p in model.parameters())
    assert all(opt.state[p]["step"] == 1 and opt.state[p]["comp"].abs().sum() > 0 for p in model.parameters())


def test_build_optimizer_choices():
    assert type(build_optimizer(_mlp(torch.float32), lr=1e-6, weight_decay=0.0, master_weights="compensated", **ADAM)) is torch.optim.AdamW
    assert type(build_optimizer(_mlp(), lr=1e-6, weight_decay=0.0, master_weights="compensated", **ADAM)) is CompensatedAdamW
    assert type(build_optimizer(_mlp(), lr=1e-6, weight_decay=0.0, **ADAM)) is MasterWeightAdamW
    with pytest.raises(ValueError, match="choose one of fp32, compensated, none"):
        build_optimizer(_mlp(), lr=1e-6, weight_decay=0.0, master_weights="bf16", **ADAM)
    with pytest.raises(ValueError, match="fp16"):
        build_optimizer(_mlp(torch.float16), lr=1e-6, weight_decay=0.0, master_weights="compensated", **ADAM)
    # A model that had MasterWeightAdamW (whose hook takes the gradients) can switch.
    model = _mlp()
    build_optimizer(model, lr=1e-6, weight_decay=0.0, master_weights="fp32", **ADAM)
    opt = build_optimizer(model, lr=1e-6, weight_decay=0.0, master_weights="compensated", **ADAM)
    model(torch.randn(2, 64).to(torch.bfloat16)).float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())
    opt.step()


# ---- config -----------------------------------------------------------------------------------

def _config(*overrides):
    base = ["model.path=m", "data.train_path=d.jsonl", "rollout.n=4", "train.batch_size=16", "train.micro_batch_size=8"]
    return load_config(None, base + list(overrides))


def test_config_master_weights_choices_and_legacy_key(tmp_path):
    assert _config().train.master_weights == "fp32"
    assert _config("train.master_weights=compensated").train.master_weights == "compensated"
    assert _config("train.master_weights=none").train.master_weights == "none"
    for legacy, mapped in (("true", "fp32"), ("false", "none")):
        with pytest.warns(FutureWarning, match=rf"train\.fp32_master_weights is deprecated: use train\.master_weights={mapped}"):
            assert _config(f"train.fp32_master_weights={legacy}").train.master_weights == mapped
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: m}\ndata: {train_path: d.jsonl}\ntrain: {fp32_master_weights: false}\n")
    with pytest.warns(FutureWarning):
        assert load_config(path).train.master_weights == "none"
    with pytest.warns(FutureWarning):
        assert _config("train.fp32_master_weights=true", "train.master_weights=fp32").train.master_weights == "fp32"
    with pytest.raises(ConfigError, match=r"train\.fp32_master_weights=false contradicts train\.master_weights='compensated'"):
        _config("train.fp32_master_weights=false", "train.master_weights=compensated")
    with pytest.raises(ConfigError, match=r"train\.fp32_master_weights must be true or false, got 'yes please'"):
        _config("train.fp32_master_weights=yes please")


def test_config_bad_master_weights_is_one_clear_line():
    with pytest.raises(ConfigError) as info:
        _config("train.master_weights=compensate")
    assert str(info.value) == "train.master_weights is 'compensate' (did you mean 'compensated'?); choose one of fp32, compensated, none"
    with pytest.raises(ConfigError, match=r"train\.master_weights is 'bf16'; choose one of fp32, compensated, none"):
        _config("train.master_weights=bf16")
    with pytest.raises(ConfigError, match="needs a bfloat16 model, but model.dtype is float16"):
        _config("train.master_weights=compensated", "model.dtype=float16")


# ---- end to end -------------------------------------------------------------------------------

def test_grpo_with_compensated_optimizer_trains_and_resumes_bit_exactly(tmp_path, arith_data):
    from transformers import AutoModelForCausalLM

    from hybridrl.cli.commands import build_trainer

    extra = {"model.dtype": "bfloat16", "train.master_weights": "compensated", "train.total_steps": 4, "trainer.eval_every": 0,
             "train.deterministic": True}
    straight = build_trainer(small_config(tmp_path / "a", arith_data, **extra))
    assert isinstance(straight.optimizer, CompensatedAdamW)
    straight.fit()
    initial = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.bfloat16).state_dict()
    trained = {k: v.cpu() for k, v in straight.model.state_dict().items()}
    assert all(t.dtype == torch.bfloat16 and torch.isfinite(t).all() for t in trained.values())
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)
    assert straight.counters["skipped_updates"] == 0

    build_trainer(small_config(tmp_path / "b", arith_data, **{**extra, "train.total_steps": 2})).fit()
    resumed = build_trainer(small_config(tmp_path / "b", arith_data, **extra))  # trainer.resume=auto: step 2
    resumed.fit()
    assert resumed.step == 4
    for name, a in trained.items():
        assert torch.equal(a, resumed.model.state_dict()[name].cpu()), name
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(straight.optimizer.state[a]["comp"], resumed.optimizer.state[b]["comp"])
