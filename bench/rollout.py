"""Rollout benchmark: the native backend against HF `generate`, in one process (BENCHMARK.md).

    python bench/rollout.py                      # W0.5B on the GPU (32 prompts x 256, n=8, 512 new)
    python bench/rollout.py --size 1.5B          # W1.5B
    python bench/rollout.py --tiny               # a tiny model on CPU, in seconds
    python bench/rollout.py --json out.json      # also write the figures

Random-init model of the workload's shape (seed 42), bf16 on GPU, no stop tokens (every response
runs to max_tokens), temperature 1.0. Prints tokens/s for each backend, their ratio, the fraction
of the decode bound (bytes of weights + KV read per step over HBM bandwidth), and the difference
between the native log-probs and a full forward's.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

from hybridrl.models.synthetic import random_model
from hybridrl.rollout.native import NativeBackend
from hybridrl.rollout.types import GenerationRequest

HBM_BYTES_PER_S = 4.0e12  # measured device-to-device copy on the H200 (KINDS.md: ~4.3 TB/s)
W05B_BOUND_S = 0.35  # BENCHMARK.md's decode bound for W0.5B


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_once(device: str) -> None:
    a = torch.ones(8, 8, device=device, dtype=torch.bfloat16)
    (a @ a).sum().item()


def decode_bound_s(model, num_seqs: int, prompt_len: int, max_tokens: int) -> float:
    """Each decode step reads all weights once and each sequence's KV context once."""
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * model.dtype.itemsize
    mean_context = prompt_len + max_tokens / 2
    return max_tokens * (weight_bytes + num_seqs * mean_context * kv_per_token) / HBM_BYTES_PER_S


