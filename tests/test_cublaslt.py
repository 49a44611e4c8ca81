"""cuBLASLt products with a timed algorithm choice (hybridrl/kernels/cublaslt.py)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from hybridrl.kernels import cublaslt

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_without_cuda_products_are_pytorchs():
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    assert not cublaslt.available()
    tuned = cublaslt.TunedProducts(cache_path=None)
    w = [torch.randn(6, 8) for _ in range(2)]
    tuned.tune(4, w, [torch.randn(6) for _ in range(2)])  # nothing to time: a no-op
    x, b = torch.randn(4, 8), torch.randn(6)
    assert torch.equal(tuned.linear(x, w[0], b), F.linear(x, w[0], b))
    with pytest.raises(cublaslt.CublasLtError, match="not available"):
        cublaslt.LtProduct(4, 6, 8, torch.bfloat16, bias=False)


def test_choice_cache_is_written_atomically_and_survives_a_corrupt_file(tmp_path):
    path = str(tmp_path / "sub" / "cublaslt.json")
    cublaslt._save_cache(path, "a", {"choice": None, "torch_us": 1.0})
    cublaslt._save_cache(path, "b", {"choice": {"sm_target": 0, "algo": [1] * 8}, "torch_us": 2.0})
    data = cublaslt._load_cache(path)
    assert set(data) == {"a", "b"} and data["b"]["choice"]["algo"] == [1] * 8
    assert not [p for p in (tmp_path / "sub").iterdir() if p.suffix == ".tmp"]
    (tmp_path / "sub" / "cublaslt.json").write_text("{not json")
    assert cublaslt._load_cache(path) == {}  # unreadable: timed again, then rewritten
    cublaslt._save_cache(path, "c", {"choice": None})
    assert json.loads((tmp_path / "sub" / "cublaslt.json").read_text()) == {"c": {"choice": None}}


def test_cache_path_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDRL_CUBLASLT_CACHE", "off")
    assert cublaslt._cache_path() is None
    monkeypatch.setenv("HYBRIDRL_CUBLASLT_CACHE", str(tmp_path / "x.json"))
    assert cublaslt._cache_path() == str(tmp_path / "x.json")
    monkeypatch.delenv("HYBRIDRL_CUBLASLT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cublaslt._cache_path() == str(tmp_path / "hybridrl" / "cublaslt.json")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,bias", [(256, 1152, 896, True), (256, 896, 4864, False), (24, 1000, 256, False), (256, 9728, 896, False)])
def test_every_candidate_computes_the_product(m, n, k, bias):
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    product = cublaslt.LtProduct(m, n, k, torch.bfloat16, bias=bias, sm_targets=(0, 120))
    assert product.candidates
    for cand in product.candidates:
        got = product(x, w, b, candidate=cand).float()
        torch.cuda.synchronize()
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-2, (cand.describe(), err)
    with pytest.raises(cublaslt.CublasLtError, match="called with"):
        product(x[:, :-8].contiguous(), w, b)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", [False, True])
def test_split_k_variants_compute_the_product(accumulate):
    """Each heuristic answer's split-K / reduction / swizzle variants that cuBLASLt accepts compute
    the same product (in-place reductions and beta = 1 included); none is PyTorch's pick."""
    torch.manual_seed(0)
    m, n, k = 256, 896, 4864
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    plain = cublaslt.LtProduct(m, n, k, torch.bfloat16, bias=False, max_candidates=4, accumulate=accumulate)
    product = cublaslt.LtProduct(m, n, k, torch.bfloat16, bias=False, max_candidates=4, accumulate=accumulate, variants=True)
    variants = [c for c in product.candidates if c.variant]
    assert variants and len(product.candidates) == len(plain.candidates) + len(variants)
    assert not any(c.is_pytorch_pick for c in variants) and product.candidates[0].is_pytorch_pick
    splits = {c.config.get("splitk") for c in variants}
    assert len(splits) > 1, splits
    start = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ w.float().t() + (start.float() if accumulate else 0)
    for cand in variants:
        out = start.clone()
        got = product(x, w, out=out, candidate=cand).float()
        torch.cuda.synchronize()
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-2, (cand.describe(), err)


