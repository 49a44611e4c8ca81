"""The host-side work at the seams of an RL step, timed on the CPU at the GPU benchmark's shapes.

    python bench/host_seams.py [--repeats 20] [--prompts 32] [--n 8] [--prompt-len 256] [--response-len 512]

While the host runs these the GPU waits: the end of rollout (finished rows into
`GeneratedSequence`s), the batch layout (`make_batch`: `build_sequence_batch`, `pad_per_token`),
and the start of the reference and training passes (`_rows`, `plan_micro_batches`, then per
micro-batch `select`, `pack_sequences`, `micro_batch_work`). Token ids are random (fixed seed);
most responses have the full length, as in the benchmark. The table gives milliseconds per call,
median and best of `--repeats`.

The figures depend on glibc's allocator state: arrays over its mmap threshold (128 KiB at first,
raised as such blocks are freed) come as fresh pages, and the page faults can double a number
from one process to the next (packing a 30k-token micro-batch: 0.8 or 2 ms). For figures that
compare code, fix the thresholds: MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=268435456.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import numpy as np
import torch

from hybridrl.rollout.native.backend import finished_sequences
from hybridrl.rollout.native.scheduler import PromptGroup, RunningSequence
from hybridrl.train.batch import build_sequence_batch, pad_per_token
from hybridrl.train.packing import _rows, micro_batch_work, pack_sequences, plan_micro_batches

VOCAB = 151936
REF_BUDGET, TRAIN_BUDGET = 34816, 13056  # train.max_tokens_per_forward, train.max_tokens_per_micro_batch


def rollout(args, rng: np.random.Generator):
    """Prompt ids (one list per prompt, shared by its samples), response ids and log-probs as Python lists."""
    prompts = [rng.integers(0, VOCAB, args.prompt_len).tolist() for _ in range(args.prompts)]
    B = args.prompts * args.n
    full = rng.random(B) < 0.9  # most responses reach max_tokens
    lengths = np.where(full, args.response_len, rng.integers(1, args.response_len, B))
    responses = [rng.integers(0, VOCAB, n).tolist() for n in lengths]
    logprobs = [(-rng.random(n, dtype=np.float32) * 5).tolist() for n in lengths]
    return [prompts[b // args.n] for b in range(B)], responses, logprobs


def timed(fn, repeats: int) -> tuple[float, float]:
    """(median, best) milliseconds per call of `fn`, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    prompt_ids, response_ids, response_logprobs = rollout(args, rng)
    B = len(prompt_ids)

    # The finished block as the native engine copies it off the device: [F, max_gen + 1].
    tokens = torch.from_numpy(rng.integers(0, VOCAB, (B, args.response_len + 1)))
    logprobs = torch.from_numpy(-rng.random((B, args.response_len + 1), dtype=np.float32))
    lengths = [len(r) for r in response_ids]
    groups = [PromptGroup(i, prompt_ids[i * args.n], args.response_len, args.n) for i in range(args.prompts)]
    seqs = [RunningSequence(groups[b // args.n], b % args.n, b) for b in range(B)]

    batch = build_sequence_batch(prompt_ids, response_ids, pad_id=0)
    T = batch.response_mask.shape[1]
    batch = replace(batch, packed=True)
    batch["rollout_logprobs"] = pad_per_token(response_logprobs, T)
    batch["group_ids"] = torch.arange(B) // args.n
    for key in ("ref_logprobs", "advantages", "returns"):  # what the training passes also carry
        batch[key] = torch.randn(B, T)
    batch["scores"] = torch.randn(B)
    plans = {budget: plan_micro_batches(batch, micro_batch_size=4, max_tokens=budget) for budget in (REF_BUDGET, TRAIN_BUDGET)}

    def micro(plan):
        m = batch.select(plan)
        pack_sequences(m)
        micro_batch_work(m)

    rows = [
        ("finished_sequences (256 rows)", lambda: finished_sequences(seqs, tokens, logprobs, lengths, {0})),
        ("build_sequence_batch", lambda: build_sequence_batch(prompt_ids, response_ids, pad_id=0)),
        ("pad_per_token", lambda: pad_per_token(response_logprobs, T)),
        ("_rows (full batch)", lambda: _rows(batch)),
    ]
    for budget, plan in plans.items():
        rows += [
            (f"plan_micro_batches {budget}", lambda b=budget: plan_micro_batches(batch, micro_batch_size=4, max_tokens=b)),
            (f"  select+pack+work first of {len(plan)}", lambda p=plan: micro(p[0])),
            (f"  select+pack+work all {len(plan)}", lambda p=plan: [micro(x) for x in p]),
        ]
    print(f"{B} sequences ({args.prompts} prompts x {args.n}), prompts {args.prompt_len}, responses <= {args.response_len}, "
          f"{torch.get_num_threads()} torch threads")  # fmt: skip
    print(f"{'':38} {'median ms':>10} {'best ms':>10}")
    for name, fn in rows:
        median, best = timed(fn, args.repeats)
        print(f"{name:38} {median:10.2f} {best:10.2f}")


if __name__ == "__main__":
    main()
