"""A decode layer's products with the RMSNorms, SiLU and residual adds folded into them.

    python bench/decode_fusion.py [--size 0.5B] [--rows 256] [--kernels tma-plain,tma,tma-wg,pointer]

The native engine's decode layer is nine kernels (BENCHMARK.md, calibration; rollout/native/NOTES.md):
add + RMSNorm, q|k|v, attention, o_proj, add + RMSNorm, gate|up, SiLU * up, down (+ cuBLAS's
split-K reduce). Each costs a few microseconds of fixed latency at 256 rows. This script times the
products and the small kernels between them (attention left out) two ways, over every layer's own
weights in one CUDA graph:

- now: `add_rms_norm` -> q|k|v (cuBLAS) ; o_proj (cuBLAS) -> `add_rms_norm` -> gate|up (cuBLAS) ->
  `silu_mul` -> down (cuBLAS);
- folded: the residual add goes into the product before it (cuBLAS `addmm`, beta = 1), and the
  RMSNorm into the product after it, which needs no normalised copy: rms_norm(x) @ W.T equals
  rstd * ((x * g) @ W.T), so a Triton kernel sums x * x over the tiles it loads anyway and scales
  its accumulator by rstd at the end; the gate|up kernel applies SiLU * up there too. Four kernels
  instead of eight. The kernel loads its tiles with `tl.load` ("pointer") or TMA ("tma"), and
  multiplies each tile of x by g in registers, or takes W * g folded once per weight update
  ("tma-wg", which leaves x untouched on its way to the MMA). "tma-plain" is the same TMA product
  without the norm: how close a Triton product comes to cuBLAS at these shapes at all.

It prints microseconds per layer for each, the best Triton configurations of each kernel, the
layer both ways with the best folded kernels, and how far the folded outputs are from the present
ones (bf16 rounding happens at other points). Each configuration's output is first checked against
an fp32 reference; one that is off by more than bf16 rounding is reported and not timed (Triton
3.6.0 got some TMA configurations of the W * g gate|up kernel wrong on an H200: 3.3e-2 relative).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from decode_gemm import time_graph  # bench/ is on the path when a bench script runs
from hybridrl.rollout.native.triton_kernels import add_rms_norm, silu_mul

SHAPES = {  # (hidden, intermediate, heads, kv heads, head dim, layers)
    "0.5B": (896, 4864, 14, 2, 64, 24),
    "1.5B": (1536, 8960, 12, 2, 128, 28),
}


@triton.jit
def _bias_swiglu_store(out, up, b_ptr, out_ptr, rm, rn, M, N, stride_o, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr):
    """Both kernels' epilogue: + b, then with SWIGLU silu(gate) * up (gate = `out`), rounded to the
    model dtype where HF rounds; stores the [BM, BN] tile at rows rm, columns rn."""
    n_mask = rn < N
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        gate = out.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
        out = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32) * up
    tl.store(out_ptr + rm[:, None] * stride_o + rn[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & n_mask[None, :])  # fmt: skip


@triton.jit
def _norm_linear_kernel(
    x_ptr, g_ptr, w_ptr, b_ptr, out_ptr, M, N, K, eps,
    stride_x, stride_w, stride_o,
    HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """out = rms_norm(x) * g @ W.T (+ b); with SWIGLU, W holds [gate; up] (2N rows) and out = silu(gate) * up."""
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)  # SWIGLU only (dead code otherwise)
    ss = tl.zeros((BM,), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(x_ptr + rm[:, None] * stride_x + (k + rk)[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32)
        ss += tl.sum(a * a, axis=1)
        g = tl.load(g_ptr + k + rk).to(tl.float32)
        a = (a * g[None, :]).to(w_ptr.dtype.element_ty)
        w = tl.load(w_ptr + rn[None, :] * stride_w + (k + rk)[:, None], mask=n_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc)
        if SWIGLU:
            wu = tl.load(w_ptr + (rn + N)[None, :] * stride_w + (k + rk)[:, None], mask=n_mask[None, :], other=0.0)
            acc_up = tl.dot(a, wu, acc_up)
    rstd = tl.rsqrt(ss / K + eps)[:, None]
    _bias_swiglu_store(acc * rstd, acc_up * rstd, b_ptr, out_ptr, rm, rn, M, N, stride_o, HAS_BIAS, SWIGLU)


@triton.jit
def _norm_linear_tma_kernel(
    x_desc, w_desc, g_ptr, b_ptr, out_ptr, M, N, K, eps, stride_o,
    NORM: tl.constexpr, FOLD_G: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """`_norm_linear_kernel` with both operands loaded by TMA (tensor descriptors). FOLD_G: multiply
    each loaded x tile by g in registers; otherwise W comes with g already folded in (W * g).
    NORM False: a plain product (the Triton baseline against cuBLAS)."""
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    m0 = pid_m * BM
    n0 = pid_n * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)  # SWIGLU only (dead code otherwise)
    ss = tl.zeros((BM,), dtype=tl.float32)
    for k in range(0, K, BK):
        a = x_desc.load([m0, k])
        if NORM:
            af = a.to(tl.float32)
            ss += tl.sum(af * af, axis=1)
            if FOLD_G:
                g = tl.load(g_ptr + k + tl.arange(0, BK)).to(tl.float32)
                a = (af * g[None, :]).to(a.dtype)
        w = w_desc.load([n0, k])
        acc = tl.dot(a, w.T, acc)
        if SWIGLU:
            wu = w_desc.load([n0 + N, k])
            acc_up = tl.dot(a, wu.T, acc_up)
    if NORM:
        rstd = tl.rsqrt(ss / K + eps)[:, None]
        acc = acc * rstd
        acc_up = acc_up * rstd
    rm = m0 + tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    _bias_swiglu_store(acc, acc_up, b_ptr, out_ptr, rm, rn, M, N, stride_o, HAS_BIAS, SWIGLU)


def norm_linear_tma(x, g, w, b, eps, *, swiglu: bool, cfg, norm: bool = True, fold_g: bool = True) -> torch.Tensor:
    """`norm_linear` through TMA loads; with fold_g False, `w` must already be W * g."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    BM, BN, BK, warps, stages = cfg
    M, K = x.shape
    N = w.shape[0] // 2 if swiglu else w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, [BM, BK])
    w_desc = TensorDescriptor.from_tensor(w, [BN, BK])
    grid = (triton.cdiv(N, BN), triton.cdiv(M, BM))
    _norm_linear_tma_kernel[grid](
        x_desc, w_desc, g, b if b is not None else w, out, M, N, K, eps, out.stride(0),
        NORM=norm, FOLD_G=fold_g, HAS_BIAS=b is not None, SWIGLU=swiglu, BM=BM, BN=BN, BK=BK,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def norm_linear(x, g, w, b, eps, *, swiglu: bool, cfg) -> torch.Tensor:
    BM, BN, BK, warps, stages = cfg
    M, K = x.shape
    N = w.shape[0] // 2 if swiglu else w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, BN), triton.cdiv(M, BM))
    _norm_linear_kernel[grid](
        x, g, w, b if b is not None else w, out, M, N, K, eps, x.stride(0), w.stride(0), out.stride(0),
        HAS_BIAS=b is not None, SWIGLU=swiglu, BM=BM, BN=BN, BK=BK, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


CONFIGS = [  # BM, BN, BK, warps, stages
    (m, n, 64, w, s)
    for m, n, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
    if not (m == 128 and n == 128 and w == 4)
]
TMA_CONFIGS = [
    (m, n, 64, w, s)
    for m, n, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (3, 4))
    if not (m == 128 and n == 128 and w == 4)
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SHAPES), default="0.5B")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--kernels", default="tma-plain,tma,tma-wg",
                    help="folded kernels to sweep: pointer (tl.load tiles), tma (TMA, g in registers), tma-wg (TMA, W * g); "
                    "tma-plain times the plain TMA product as a baseline")  # fmt: skip
    args = ap.parse_args(argv)
    H, I, nh, nkv, hd, L = SHAPES[args.size]
    M, eps, dev, dt = args.rows, 1e-6, torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    qkv_n = (nh + 2 * nkv) * hd
    layers = [
        dict(
            qkv=torch.randn(qkv_n, H, device=dev, dtype=dt) * 0.02, qkv_b=torch.randn(qkv_n, device=dev, dtype=dt) * 0.02,
            o=torch.randn(H, nh * hd, device=dev, dtype=dt) * 0.02, gate_up=torch.randn(2 * I, H, device=dev, dtype=dt) * 0.02,
            down=torch.randn(H, I, device=dev, dtype=dt) * 0.02,
            g1=1 + 0.1 * torch.randn(H, device=dev, dtype=dt), g2=1 + 0.1 * torch.randn(H, device=dev, dtype=dt),
        )  # fmt: skip
        for _ in range(L)
    ]
    attn = torch.randn(M, nh * hd, device=dev, dtype=dt)  # stands in for each layer's attention output
    x0 = torch.randn(M, H, device=dev, dtype=dt)

    def now():
        x, res = x0, None
        for lw in layers:
            h, res = add_rms_norm(x, res, lw["g1"], eps)
            F.linear(h, lw["qkv"], lw["qkv_b"])  # q|k|v (the attention that reads it is left out)
            x = F.linear(attn, lw["o"])
            h, res = add_rms_norm(x, res, lw["g2"], eps)
            gate, up = F.linear(h, lw["gate_up"]).split([I, I], -1)
            act = silu_mul(gate, up)
            x = F.linear(act, lw["down"])
        return x, res

    # Each layer's weights with its RMSNorm gain folded in (W * g), for the kernels that take them so.
    for lw in layers:
        lw["qkv_g"] = (lw["qkv"].float() * lw["g1"].float()).to(dt)
        lw["gate_up_g"] = (lw["gate_up"].float() * lw["g2"].float()).to(dt)
    x_in = torch.randn(M, H, device=dev, dtype=dt)

    def qkv_kernel(kind, cfg):
        """kind: "pointer" (tl.load tiles, g in registers), "tma" (g in registers), "tma-wg" (W * g), "tma-plain" (no norm)."""
        if kind == "pointer":
            return lambda x, lw: norm_linear(x, lw["g1"], lw["qkv"], lw["qkv_b"], eps, swiglu=False, cfg=cfg)
        w = "qkv_g" if kind == "tma-wg" else "qkv"
        return lambda x, lw: norm_linear_tma(x, lw["g1"], lw[w], lw["qkv_b"], eps, swiglu=False, cfg=cfg,
                                             norm=kind != "tma-plain", fold_g=kind == "tma")  # fmt: skip

    def mlp_kernel(kind, cfg):
        if kind == "pointer":
            return lambda x, lw: norm_linear(x, lw["g2"], lw["gate_up"], None, eps, swiglu=True, cfg=cfg)
        w = "gate_up_g" if kind == "tma-wg" else "gate_up"
        return lambda x, lw: norm_linear_tma(x, lw["g2"], lw[w], None, eps, swiglu=kind != "tma-plain", cfg=cfg,
                                             norm=kind != "tma-plain", fold_g=kind == "tma")  # fmt: skip

    # fp32 references on layer 0 (no intermediate rounding): a configuration whose output is further
    # from them than bf16 rounding explains is reported and left out of the timings.
    lw0 = layers[0]
    xf = x_in.float()
    normed = lambda g: xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * g.float()  # noqa: E731
    qkv_plain_ref = xf @ lw0["qkv"].float().T + lw0["qkv_b"].float()
    qkv_ref = normed(lw0["g1"]) @ lw0["qkv"].float().T + lw0["qkv_b"].float()
    gu_plain_ref = xf @ lw0["gate_up"].float().T
    gate_ref, up_ref = (normed(lw0["g2"]) @ lw0["gate_up"].float().T).split([I, I], -1)
    act_ref = F.silu(gate_ref) * up_ref
    MAX_REL = 1e-2  # bf16 rounding puts these at 2-5e-3

    def sweep(make, kind, configs, name):
        ref = {("q|k|v", True): qkv_plain_ref, ("q|k|v", False): qkv_ref,
               ("gate|up", True): gu_plain_ref, ("gate|up", False): act_ref}[name, kind == "tma-plain"]  # fmt: skip
        results = []
        for cfg in configs:
            fn = make(kind, cfg)
            try:
                out = fn(x_in, lw0).float()
                err = ((out - ref).norm() / ref.norm()).item()
                if not err < MAX_REL:
                    print(f"  {name} {kind} {cfg}: wrong output (relative difference {err:.2e}), not timed")
                    continue
                us = time_graph(lambda: [fn(x_in, lw) for lw in layers]) * 1e3 / L
            except Exception as e:  # out of shared memory / registers, or a TMA block the shape does not allow
                print(f"  {name} {kind} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
                continue
            results.append((us, cfg))
        results.sort()
        return results

    kinds = [k for k in args.kernels.split(",") if k]
    print(f"[{args.size}] rows {M}; us per layer, each layer's own weights in one CUDA graph; configs (BM, BN, BK, warps, stages)")
    best = {}
    for name, make in (("q|k|v", qkv_kernel), ("gate|up", mlp_kernel)):
        for kind in kinds:
            res = sweep(make, kind, CONFIGS if kind == "pointer" else TMA_CONFIGS, name)
            what = {"pointer": "norm folded, tl.load tiles", "tma": "norm folded, TMA, g in registers",
                    "tma-wg": "norm folded, TMA, W * g", "tma-plain": "plain product, TMA"}[kind]  # fmt: skip
            if name == "gate|up" and kind != "tma-plain":
                what += ", SiLU * up"
            print(f"{name} ({what}), best: " + ", ".join(f"{c} {u:.2f}" for u, c in res[:3]))
            if res and kind != "tma-plain":
                best[name] = min(best.get(name, (float("inf"), None, None)), (res[0][0], kind, res[0][1]), key=lambda t: t[0])

    h_in = torch.randn(M, H, device=dev, dtype=dt)
    res_in = torch.randn(M, H, device=dev, dtype=dt)
    gate_up_out = F.linear(h_in, layers[0]["gate_up"])
    parts = {
        "add_rms_norm": lambda: [add_rms_norm(h_in, res_in, lw["g1"], eps) for lw in layers],
        "q|k|v (cuBLAS, bias)": lambda: [F.linear(h_in, lw["qkv"], lw["qkv_b"]) for lw in layers],
        "o_proj (cuBLAS)": lambda: [F.linear(attn, lw["o"]) for lw in layers],
        "o_proj + residual (cuBLAS addmm)": lambda: [torch.addmm(res_in, attn, lw["o"].t()) for lw in layers],
        "gate|up (cuBLAS)": lambda: [F.linear(h_in, lw["gate_up"]) for lw in layers],
        "silu_mul": lambda: [silu_mul(*gate_up_out.split([I, I], -1)) for _ in layers],
        "down (cuBLAS)": lambda: [F.linear(attn.new_empty(M, I), lw["down"]) for lw in layers],
        "down + residual (cuBLAS addmm)": lambda: [torch.addmm(res_in, attn.new_empty(M, I), lw["down"].t()) for lw in layers],
    }
    print("| kernel | us per layer |\n| --- | --- |")
    for name, fn in parts.items():
        print(f"| {name} | {time_graph(fn) * 1e3 / L:.2f} |")
    if "q|k|v" not in best or "gate|up" not in best:
        return
    (_, kq, cq), (_, km, cm) = best["q|k|v"], best["gate|up"]
    fq, fm = qkv_kernel(kq, cq), mlp_kernel(km, cm)

    def folded():
        x = x0.clone()
        for lw in layers:
            fq(x, lw)
            x = torch.addmm(x, attn, lw["o"].t())
            act = fm(x, lw)
            x = torch.addmm(x, act, lw["down"].t())
        return x

    t_now = time_graph(now) * 1e3 / L
    t_folded = time_graph(folded) * 1e3 / L
    t_now2 = time_graph(now) * 1e3 / L
    print(f"layer without attention: now {t_now:.2f} / {t_now2:.2f} us, folded ({kq} {cq}, {km} {cm}) {t_folded:.2f} us "
          f"({(t_now + t_now2) / 2 - t_folded:.2f} us a layer saved, x {L} layers)")  # fmt: skip

    # How far apart the two are: one layer from the same input (the residual stream then diverges in rounding).
    lw = layers[0]
    h, _ = add_rms_norm(x_in, None, lw["g1"], eps)
    ref_qkv = F.linear(h, lw["qkv"], lw["qkv_b"]).float()
    h2, _ = add_rms_norm(x_in, None, lw["g2"], eps)
    gate, up = F.linear(h2, lw["gate_up"]).split([I, I], -1)
    ref_act = silu_mul(gate, up).float()
    for name, a, b in (("q|k|v", ref_qkv, fq(x_in, lw).float()), ("silu(gate)*up", ref_act, fm(x_in, lw).float())):
        rel = ((a - b).norm() / a.norm()).item()
        print(f"{name}: max |diff| {(a - b).abs().max().item():.3e}, relative {rel:.3e} (bf16 eps 3.9e-3)")


if __name__ == "__main__":
    main()