@gpu
@pytest.mark.gpu
def test_tuned_choice_is_saved_and_reloaded_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    ws = [torch.randn(896, 4864, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(4)]
    x = torch.randn(256, 4864, device="cuda", dtype=torch.bfloat16)
    path = str(tmp_path / "c.json")
    cublaslt._CHOICES.clear()
    first = cublaslt.TunedProducts(cache_path=path)
    first.tune(256, ws)
    (key, report), = first.report.items()
    assert "torch_us" in report and "best_us" in report, report
    out1 = first.linear(x, ws[1])
    saved = json.loads(open(path).read())
    assert len(saved) == 1
    cublaslt._CHOICES.clear()  # a new process: the choice comes from the file, not from timing
    second = cublaslt.TunedProducts(cache_path=path)
    second.tune(256, ws)
    assert second.report[key]["choice"].endswith("(saved)") or second.report[key]["choice"].startswith("PyTorch")
    assert torch.equal(second.linear(x, ws[1]), out1)
    assert (second.linear(x, ws[1]).float() - F.linear(x, ws[1]).float()).abs().max() < 0.05
    cublaslt._CHOICES.clear()


@gpu
@pytest.mark.gpu
def test_kept_products_hold_only_the_workspace_their_algorithm_needs(tmp_path):
    """Tuning on a stream PyTorch has not multiplied on yet (as the engine tunes on its capture
    stream) leaves only the kept algorithm's workspace: no timing workspace, and no cuBLAS
    workspace of PyTorch's for that stream (32 MiB, which PyTorch would keep for the process)."""
    torch.manual_seed(0)
    ws = [torch.randn(896, 4864, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2)]
    cublaslt._CHOICES.clear()
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")  # the default stream's cuBLAS workspace, as training has it
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    tuned = cublaslt.TunedProducts(cache_path=str(tmp_path / "c.json"))
    with torch.cuda.stream(torch.cuda.Stream()):
        tuned.tune(256, ws)
    torch.cuda.synchronize()
    assert not cublaslt._scratch  # the 32 MiB timing workspace is gone
    product = cublaslt._CHOICES[tuned._key(256, ws[0], False)]
    need = 0 if product is None else product.algo.workspace
    assert torch.cuda.memory_allocated() - before <= need + (1 << 20)
    cublaslt._CHOICES.clear()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("x_t,w_t", [(False, False), (True, False)])
def test_backward_layouts_compute_the_product(x_t, w_t):
    """dx = dy @ w (w as stored) and dw = dy.T @ x (dy transposed): every candidate equals PyTorch's."""
    torch.manual_seed(0)
    m, n, k = 384, 896, 1152
    x = torch.randn(*((k, m) if x_t else (m, k)), device="cuda", dtype=torch.bfloat16)
    w = torch.randn(*((n, k) if w_t else (k, n)), device="cuda", dtype=torch.bfloat16) * 0.05
    product = cublaslt.LtProduct(m, n, k, torch.bfloat16, bias=False, x_transposed=x_t, w_transposed=w_t)
    ref = (x.t() if x_t else x).float() @ (w.t() if w_t else w).float()
    assert torch.allclose(product.reference(x, w), ref)
    for cand in product.candidates:
        got = product(x, w, candidate=cand).float()
        assert (got - ref).abs().max().item() / ref.abs().max().item() < 1e-2, cand.describe()


@gpu
@pytest.mark.gpu
def test_accumulating_product_adds_to_its_output():
    """accumulate=True: out += dy.T @ x in the product's epilogue (the lm_head's weight gradient)."""
    torch.manual_seed(0)
    m, n, k = 2048, 896, 1024
    dy = torch.randn(k, m, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * 0.05
    start = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    product = cublaslt.LtProduct(m, n, k, torch.bfloat16, bias=False, x_transposed=True, w_transposed=False, accumulate=True)
    with pytest.raises(cublaslt.CublasLtError, match="give it"):
        product(dy, x)
    want = start.float() + dy.float().t() @ x.float()
    for cand in product.candidates:
        out = start.clone()
        got = product(dy, x, out=out, candidate=cand)
        assert got.data_ptr() == out.data_ptr()
        assert (got.float() - want).abs().max().item() / want.abs().max().item() < 1e-2, cand.describe()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", [False, True])
def test_tune_product_keeps_a_choice_that_reproduces_pytorch_and_reloads_it(tmp_path, accumulate):
    torch.manual_seed(0)
    m, n, k = 1024, 8192, 896
    layout = dict(x_transposed=accumulate, w_transposed=not accumulate, accumulate=accumulate)
    path = str(tmp_path / "c.json")
    key = cublaslt._product_key(m, n, k, torch.bfloat16, torch.cuda.current_device(), variants=False, **layout)
    cublaslt._CHOICES.pop(key, None), cublaslt._REPORTS.pop(key, None)
    report = cublaslt.tune_product(m, n, k, torch.bfloat16, cache_path=path, **layout)
    assert "torch_us" in report and "best_us" in report and not cublaslt._scratch, report
    assert cublaslt.tune_product(m, n, k, torch.bfloat16, cache_path=path, **layout) is report  # once per process
    product = cublaslt.tuned_product(m, n, k, torch.bfloat16, **layout)
    assert (product is None) == (report["choice"] == "PyTorch's")
    x = torch.randn(*((k, m) if accumulate else (m, k)), device="cuda", dtype=torch.bfloat16)
    w = torch.randn(*((k, n) if accumulate else (n, k)), device="cuda", dtype=torch.bfloat16) * 0.05
    a, b = (x.t() if accumulate else x), (w if accumulate else w.t())
    start = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) if accumulate else torch.zeros(m, n, device="cuda", dtype=torch.bfloat16)
    want = start.clone().addmm_(a, b) if accumulate else a @ b
    if product is not None:
        got = product(x, w, out=start.clone())
        assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()
    saved = json.loads(open(path).read())
    assert len(saved) == 1 and next(iter(saved.values()))["torch_us"] == report["torch_us"]
    cublaslt._CHOICES.pop(key, None), cublaslt._REPORTS.pop(key, None)  # a new process: loaded, not timed
    again = cublaslt.tune_product(m, n, k, torch.bfloat16, cache_path=path, **layout)
    assert again["choice"].endswith("(saved)") and again["torch_us"] == report["torch_us"]
    cublaslt._CHOICES.pop(key, None), cublaslt._REPORTS.pop(key, None)
