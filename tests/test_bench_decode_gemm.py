"""bench/decode_gemm.py's float8 helpers (the timing needs a GPU; the products' layout and scales do not)."""

from __future__ import annotations

import pytest
import torch

from conftest import bench_script


@pytest.mark.parametrize("m, n, k", [(256, 1152, 896), (8, 896, 4864)])
def test_fp8_product_matches_the_fp32_product_within_e4m3_rounding(m, n, k):
    decode_gemm = bench_script("decode_gemm")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    # rows of very different magnitude: per-row scales must follow each row, not the whole tensor
    w = (torch.randn(n, k, generator=g) * torch.logspace(-6, 0, n).unsqueeze(1)).to(torch.bfloat16)
    xq, sx = decode_gemm.quantize_rows(x)
    wq, sw = decode_gemm.quantize_rows(w)
    assert xq.dtype == wq.dtype == torch.float8_e4m3fn
    assert sx.shape == (m, 1) and sw.shape == (n, 1) and sx.dtype == sw.dtype == torch.float32
    assert xq.float().abs().amax() == decode_gemm.E4M3_MAX  # the largest entry lands on e4m3's top
    y = decode_gemm.fp8_linear(xq, sx, wq, sw)
    ref = x.float() @ w.float().t()
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    # e4m3 keeps 3 mantissa bits: ~2-5% of the output's norm, per column too (each weight row its own scale)
    assert decode_gemm.relative_error(y, ref) < 0.06
    small = slice(0, n // 8)  # the weight rows ~1e-6 of the largest: a tensor-wide scale would flush them
    assert decode_gemm.relative_error(y[:, small], ref[:, small]) < 0.06
    # the check above can fail: one scale for the whole weight leaves its small rows in e4m3's subnormals
    sw_all = w.float().abs().amax() / decode_gemm.E4M3_MAX
    wq_all = (w.float() / sw_all).to(torch.float8_e4m3fn)
    y_all = decode_gemm.fp8_linear(xq, sx, wq_all, sw_all.expand(n, 1).contiguous())
    assert decode_gemm.relative_error(y_all[:, small], ref[:, small]) > 0.1
    with pytest.raises(ValueError, match="scal"):  # the weights' scales given for the rows: refused, not misapplied
        decode_gemm.fp8_linear(xq, sw, wq, sx)


def test_the_quantization_of_zero_rows_stays_finite():
    decode_gemm = bench_script("decode_gemm")
    q, s = decode_gemm.quantize_rows(torch.zeros(4, 64, dtype=torch.bfloat16))
    assert torch.isfinite(s).all() and (q.float() == 0).all()


def test_every_table_times_the_decode_steps_products_at_their_model_shapes():
    decode_gemm = bench_script("decode_gemm")
    assert decode_gemm.decode_products("0.5B") == {  # Qwen2.5-0.5B: q|k|v 14 + 2 x 2 heads of 64, gate|up 2 x 4864
        "qkv": (1152, 896, 24), "o_proj": (896, 896, 24), "gate_up": (9728, 896, 24), "down": (896, 4864, 24),
        "lm_head": (151936, 896, 1)}
    assert decode_gemm.decode_products("1.5B")["qkv"] == (2048, 1536, 28)  # 12 + 2 x 2 heads of 128
