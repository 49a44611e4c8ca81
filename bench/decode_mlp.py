"""The decode step's MLP as one Triton kernel against the engine's four kernels, per layer.

    python bench/decode_mlp.py [--size 0.5B] [--rows 256] [--configs all|default]

The engine's decode MLP is the gate|up product (cuBLAS), SiLU * up (Triton), and the down product
(cuBLAS, with its split-K reduce): four launches a layer. `fused_mlp` here does it in one: each
program multiplies a block of rows by a slice of gate and up (the whole hidden size as K), applies
SiLU * up in registers, rounded where HF rounds, multiplies that by the matching slice of down's
columns and adds its share of the output into an fp32 buffer with atomic adds: the activation never
leaves the program, and the down product's split over the intermediate dimension needs no separate
reduce (the sums arrive in no fixed order, so the output is not bit-for-bit reproducible). Both are timed as
the engine runs them: one CUDA graph over every layer's own weights (so the weights come from HBM),
best of several replays; microseconds per layer. The fused kernel is timed with the zeroing of its
output (a memset a layer) and without it (what a consumer that zeroes the buffer as it reads it
would pay). Each configuration's output is first checked against the four-kernel path's.

Measured on one H200 (rollout/native/NOTES.md, session 36): the best fused configuration took 36.57 us
a layer at W0.5B against 22.64 us for the four kernels, 108.49 against 43.30 us at W1.5B; not used.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from decode_gemm import SHAPES  # bench/ is on the path when a bench script runs
from hybridrl.kernels.cublaslt import time_graph_us
from hybridrl.rollout.native.triton_kernels import silu_mul


@triton.jit
def _fused_mlp_kernel(
    x_ptr, gu_ptr, down_ptr, out_ptr, M,
    H: tl.constexpr, I: tl.constexpr,
    BM: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_i = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    row_mask = rows < M
    inter = pid_i * BI + tl.arange(0, BI)
    ks = tl.arange(0, BK)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * H
    # gate|up is [2I, H] row-major (gate rows first): the [BK, BI] tiles of its transpose.
    g_cols = gu_ptr + inter.to(tl.int64)[None, :] * H
    u_cols = gu_ptr + (inter + I).to(tl.int64)[None, :] * H
    acc_g = tl.zeros((BM, BI), dtype=tl.float32)
    acc_u = tl.zeros((BM, BI), dtype=tl.float32)
    for k in range(0, H, BK):
        kk = k + ks
        k_mask = kk < H
        x = tl.load(x_rows + kk[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        wg = tl.load(g_cols + kk[:, None], mask=k_mask[:, None], other=0.0)
        wu = tl.load(u_cols + kk[:, None], mask=k_mask[:, None], other=0.0)
        acc_g = tl.dot(x, wg, acc_g)
        acc_u = tl.dot(x, wu, acc_u)
    dtype = x_ptr.dtype.element_ty
    # As the separate kernels round: gate and up to the model dtype (the product's output), silu(gate)
    # to it (HF), then the product.
    g = acc_g.to(dtype).to(tl.float32)
    u = acc_u.to(dtype).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    a = (act * u).to(dtype)
    # down is [H, I] row-major: the [BI, BN] tiles of its transpose, this program's I-slice.
    d_rows = down_ptr + inter.to(tl.int64)[:, None]
    out_rows = out_ptr + rows.to(tl.int64)[:, None] * H
    ns = tl.arange(0, BN)
    for n in range(0, H, BN):
        nn = n + ns
        n_mask = nn < H
        wd = tl.load(d_rows + nn.to(tl.int64)[None, :] * I, mask=n_mask[None, :], other=0.0)
        part = tl.dot(a, wd)
        tl.atomic_add(out_rows + nn[None, :], part, mask=row_mask[:, None] & n_mask[None, :], sem="relaxed")


def fused_mlp(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, out: torch.Tensor | None = None, *,
    block_m: int = 64, block_i: int = 64, block_k: int = 64, block_n: int = 128, num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:  # fmt: skip
    """Adds down(SiLU(gate) * up) of rows x [M, H] into out [M, H] fp32 (zeros when None) and returns
    it. gate_up is [2I, H] (gate's rows, then up's), down [H, I]; all contiguous, x and the weights
    one dtype (bf16 or fp16: the products run on tensor cores). I must be a multiple of block_i."""
    rows, hidden = x.shape
    inter = down.shape[1]
    assert gate_up.shape == (2 * inter, hidden) and down.shape == (hidden, inter), (gate_up.shape, down.shape)
    assert x.is_contiguous() and gate_up.is_contiguous() and down.is_contiguous()
    assert inter % block_i == 0, f"intermediate size {inter} is not a multiple of block_i={block_i}"
    if out is None:
        out = torch.zeros(rows, hidden, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, block_m), inter // block_i)
    _fused_mlp_kernel[grid](
        x, gate_up, down, out, rows, H=hidden, I=inter, BM=block_m, BI=block_i, BK=block_k, BN=block_n,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


DEFAULT_CONFIGS = [  # block_m, block_i, block_k, block_n, warps, stages
    (64, 64, 64, 128, 4, 3),
    (64, 128, 64, 128, 8, 3),
    (128, 64, 64, 128, 8, 3),
    (64, 64, 128, 128, 4, 2),
]


def all_configs():
    for bm, bi, bk, warps in itertools.product((64, 128), (32, 64, 128), (64, 128), (4, 8)):
        if 2 * bm * bi > 128 * warps * 32:  # the two fp32 accumulators alone past 128 registers a thread
            continue
        yield bm, bi, bk, 128, warps, 3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SHAPES), default="0.5B")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--configs", choices=["default", "all"], default="default")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    hidden, inter, _, _, _, layers, _ = SHAPES[args.size]
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    gate_up = [(torch.randn(2 * inter, hidden, device=dev) * 0.02).to(dt) for _ in range(layers)]
    down = [(torch.randn(hidden, inter, device=dev) * 0.02).to(dt) for _ in range(layers)]
    x = torch.randn(args.rows, hidden, device=dev).to(dt)
    out = torch.zeros(args.rows, hidden, dtype=torch.float32, device=dev)

    def four_kernels(gu: torch.Tensor, d: torch.Tensor) -> torch.Tensor:  # the engine's decode MLP (NativeDecoder._mlp)
        g, u = F.linear(x, gu).split([inter, inter], -1)
        return F.linear(silu_mul(g, u), d)

    def now():
        for gu, d in zip(gate_up, down):
            four_kernels(gu, d)

    base = time_graph_us(now, layers, args.reps)
    zero = time_graph_us(lambda: [out.zero_() for _ in range(layers)], layers, args.reps)
    print(f"{args.size}, {args.rows} rows, us per layer over {layers} layers' own weights")
    print(f"  now (gate|up, silu_mul, down + reduce): {base:.2f}")
    print(f"  zeroing a [{args.rows}, {hidden}] fp32 output: {zero:.2f}")
    ref = four_kernels(gate_up[0], down[0]).float()
    scale = ref.abs().max().item()
    results = []
    configs = DEFAULT_CONFIGS if args.configs == "default" else list(all_configs())
    for bm, bi, bk, bn, warps, stages in configs:
        if inter % bi:
            continue
        kw = dict(block_m=bm, block_i=bi, block_k=bk, block_n=bn, num_warps=warps, num_stages=stages)
        name = f"{bm}/{bi}/{bk}/{bn} {warps}w {stages}s"
        try:
            got = fused_mlp(x, gate_up[0], down[0], torch.zeros_like(out), **kw)
        except Exception as e:  # out of shared memory, registers: skip the configuration
            print(f"  fused {name}: failed ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
            continue
        err = (got - ref).abs().max().item() / scale
        if err > 2e-2:
            print(f"  fused {name}: wrong (relative {err:.2e}), not timed")
            continue

        def fused(kw=kw):
            for gu, d in zip(gate_up, down):
                fused_mlp(x, gu, d, out, **kw)

        def fused_zeroed(kw=kw):
            for gu, d in zip(gate_up, down):
                out.zero_()
                fused_mlp(x, gu, d, out, **kw)

        t = time_graph_us(fused, layers, args.reps)
        tz = time_graph_us(fused_zeroed, layers, args.reps)
        results.append((t, tz, name, err))
        print(f"  fused {name}: {t:.2f} (with zeroing {tz:.2f}), relative difference {err:.2e}", flush=True)
    if results:
        t, tz, name, err = min(results)
        print(f"best fused: {name} {t:.2f} us ({tz:.2f} with zeroing) against {base:.2f} us now: {base - t:+.2f} us a layer")


if __name__ == "__main__":
    main()
