"""The decode step's matrix products at their real shapes: cuBLAS against inductor's autotuned kernels.

    python bench/decode_gemm.py [--size 0.5B] [--rows 256] [--no-autotune] [--split-k 2,4,8] [--hot]
    python bench/decode_gemm.py --lt 16 [--size 0.5B] [--rows 256] [--lt-sm-targets 0,128] [--lt-variants]
    python bench/decode_gemm.py --fp8 [--size 0.5B] [--rows 256]

One decode step of the native engine multiplies `rows` activations by each layer's fused q|k|v,
o_proj, fused gate|up and down_proj weights, then by the lm_head. Each shape is timed as in the
engine: one CUDA graph replaying the product over every layer's own weight (so the weights stream
from HBM, not L2), best of a few replays; the table gives microseconds per product and the fraction
of the HBM bandwidth its weight bytes would need (the memory floor). `--hot` replays the product
over one weight instead, which then stays in L2: the difference is what reading the weights from
HBM costs each product.

`--lt N` times cuBLASLt's first N heuristic candidates for each product instead (the first is the
one PyTorch runs; hybridrl/kernels/cublaslt.py), q|k|v with its bias as the engine runs it;
`--lt-variants` adds each candidate's other split-K counts, reduction schemes and CTA swizzle.

`--fp8` times the same products with float8 (e4m3) operands through `torch._scaled_mm` (per-row
activation scales, per-output-channel weight scales, bf16 output) against bf16 cuBLAS: once with the
activations already quantized (as a norm or activation kernel that wrote fp8 would leave them), and
once with the activations' quantization (row amax, scale, cast) timed in. It also prints each
product's error against the fp32 product, relative to the output's norm, for bf16 and fp8.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from hybridrl.kernels.cublaslt import time_graph_us

SHAPES = {  # (hidden, intermediate, heads, kv heads, head dim, layers, vocab)
    "0.5B": (896, 4864, 14, 2, 64, 24, 151936),
    "1.5B": (1536, 8960, 12, 2, 128, 28, 151936),
}
HBM_BYTES_PER_S = 4.8e12


def decode_products(size: str) -> dict[str, tuple[int, int, int]]:
    """One decode step's products at `size`: name -> (N, K, how many a step: one per layer, one lm_head)."""
    H, I, nh, nkv, hd, L, V = SHAPES[size]
    return {"qkv": ((nh + 2 * nkv) * hd, H, L), "o_proj": (H, nh * hd, L), "gate_up": (2 * I, H, L), "down": (H, I, L),
            "lm_head": (V, H, 1)}


def time_graph(fn, reps: int = 20) -> float:
    """Milliseconds per replay of a CUDA graph of `fn`, best of `reps` (after warm-up)."""
    return time_graph_us(fn, 1, reps) / 1e3


