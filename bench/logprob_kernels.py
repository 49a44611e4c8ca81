"""The log-prob phase's two vocabulary kernels (`hybridrl.train.triton_logprobs`) against HBM bandwidth.

    python bench/logprob_kernels.py [--rows 1024] [--vocab 151936] [--configs 2048:8,4096:8]

The trainer's lm_head (`hybridrl.train.lm_head`) computes the logits of a chunk of tokens, then one
kernel reads them for each row's log-sum-exp, log-prob and entropy (`_stats_kernel`) and, in the
training pass, another overwrites them with their gradient (`_grad_kernel`). At a 152k vocabulary
both are bound by the logits' bytes: this prints microseconds per call for each block:warps config,
the fraction of the HBM floor (bytes moved at 4.8 TB/s), and the largest difference from the PyTorch
reference (`logit_stats_torch`, `logit_grad_torch`).
"""

from __future__ import annotations

import argparse

import torch

from decode_gemm import HBM_BYTES_PER_S  # bench/ is on the path when a bench script runs
from hybridrl.kernels.cublaslt import time_eager_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1024, help="tokens per chunk")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--configs", default="1024:4,2048:8,4096:8,4096:16", help="block:warps, comma-separated")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from hybridrl.train import triton_logprobs as T
    from hybridrl.train.lm_head import logit_grad_torch, logit_stats_torch

    rows, V = args.rows, args.vocab
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(rows, V, device="cuda", generator=g) * 2).to(torch.bfloat16)
    labels = torch.randint(0, V, (rows,), device="cuda", generator=g)
    g_lp, g_ent = torch.randn(rows, device="cuda", generator=g), torch.randn(rows, device="cuda", generator=g)
    ref = logit_stats_torch(logits, labels, 1.0)
    ref_grad = logit_grad_torch(logits, labels, ref[0], ref[2], g_lp, g_ent, 1.0).float()
    out = [torch.empty(rows, device="cuda") for _ in range(3)]
    work = logits.clone()
    read_us = rows * V * logits.element_size() / HBM_BYTES_PER_S * 1e6
    print(f"{rows} rows x {V} {logits.dtype}: HBM floor {read_us:.1f} us (stats: read once), {2 * read_us:.1f} us (grad: read + write)")
    print("| kernel | block:warps | us per call | of the floor | max diff from PyTorch |")
    print("| --- | --- | --- | --- | --- |")
    for config in args.configs.split(","):
        block, warps = (int(v) for v in config.split(":"))

        def stats():
            T._stats_kernel[(rows,)](logits, logits.stride(0), labels, *out, 1.0, V=V, BLOCK=block, num_warps=warps)

        def grad():
            T._grad_kernel[(rows,)](
                work, work.stride(0), labels, ref[0], ref[2], g_lp, g_ent, 1.0, V=V, HAS_LP=True, HAS_ENT=True,
                BLOCK=block, num_warps=warps,
            )  # fmt: skip

        t = time_eager_us(stats, reps=50, rounds=5)
        diff = max((o - r).abs().max().item() for o, r in zip(out, ref))
        print(f"| stats | {config} | {t:.1f} | {read_us / t:.0%} | {diff:.2e} |")
        t = time_eager_us(grad, reps=50, rounds=5)  # overwrites `work` each call: later calls read gradients, same bytes
        work.copy_(logits)
        grad()
        diff = (work.float() - ref_grad).abs().max().item()
        print(f"| grad | {config} | {t:.1f} | {2 * read_us / t:.0%} | {diff:.2e} |")


if __name__ == "__main__":
    main()