@torch.no_grad()
def logprob_diff(model, prompts, outs, limit: int) -> tuple[float, float]:
    """|native log-prob - log_softmax(full forward logits)| over `limit` responses."""
    diffs = []
    for o in outs[:: max(1, len(outs) // limit)][:limit]:
        prompt = prompts[o.prompt_index]
        ids = torch.tensor([prompt + o.response_ids], device=model.device)
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        diffs.append((ref.cpu() - torch.tensor(o.response_logprobs)).abs())
    d = torch.cat(diffs)
    return d.mean().item(), d.max().item()


def run_native(model, request, device, args, tile: int | None = None, warps: int = 4, split: int = 0, cascade: bool = False,
               stages: int | None = None, fused: str = "auto", max_registers: int | None = None, tuned: str = "on") -> dict:  # fmt: skip
    """One engine's rollouts; the attention settings left None / "auto" are the engine's own (TritonOps)."""
    backend = NativeBackend(model, max_num_seqs=max(args.max_num_seqs, len(request.prompt_ids) * request.n),
                            shared_prefix_attention=cascade, shared_prefix_splits=args.prefix_splits,
                            tuned_products=tuned != "off", tuned_product_variants=tuned == "variants")  # fmt: skip
    if device == "cuda":
        backend.decoder.ops.attention_tile = tile
        backend.decoder.ops.attention_warps = warps
        backend.decoder.ops.attention_split = split
        backend.decoder.ops.attention_stages = stages
        if fused != "auto":
            backend.decoder.ops.new_token_in_registers = fused != "staged"
            backend.decoder.ops.prefetch_table = fused == "prefetch"
        backend.decoder.ops.attention_max_registers = max_registers
        torch.cuda.reset_peak_memory_stats()
        matmul_once(device)  # cuBLAS's workspace exists before and after, as in a trainer
        before = torch.cuda.memory_allocated()
    sync(device)
    t0 = time.perf_counter()
    backend.generate(request)  # first call: compiles kernels, captures graphs
    sync(device)
    cold_s = time.perf_counter() - t0
    times, outs = [], None
    for _ in range(args.repeats):
        if args.sleep_between and device == "cuda":  # as in training: the cache and graphs are released between steps
            backend.sleep()
        sync(device)
        t0 = time.perf_counter()
        outs = backend.generate(request)
        sync(device)
        times.append(time.perf_counter() - t0)
    if backend.decoder.products is not None:
        for (rows, n, k, bias, *_), r in backend.decoder.products.report.items():
            print(f"    tuned product {rows} x {n} x {k}{' + bias' if bias else ''}: PyTorch {r['torch_us']:.2f} us, "
                  f"best {r.get('best_us', float('nan')):.2f} us -> {r.get('choice', r.get('error'))}")
    figures = {"tuned_products": tuned, "attn_tile": tile, "attn_warps": warps, "attn_split": split, "attn_stages": stages, "attn_max_registers": max_registers, "fused": fused, "shared_prefix": cascade, "cold_s": cold_s, "time_s": min(times), "times_s": times}
    if cascade:
        figures["prefix_splits"] = args.prefix_splits  # 0: chosen per batch
    figures["tokens"] = sum(len(o.response_ids) for o in outs)
    figures["tokens_per_s"] = figures["tokens"] / figures["time_s"]
    if device == "cuda":
        figures["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        backend.sleep()
        matmul_once(device)
        sync(device)
        after = torch.cuda.memory_allocated()
        figures["mem_before_wake_mib"] = before / 2**20
        figures["mem_after_sleep_mib"] = after / 2**20
        figures["mem_after_sleep_rel"] = (after - before) / before
    figures["logprob_diff_mean"], figures["logprob_diff_max"] = logprob_diff(model, request.prompt_ids, outs, args.logprob_seqs)
    return figures


@torch.no_grad()
def run_hf(model, request, device, max_tokens: int) -> dict:
    ids = torch.tensor(request.prompt_ids, device=device)  # equal lengths: no padding
    kwargs = dict(
        attention_mask=torch.ones_like(ids), do_sample=True, temperature=request.temperature, top_k=0, top_p=1.0,
        num_return_sequences=request.n, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    warm = {"attention_mask": kwargs["attention_mask"][:1], "max_new_tokens": 4, "min_new_tokens": 4, "num_return_sequences": 1}
    model.generate(ids[:1], **{**kwargs, **warm})
    sync(device)
    t0 = time.perf_counter()
    out = model.generate(ids, **kwargs)
    sync(device)
    elapsed = time.perf_counter() - t0
    tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"time_s": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed, "max_tokens": max_tokens}


def sweep_sampler(vocab: int, rows: int) -> None:
    """Median time of the fused sampler for each chunk size / warp count. With temperature, a chunk
    other than sampling.SAMPLE_CHUNK draws other tokens (from the same distribution): only the
    time is compared here."""
    import triton

    from hybridrl.rollout.native import triton_sampling
    from hybridrl.rollout.native.sampling import SamplingParams

    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    keys = torch.arange(rows, device="cuda")
    steps = torch.full((rows,), 7, device="cuda")
    for greedy in (False, True):
        params = SamplingParams(temperature=0.0 if greedy else 1.0)
        for chunk, warps in ((1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 16)):
            ms = triton.testing.do_bench(
                lambda: triton_sampling.sample(logits, keys, steps, params, chunk=chunk, num_warps=warps),
                return_mode="median",
            )  # fmt: skip
            print(f"sampler greedy={greedy} chunk={chunk} warps={warps}: {1000 * ms:.1f} us")


def profile_decode(model, request, max_num_seqs: int) -> None:
    """Kernel times of eager (non-graphed) decode steps: where a step's GPU time goes."""
    backend = NativeBackend(model, cuda_graphs=False, max_num_seqs=max_num_seqs)
    short = GenerationRequest(request.prompt_ids, n=request.n, max_tokens=[48] * len(request.prompt_ids),
                              temperature=1.0, seed=0)  # fmt: skip
    backend.generate(short)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        backend.generate(short)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=["0.5B", "1.5B"], default="0.5B")
    ap.add_argument("--tiny", action="store_true", help="tiny model, CPU-friendly sizes")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--hf-max-tokens", type=int, default=None, help="shorter HF run (its tokens/s barely depends on it)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sleep-between", action="store_true", help="sleep() before each timed run, as a trainer does between steps")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--attn", default="auto",
                    help="attention settings to try, comma-separated: auto (the engine's, by head dim) or "
                         "tile:warps:split_tokens[:stages[:registers]] (split 0: none; stages default: the engine's; "
                         "registers: the fused kernel's cap per thread, default none)")
    ap.add_argument("--fused", default="auto",
                    help="forms of the fused rotary + attention kernel to try, comma-separated: auto (the engine's, by head "
                         "dim), staged (queries staged in memory, the new token read from the cache), registers (the new "
                         "token attended from registers), prefetch (registers, block table read a tile ahead)")
    ap.add_argument("--shared-prefix", choices=["off", "on", "both"], default="off",
                    help="cascade attention over each prompt's shared KV blocks (rollout.shared_prefix_attention)")
    ap.add_argument("--prefix-splits", type=int, default=0,
                    help="with --shared-prefix: programs per prompt's shared prefix (0: chosen per batch, SharedPrefix.splits)")
    ap.add_argument("--tuned-products", default="on",
                    help="decode products through the cuBLASLt algorithm timed fastest per shape (rollout.tuned_products): "
                         "on, variants (each heuristic answer's split-K / reduction / swizzle variants timed too), off, "
                         "or a comma-separated sequence of them to run in turn")
    ap.add_argument("--sampler-sweep", action="store_true", help="time the sampling kernel's chunk / warp settings")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of eager decode steps")
    ap.add_argument("--logprob-seqs", type=int, default=16)
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--blas", choices=["cublas", "cublaslt"], default=None,
                    help="the BLAS library PyTorch's bf16 products go through (torch.backends.cuda.preferred_blas_library); default: PyTorch's")
    args = ap.parse_args()
    if args.blas and torch.cuda.is_available():
        torch.backends.cuda.preferred_blas_library(args.blas)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    size = "tiny" if args.tiny else args.size
    if args.tiny:
        args.prompts, args.prompt_len, args.n, args.max_tokens = 4, 16, 2, 16
    if device == "cpu":
        torch.set_num_threads(1)  # tiny matmuls: a second thread's wake-up costs more than it saves

    model = random_model(size, device)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (args.prompts, args.prompt_len), generator=g).tolist()
    request = GenerationRequest(prompts, n=args.n, max_tokens=[args.max_tokens] * args.prompts,
                                temperature=1.0, seed=0, stop_token_ids=[])  # fmt: skip
    runs = []
    cascades = {"off": [False], "on": [True], "both": [False, True]}[args.shared_prefix]
    tuned_runs = args.tuned_products.split(",")
    if any(t not in ("on", "variants", "off") for t in tuned_runs):
        ap.error(f"--tuned-products takes on, variants or off, not {args.tuned_products!r}")
    settings = ((a, c, f, t) for t in tuned_runs for a in args.attn.split(",") for c in cascades for f in args.fused.split(","))
    for setting, cascade, fused, tuned in settings:
        tile, warps, split, *rest = (None, 4, 0) if setting == "auto" else map(int, setting.split(":"))
        stages = rest[0] if rest else None
        regs = rest[1] if len(rest) > 1 else None
        runs.append(run_native(model, request, device, args, tile, warps, split, cascade, stages, fused, regs, tuned))
        r = runs[-1]
        shared = f"on, splits {args.prefix_splits or 'auto'}" if cascade else "off"
        print(f"[{size}] native attention tile={tile or 'auto'} warps={warps} split={split} stages={stages or 'auto'} registers={regs} "
              f"fused={fused} shared_prefix={shared} tuned_products={tuned}: "
              f"{r['tokens_per_s']:,.0f} tokens/s (runs {['%.3f' % t for t in r['times_s']]} s), "
              f"logprob diff mean {r['logprob_diff_mean']:.4e}")
    native = max(runs, key=lambda r: r["tokens_per_s"])
    bound = W05B_BOUND_S if size == "0.5B" else decode_bound_s(model, args.prompts * args.n, args.prompt_len, args.max_tokens)
    result = {"size": size, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "native": native, "native_runs": runs, "decode_bound_s": bound, "fraction_of_bound": bound / native["time_s"]}  # fmt: skip
    print(f"[{size}] native: {native['tokens']} tokens in {native['time_s']:.3f} s = {native['tokens_per_s']:,.0f} tokens/s"
          f" (first call {native['cold_s']:.2f} s); fraction of bound ({bound:.3f} s): {result['fraction_of_bound']:.2f}")  # fmt: skip
    print(f"[{size}] native logprob diff vs full forward: mean {native['logprob_diff_mean']:.2e} max {native['logprob_diff_max']:.2e}")
    if device == "cuda":
        print(f"[{size}] memory allocated before wake {native['mem_before_wake_mib']:.1f} MiB, after sleep "
              f"{native['mem_after_sleep_mib']:.1f} MiB ({100 * native['mem_after_sleep_rel']:+.2f}%); "
              f"peak {native['peak_allocated_gib']:.2f} GiB")  # fmt: skip
    if not args.skip_hf:
        hf = run_hf(model, request, device, args.hf_max_tokens or args.max_tokens)
        result["hf"] = hf
        result["speedup"] = native["tokens_per_s"] / hf["tokens_per_s"]
        print(f"[{size}] hf generate: {hf['tokens']} tokens in {hf['time_s']:.2f} s = {hf['tokens_per_s']:,.0f} tokens/s"
              f" ({hf['max_tokens']} new tokens per response)")  # fmt: skip
        print(f"[{size}] native / hf: {result['speedup']:.1f}x")
    if args.sampler_sweep and device == "cuda":
        sweep_sampler(model.config.vocab_size, args.prompts * args.n)
    if args.profile and device == "cuda":
        profile_decode(model, request, max(args.max_num_seqs, args.prompts * args.n))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
