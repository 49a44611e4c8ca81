"""The native backend's Triton kernels against their PyTorch references (ops_torch, sampling).

Runs on a CUDA GPU, or on CPU under Triton's interpreter (TRITON_INTERPRET=1 with triton
installed); skipped otherwise.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"
else:
    pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

from hybridrl.rollout.native import triton_attention, triton_kernels, triton_sampling  # noqa: E402
from hybridrl.rollout.native.ops_torch import TorchOps  # noqa: E402
from hybridrl.rollout.native.sampling import SamplingParams, sample  # noqa: E402

DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g).to(DEVICE, dtype)
    r = torch.randn(5, 96, generator=g).to(DEVICE, dtype)
    w = torch.randn(96, generator=g).to(DEVICE, dtype)
    ref_out, ref_res = TorchOps().add_rms_norm(x, r.clone(), w, 1e-6)
    out, res = triton_kernels.add_rms_norm(x, r.clone(), w, 1e-6)
    torch.testing.assert_close(res, ref_res, **_tol(dtype))
    torch.testing.assert_close(out, ref_out, **_tol(dtype))
    out0, res0 = triton_kernels.add_rms_norm(x, None, w, 1e-6)
    torch.testing.assert_close(out0, TorchOps().add_rms_norm(x, None, w, 1e-6)[0], **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_rope_write_kv(dtype, qk_norm):
    g = torch.Generator().manual_seed(1)
    batch, hq, hkv, d, bs, nb = 3, 6, 2, 16, 4, 10
    # q, k, v as column slices of one fused q|k|v projection (strided rows), as the decoder has.
    qkv = torch.randn(batch, (hq + 2 * hkv) * d, generator=g).to(DEVICE, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    pos = torch.tensor([0, 5, 11], device=DEVICE)
    ang = torch.rand(32, d // 2, generator=g).to(DEVICE) * 6
    cos, sin = ang.cos(), ang.sin()
    qn = torch.randn(d, generator=g).to(DEVICE, dtype) if qk_norm else None
    kn = torch.randn(d, generator=g).to(DEVICE, dtype) if qk_norm else None
    bt = torch.tensor([[1, 2, 0, 0], [3, 4, 0, 0], [5, 6, 7, 8]], device=DEVICE, dtype=torch.int32)
    caches = [torch.zeros(nb, hkv, bs, d, device=DEVICE, dtype=dtype) for _ in range(4)]
    ref_q = TorchOps().qk_rope_write_kv(q, k, v, pos, cos, sin, qn, kn, 1e-6, caches[0], caches[1], bt)
    out_q = triton_kernels.qk_rope_write_kv(q, k, v, pos, cos, sin, qn, kn, 1e-6, caches[2], caches[3], bt)
    torch.testing.assert_close(out_q, ref_q, **_tol(dtype))
    torch.testing.assert_close(caches[2], caches[0], **_tol(dtype))
    torch.testing.assert_close(caches[3], caches[1], **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_attention(dtype):
    g = torch.Generator().manual_seed(2)
    batch, hq, hkv, d, bs, nb, mb = 4, 14, 2, 64, 16, 40, 9
    q = torch.randn(batch, hq, d, generator=g).to(DEVICE, dtype)
    kc = torch.randn(nb, hkv, bs, d, generator=g).to(DEVICE, dtype)
    vc = torch.randn(nb, hkv, bs, d, generator=g).to(DEVICE, dtype)
    bt = torch.randperm(nb - 1, generator=g)[: batch * mb].view(batch, mb).add(1).to(DEVICE, torch.int32)
    ctx = torch.tensor([1, 17, 64, 140], device=DEVICE)
    ref = TorchOps().decode_attention(q, kc, vc, bt, ctx, d**-0.5)
    for tile, split in ((16, 0), (64, 0), (16, 32), (64, 64)):
        out = triton_attention.paged_decode_attention(q, kc, vc, bt, ctx, d**-0.5, tile=tile, split_tokens=split)
        torch.testing.assert_close(out, ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_on_fused_halves(dtype):
    gate_up = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    gate, up = gate_up.split([1500, 1500], -1)
    torch.testing.assert_close(triton_kernels.silu_mul(gate, up), TorchOps().silu_mul(gate, up), **_tol(dtype))


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_sampling_matches_reference(temperature):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 9000, generator=g) * 3).to(DEVICE)
    keys = torch.tensor([1, 2, 3, 4, 5, 0xFFFFFFFF], device=DEVICE)
    steps = torch.tensor([0, 1, 7, 100, 5, 3], device=DEVICE)
    params = SamplingParams(temperature=temperature)
    ref_tok, ref_lp = sample(logits, keys, steps, params)
    tok, lp = triton_sampling.sample(logits, keys, steps, params)
    assert torch.equal(tok, ref_tok)
    torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=1e-4)
