"""Can the reference pass's products run beside the decode loop? A feasibility probe (W0.5B, one GPU).

    python bench/overlap_probe.py [--size 0.5B] [--sm-targets 0,66,100] [--repeats 2]

The decode step is bound by the fixed latency of ~225 small kernels (rollout/native/NOTES.md), so
most SMs idle through most of it. The reference pass (~0.3 s of a W0.5B step) is large products.
If the two could share the GPU, the reference's time would hide under the rollout's. This probe
measures that without building it: the native engine's W0.5B rollout on one stream, and on a
second stream the reference forward's products at their real shapes (every decoder layer's q|k|v,
o_proj, gate|up and down over the step's ~139k packed tokens, in 13,056-token pieces; attention and
the element-wise kernels, ~30% of the pass, are left out). Printed: each alone, then both at once
(the rollout's own time and the time until both are done), for the products as PyTorch runs them
and through cuBLASLt asked to plan for fewer SMs (`CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET`, which
exists for a stream that shares the GPU). A gain means: together < rollout + products.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from hybridrl.models.synthetic import random_model
from hybridrl.rollout.native import NativeBackend
from hybridrl.rollout.types import GenerationRequest

SHAPES = {"0.5B": (896, 4864, 14, 2, 64, 24), "1.5B": (1536, 8960, 12, 2, 128, 28)}


def side_products(size: str, tokens: int, piece: int, sm_target: int):
    """A function that enqueues the reference forward's products on the current stream."""
    H, I, nh, nkv, hd, L = SHAPES[size]
    dev = torch.device("cuda")
    shapes = [((nh + 2 * nkv) * hd, H), (H, nh * hd), (2 * I, H), (H, I)]
    weights = [[torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for n, k in shapes] for _ in range(L)]
    pieces = [piece] * (tokens // piece) + ([tokens % piece] if tokens % piece else [])
    xs = {k: torch.randn(max(pieces), k, device=dev, dtype=torch.bfloat16) for k in {k for _, k in shapes}}
    outs = {n: torch.empty(max(pieces), n, device=dev, dtype=torch.bfloat16) for n in {n for n, _ in shapes}}
    products = {}
    if sm_target:
        from hybridrl.kernels.cublaslt import LtProduct

        for rows in set(pieces):
            for n, k in shapes:
                products[rows, n, k] = LtProduct(rows, n, k, torch.bfloat16, bias=False, sm_targets=(sm_target,))

    def run():
        for rows in pieces:
            for layer in weights:
                for w in layer:
                    n, k = w.shape
                    x, out = xs[k][:rows], outs[n][:rows]
                    if sm_target:
                        products[rows, n, k](x, w, out=out)
                    else:
                        torch.mm(x, w.t(), out=out)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SHAPES), default="0.5B")
    ap.add_argument("--sm-targets", default="0,66,100", help="0: PyTorch's products; N: cuBLASLt planning for N SMs")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32 * 256 + 256 * 512, help="packed tokens of the reference pass")
    ap.add_argument("--piece", type=int, default=13056)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "a GPU probe"
    model = random_model(args.size, "cuda")
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (32, 256), generator=g).tolist()
    request = GenerationRequest(prompts, n=8, max_tokens=[512] * 32, temperature=1.0, seed=0, stop_token_ids=[])
    backend = NativeBackend(model, max_num_seqs=256)
    backend.generate(request)  # compiles, tunes, captures
    side_stream = torch.cuda.Stream()

    def timed_rollout() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        backend.generate(request)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for target in (int(t) for t in args.sm_targets.split(",")):
        run = side_products(args.size, args.tokens, args.piece, target)
        with torch.cuda.stream(side_stream):
            run()  # warm-up: cuBLAS handles, workspaces
        torch.cuda.synchronize()
        label = "PyTorch's products" if target == 0 else f"cuBLASLt planned for {target} SMs"
        for _ in range(args.repeats):
            alone = timed_rollout()  # ends synchronized
            t0 = time.perf_counter()
            with torch.cuda.stream(side_stream):
                run()
            torch.cuda.synchronize()
            side = time.perf_counter() - t0
            # Both: the products are enqueued first (the host takes ~10 ms), then the rollout runs.
            done = torch.cuda.Event(enable_timing=True)
            start = torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record(side_stream)
            with torch.cuda.stream(side_stream):
                run()
            done.record(side_stream)
            t1 = time.perf_counter()
            backend.generate(request)
            torch.cuda.current_stream().synchronize()
            rollout_together = time.perf_counter() - t1
            torch.cuda.synchronize()
            both = time.perf_counter() - t0
            side_together = start.elapsed_time(done) / 1e3
            print(f"[{args.size}] {label}: rollout alone {alone:.3f} s, products alone {side:.3f} s, sum {alone + side:.3f} s; "
                  f"together: rollout {rollout_together:.3f} s, products {side_together:.3f} s, both done {both:.3f} s "
                  f"(saves {alone + side - both:+.3f} s)", flush=True)
        del run
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
