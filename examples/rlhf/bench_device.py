"""Device figures for the reward engine (issue 6), in one process, on one GPU:

1. a reward model of the Qwen2.5-1.5B shape (random init, bf16) beside a W0.5B policy on the GPU:
   the reward model's peak GPU memory while scoring with `offload=True` (as a share of its weight
   size) and what it leaves allocated between calls; scoring throughput with and without offload;
2. `reward/overlap_ratio` of a ~5 ms/sample function reward scored while the W0.5B policy
   generates with the native backend, per-prompt max_tokens drawn uniformly from 64..512.

    PYTHONPATH=. python examples/rlhf/bench_device.py --out $OUT/bench.json
    .venv/bin/python examples/rlhf/bench_device.py --tiny      # CPU smoke run, seconds

Texts use the tiny model's character tokenizer (one token per character), so lengths in
characters are lengths in tokens; ids beyond it decode to nothing, which no figure depends on.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import traceback
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM, Qwen2ForSequenceClassification

from hybridrl.models.synthetic import random_model
from hybridrl.reward import RewardEngine
from hybridrl.reward.model import RewardModel
from hybridrl.rollout import RolloutEngine

TOKENIZER = Path(__file__).resolve().parents[2] / "hybridrl" / "assets" / "tiny-arith"


def build(cls, shape: str, device: str, **extra):
    """A random-init model of a benchmark shape ("W0.5B" is BENCHMARK.md's name for "0.5B"); the
    tiny shape gets a third layer here, so the offload has layers to stream."""
    if shape == "tiny":
        extra = {"num_hidden_layers": 3, **extra}
    return random_model(shape.removeprefix("W"), device, cls=cls, pad_token_id=0, **extra)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def texts(num: int, rng: random.Random, lo: int, hi: int) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz0123456789 +-=*"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(lo, hi))) for _ in range(num)]


def time_scoring(rm: RewardModel, prompts, responses, device: str) -> dict:
    rm(prompts[:8], responses[:8])  # warm-up: kernels, allocator
    sync(device)
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    scores = rm(prompts, responses)
    sync(device)
    elapsed = time.perf_counter() - start
    out = {"samples": len(prompts), "time_s": elapsed, "samples_per_s": len(prompts) / elapsed, "scores": scores}
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
        weights = rm.runner.weight_bytes
        out |= {"weight_gib": weights / 2**30, "peak_gib": peak / 2**30, "peak_over_weights": peak / weights,
                "left_between_calls_bytes": torch.cuda.memory_allocated() - base}
    return out


def reward_model_figures(args, device: str, tokenizer, report) -> None:
    rng = random.Random(0)
    prompts = texts(args.samples, rng, 64, 256)
    responses = texts(args.samples, rng, 32, 512)
    model = build(Qwen2ForSequenceClassification, args.rm_shape, device, num_labels=1).to("cpu")
    offloaded = RewardModel(model, tokenizer, offload=True, device=device, max_batch_tokens=args.batch_tokens,
                            max_wave_tokens=args.wave_tokens)
    report["offload"] = time_scoring(offloaded, prompts, responses, device)
    resident = RewardModel(model, tokenizer, offload=False, device=device, max_batch_tokens=args.batch_tokens)
    report["resident"] = time_scoring(resident, prompts, responses, device)
    a, b = report["offload"].pop("scores"), report["resident"].pop("scores")
    report["offload_vs_resident_max_abs_diff"] = max(abs(x - y) for x, y in zip(a, b))
    resident.runner.model.to("cpu")
    del offloaded, resident, model


def overlap_figures(args, device: str, tokenizer, report) -> None:
    policy = build(Qwen2ForCausalLM, args.policy_shape, device)
    engine = RolloutEngine(policy, tokenizer, backend="native")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 100) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    limits = [rng.randint(args.min_tokens, args.max_tokens) for _ in prompts]

    def five_ms(prompts, responses):
        time.sleep(args.reward_ms / 1000)
        return [0.0] * len(responses)

    reward = RewardEngine.from_fn(five_ms, num_workers=args.workers)
    for attempt in ("warm-up", "measured"):  # the first call compiles kernels and captures graphs
        scorer = reward.stream(num_workers=args.workers)
        sync(device)
        start = time.perf_counter()
        engine.generate(prompts, n=args.n, max_tokens=limits, temperature=1.0, seed=0,
                        on_finished=lambda s: scorer.submit(s.prompt_index * args.n + s.sample_index, s.prompt,
                                                            s.response, s.response_ids))
        sync(device)
        generate_s = time.perf_counter() - start
        engine.sleep()
        result = scorer.finish(args.prompts * args.n)
        report[f"overlap_{attempt}"] = {"generate_s": generate_s, "samples": args.prompts * args.n,
                                        **{k: result.metrics[k] for k in ("timing/reward", "timing/reward_exposed",
                                                                         "reward/overlap_ratio")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke run)")
    ap.add_argument("--samples", type=int, default=512, help="(prompt, response) pairs scored by the reward model")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--wave-tokens", type=int, default=32768)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--min-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--reward-ms", type=float, default=5.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--skip-overlap", action="store_true")
    ap.add_argument("--out", type=str, default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    args.rm_shape, args.policy_shape = ("tiny", "tiny") if args.tiny else ("1.5B", "W0.5B")
    if args.tiny:
        args.samples, args.prompts, args.min_tokens, args.max_tokens, args.batch_tokens = 32, 8, 4, 24, 512
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "args": vars(args)}

    def save() -> None:
        print(json.dumps(report, indent=1), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))

    def stage(name: str, fn) -> None:  # a failure is reported, and the next stage still runs
        try:
            fn(args, device, tokenizer, report)
        except Exception as e:
            report[f"{name}_error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
        save()

    if device == "cuda":  # the policy sits on the GPU while the reward model scores
        policy = build(Qwen2ForCausalLM, args.policy_shape, device)
        report["policy_gib"] = torch.cuda.memory_allocated() / 2**30
    stage("reward_model", reward_model_figures)
    if device == "cuda":
        del policy
        torch.cuda.empty_cache()
    if not args.skip_overlap:
        stage("overlap", overlap_figures)


if __name__ == "__main__":
    main()