def split_k_linear(x: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """x @ w.T as k products over K-chunks in one strided-batched call (fp32 outputs), summed in fp32:
    k times as many output tiles for a product whose N x M alone leaves most SMs idle."""
    M, K = x.shape
    N = w.shape[0]
    xs = x.view(M, k, K // k).transpose(0, 1)  # [k, M, K/k]
    ws = w.view(N, k, K // k).permute(1, 2, 0)  # [k, K/k, N]
    return torch.bmm(xs, ws, out_dtype=torch.float32).sum(0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SHAPES), default="0.5B")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--no-autotune", action="store_true", help="cuBLAS only")
    ap.add_argument("--split-k", default="", help="also time split-K products (comma-separated split counts): one "
                    "strided-batched cuBLAS product with fp32 outputs over K-chunks, then their sum")
    ap.add_argument("--hot", action="store_true", help="multiply by one weight per shape (L2-resident after the first product) "
                    "instead of each layer's own")
    ap.add_argument("--blas", choices=["cublas", "cublaslt"], default=None,
                    help="the BLAS library PyTorch's bf16 products go through (torch.backends.cuda.preferred_blas_library); default: PyTorch's")
    ap.add_argument("--fp8", action="store_true", help="time float8 (e4m3) products through torch._scaled_mm instead")
    ap.add_argument("--lt", type=int, default=0, help="time cuBLASLt's first N heuristic candidates per product instead")
    ap.add_argument("--lt-layout", choices=["linear", "dx", "dw"], default="linear",
                    help="with --lt: the forward product (x @ w.T), or the backward's input gradient (dy @ w) or "
                         "weight gradient (dy.T @ x), PyTorch's matmul of the same layout as the baseline")
    ap.add_argument("--lt-variants", action="store_true", help="with --lt: also time each candidate's split-K / reduction / "
                    "swizzle variants (LtProduct(variants=True))")
    ap.add_argument("--lt-sm-targets", default="0", help="with --lt: also ask the heuristic to plan for these SM counts "
                    "(comma-separated; 0 = the device's)")
    args = ap.parse_args(argv)
    if args.fp8:
        return fp8_table(args)
    if args.lt:
        return lt_table(args)
    if args.blas and torch.cuda.is_available():
        torch.backends.cuda.preferred_blas_library(args.blas)
    M = args.rows
    shapes = decode_products(args.size)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    tuned = None
    if not args.no_autotune:
        tuned = torch.compile(lambda x, w: F.linear(x, w), mode="max-autotune-no-cudagraphs", dynamic=False)
    blas = torch.backends.cuda.preferred_blas_library()
    weights = "one weight per shape, L2-resident" if args.hot else "each layer's own weight"
    print(f"[{args.size}] rows {M}, {blas}: microseconds per product ({weights}, in one CUDA graph)")
    splits = [int(k) for k in args.split_k.split(",") if k]
    split_cols = "".join(f" split-K {k} us |" for k in splits)
    print(f"| product | N x K | cuBLAS us | autotuned us |{split_cols} memory floor us |")
    print("| --- | --- | --- | --- |" + " --- |" * len(splits) + " --- |")
    total = [0.0, 0.0, 0.0]
    for name, (N, K, copies) in shapes.items():
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(1 if args.hot else copies)]
        if args.hot:  # one weight for every layer: L2-resident after the first product
            ws *= copies
        out = [None]

        def run(f):
            def fn():
                for w in ws:
                    out[0] = f(x, w)
            return fn

        cublas = time_graph(run(F.linear)) * 1e3 / copies
        auto = None
        if tuned is not None:
            for w in ws[:1]:
                tuned(x, w)  # autotune once per shape
            auto = time_graph(run(tuned)) * 1e3 / copies
        split_us = []
        for k in splits:
            if K % k:
                split_us.append(None)
                continue
            try:
                split_us.append(time_graph(run(lambda x, w, k=k: split_k_linear(x, w, k))) * 1e3 / copies)
            except RuntimeError as e:  # e.g. a torch without bmm's out_dtype
                print(f"split-K {k} on {name}: {e}".splitlines()[0])
                split_us.append(None)
        floor = N * K * 2 / HBM_BYTES_PER_S * 1e6
        total[0] += cublas * copies
        total[1] += (auto if auto is not None else cublas) * copies
        total[2] += floor * copies
        split_txt = "".join(f" {'-' if u is None else f'{u:.2f}'} |" for u in split_us)
        print(f"| {name} | {N} x {K} | {cublas:.2f} | {'-' if auto is None else f'{auto:.2f}'} |{split_txt} {floor:.2f} |")
        del ws
    print(f"| per decode step | | {total[0]:.1f} | {total[1]:.1f} | {total[2]:.1f} |")


E4M3_MAX = 448.0


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, K] as e4m3 with one fp32 scale per row ([R, 1]): t ~= q * scale."""
    scale = t.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref||, y taken in fp32: the error columns of the --fp8 table."""
    return ((y.float() - ref).norm() / ref.norm()).item()


def fp8_linear(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """x @ w.T from row-quantized x [M, K] and w [N, K]: wq.t() is the column-major [K, N] operand
    _scaled_mm wants; the scales are [M, 1] and [1, N]."""
    return torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.t(), out_dtype=torch.bfloat16)


def fp8_table(args) -> None:
    """bf16 cuBLAS against float8 products per decode product, each layer's own weight, in one CUDA graph."""
    M = args.rows
    shapes = decode_products(args.size)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    quant_x = torch.compile(quantize_rows, dynamic=False)
    print(f"[{args.size}] rows {M}: microseconds per product (each layer's own weight, in one CUDA graph); "
          "fp8 = e4m3 through torch._scaled_mm, per-row scales")
    print("| product | N x K | bf16 us | fp8 us (x quantized) | fp8 + x quantization us | bf16 error | fp8 error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    total = [0.0, 0.0, 0.0]
    for name, (N, K, copies) in shapes.items():
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        qs = [quantize_rows(w) for w in ws]
        xq, sx = quantize_rows(x)

        def bf16_fn():
            for w in ws:
                F.linear(x, w)

        def fp8_fn():
            for wq, sw in qs:
                fp8_linear(xq, sx, wq, sw)

        def fp8_quant_fn():
            for wq, sw in qs:
                fp8_linear(*quant_x(x), wq, sw)

        bf16 = time_graph_us(bf16_fn, copies)
        f8 = time_graph_us(fp8_fn, copies)
        f8q = time_graph_us(fp8_quant_fn, copies)
        ref = x.float() @ ws[0].float().t()
        e16, e8 = relative_error(F.linear(x, ws[0]), ref), relative_error(fp8_linear(xq, sx, *qs[0]), ref)
        for i, us in enumerate((bf16, f8, f8q)):
            total[i] += us * copies
        print(f"| {name} | {N} x {K} | {bf16:.2f} | {f8:.2f} | {f8q:.2f} | {e16:.2e} | {e8:.2e} |")
        del ws, qs
    print(f"| per decode step | | {total[0]:.1f} | {total[1]:.1f} | {total[2]:.1f} | | |")


def lt_table(args) -> None:
    """cuBLASLt's candidates per decode product, timed as the engine runs them; the fastest against PyTorch's."""
    from hybridrl.kernels.cublaslt import LtProduct, choose

    M = args.rows
    shapes = decode_products(args.size)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(f"[{args.size}] rows {M}, {args.lt_layout}: microseconds per product, each layer's own weight, in one CUDA graph")
    total_torch = total_best = 0.0
    layout = args.lt_layout
    targets = tuple(int(t) for t in args.lt_sm_targets.split(","))
    for name, (N, K, copies) in shapes.items():
        bs = None
        if layout == "linear":  # y[M, N] = x[M, K] @ w[N, K].T (+ b)
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            bs = [torch.randn(N, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)] if name == "qkv" else None
            op = lambda x, w, i: F.linear(x, w, None if bs is None else bs[i])  # noqa: E731
            product = LtProduct(M, N, K, torch.bfloat16, bias=bs is not None, max_candidates=args.lt,
                                sm_targets=targets, variants=args.lt_variants)
        elif layout == "dx":  # dx[M, K] = dy[M, N] @ w[N, K]
            x = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
            ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            op = lambda x, w, i: x @ w  # noqa: E731
            product = LtProduct(M, K, N, torch.bfloat16, bias=False, max_candidates=args.lt, sm_targets=targets,
                                variants=args.lt_variants, w_transposed=False)
        else:  # dw[N, K] = dy[M, N].T @ x[M, K]
            x = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
            ws = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in range(min(copies, 4))]
            copies = len(ws)
            op = lambda x, w, i: x.t() @ w  # noqa: E731
            product = LtProduct(N, K, M, torch.bfloat16, bias=False, max_candidates=args.lt, sm_targets=targets,
                                variants=args.lt_variants, x_transposed=True, w_transposed=False)

        def torch_fn():
            for i, w in enumerate(ws):
                op(x, w, i)

        base = time_graph_us(torch_fn, copies)
        timed = choose(product, x, ws, bs)
        best_us = timed[0][1]
        first = next((us for c, us in timed if c.is_pytorch_pick), float("nan"))
        total_torch += base * copies
        total_best += min(base, best_us) * copies
        print(f"{name} {N} x {K}: PyTorch {base:.2f} us, candidate #0 {first:.2f} us, best {best_us:.2f} us "
              f"({len(product.candidates)} candidates, {len(timed)} correct)")
        for c, us in timed[:6]:
            print(f"    {us:7.2f} us  {c.describe()}")
        del ws
    print(f"per decode step: PyTorch {total_torch:.1f} us, best candidates {total_best:.1f} us")


if __name__ == "__main__":
    main()
