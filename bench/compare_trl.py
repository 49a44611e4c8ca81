"""hybridrl against TRL 1.16 `GRPOTrainer`: one workload, one GPU, one invocation (BENCHMARK.md).

    python bench/compare_trl.py                   # W0.5B: 32 prompts x 256 tokens, n=8, 512 new tokens
    python bench/compare_trl.py --size 1.5B       # W1.5B
    python bench/compare_trl.py --tiny            # the same comparison on a tiny model, on CPU, in seconds
    python bench/compare_trl.py --json out.json   # also write the table's figures
    python bench/compare_trl.py --gradient-checkpointing off   # both systems without activation checkpointing
    python bench/compare_trl.py --skip-trl --set train.compile=false --variant fp32:train.master_weights=fp32
                                                  # hybridrl only, changed settings, an extra row
    python bench/compare_trl.py --skip-trl --profile 3   # torch.profiler summary of hybridrl's step 3
    python bench/compare_trl.py --skip-trl --profile 3 --trace step3.json.gz   # and its trace:
    python bench/trace_summary.py step3.json.gz          # GPU busy / idle time and kernels, phase by phase
    python bench/compare_trl.py --skip-trl --profile 3 --stack --trace s.json.gz && python bench/trace_summary.py s.json.gz --why
                                                  # and why the GPU sat idle: blocking calls, Python frames
    python bench/compare_trl.py --skip-trl --variant cpp:inductor.cpp_wrapper=true
                                                  # a torch._inductor.config option against the default, one call
    python bench/compare_trl.py --skip-trl --memory-snapshot 3:step3.pickle && python bench/memory_peak.py step3.pickle
                                                  # what was allocated at step 3's memory peak, and where (GPU)
    python bench/compare_trl.py --skip-trl --host-delay-ms 3   # does the training phase grow when its host is slower?
                                                  # (no: the GPU sets its pace; yes: the host does)

Both systems run GRPO with a KL of 0.04 to a reference model, lr 1e-6, temperature 1.0 and one
optimizer step per 256 responses (TRL: per_device_train_batch_size=16, gradient_accumulation_steps=16),
on a random-init Qwen2 model of the workload's shape (seed 42, saved in bf16) and a local WordLevel
tokenizer of 151,936 tokens, with the same reward function. hybridrl uses its native rollout engine
and, on a GPU, compiled decoder layers (four per graph), a 13,056-token budget per training
micro-batch (three whole prompt groups, about TRL's micro-batch of 16 responses of 768 tokens), a
34,816-token budget for the reference pass and the compensated bf16 optimizer (`train.master_weights: compensated`); TRL its defaults:
transformers `generate`, fp32 weights and AdamW state under bf16 autocast, gradient checkpointing
(on for hybridrl too; `--gradient-checkpointing off` turns it off for both). A random model rarely emits EOS, so responses
run to the limit. On a GPU each system runs in its own subprocess, so each peak-memory figure is its
own. Step time is the mean over the steps after the first. TRL is optional: without it only the
hybridrl half runs. On a GPU the table also sets hybridrl against BENCHMARK.md's TRL figures, which,
unlike the TRL run of the same call, do not vary from call to call, and for W0.5B it says which of the
target lines the call met: a step of at most 1.9 s, at least 8x shorter than the same call's TRL step, a
peak of at most half of TRL's (also in the JSON, under "targets").
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# The GPU's limits behind the physical bound: BENCHMARK.md's, measured on the H200 its figures are for (a
# device-to-device copy, a large bf16 matmul). Any other GPU gets its own measured (`device_limits`).
H200_LIMITS = {"hbm_bytes_per_s": 4.0e12, "bf16_flops": 790e12, "source": "BENCHMARK.md's H200 figures"}
SPECIAL = ["<|pad|>", "<|endoftext|>", "<|unk|>"]


@dataclass
class Workload:
    size: str
    prompts: int = 32  # per step
    prompt_len: int = 256
    n: int = 8
    max_tokens: int = 512
    grad_accum: int = 16  # TRL: micro-batches per optimizer step (per_device_train_batch_size = responses / this)
    # hybridrl's token budget per forward/backward: about TRL's micro-batch (16 responses x (256 + 512) =
    # 12,288 tokens), rounded up to three whole prompt groups (3 x (256 + 8 x 512) = 13,056 = 17 x 768)
    # so that no group is split between micro-batches and no prompt is computed twice
    max_tokens_per_micro_batch: int = 13056
    max_tokens_per_forward: int = 34816  # the no-grad reference pass: eight whole groups
    lr: float = 1e-6
    beta: float = 0.04  # KL coefficient

    @property
    def responses(self) -> int:
        return self.prompts * self.n


def workload(size: str) -> Workload:
    if size == "tiny":
        return Workload("tiny", prompts=4, prompt_len=16, n=2, max_tokens=16, grad_accum=2, max_tokens_per_micro_batch=64,
                        max_tokens_per_forward=128)
    return Workload(size)


def reward_fn(completions, **kwargs) -> list[float]:
    """A cheap reward that varies between responses (TRL's signature; hybridrl takes it unchanged)."""
    return [(len(c) % 13) / 13.0 for c in completions]


# ---- the workload on disk -------------------------------------------------------------------------


def build_workload(w: Workload, out: Path, device: str) -> list[str]:
    """Saves the random-init model and the tokenizer to `out`; returns the prompt texts (for every step)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from hybridrl.models.synthetic import SHAPES, random_model

    shape = SHAPES[w.size]
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL), shape["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|endoftext|>", unk_token="<|unk|>", padding_side="left"
    )
    tokenizer.save_pretrained(out)
    model = random_model(w.size, device, max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model.save_pretrained(out)
    del model
    g = torch.Generator().manual_seed(0)
    steps_of_prompts = 64  # distinct prompts for every step either system runs
    ids = torch.randint(len(SPECIAL), shape["vocab_size"], (w.prompts * steps_of_prompts, w.prompt_len), generator=g)
    return [" ".join(f"t{i}" for i in row) for row in ids.tolist()]


def load_tokenizer(model_dir: Path):
    """The WordLevel tokenizer as saved (AutoTokenizer would rebuild a Qwen2 BPE from the model type)."""
    import transformers

    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"), pad_token="<|pad|>", eos_token="<|endoftext|>",
        unk_token="<|unk|>", padding_side="left",
    )  # fmt: skip


def physical_bound_s(w: Workload, num_params: int, weight_bytes: int, limits: dict = H200_LIMITS) -> float:
    """Decode reads the weights and the KV cache once per step; training is 8 N T FLOPs (6 policy, 2 reference).

    `limits`: the GPU's copy bandwidth and bf16 matmul rate (`device_limits`); W0.5B on the H200 is BENCHMARK.md's own
    1.35 s."""
    if w.size == "0.5B" and limits is H200_LIMITS:
        return 1.35  # BENCHMARK.md
    from hybridrl.models.synthetic import SHAPES

    s = SHAPES[w.size]
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    kv_per_token = 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * head_dim * 2
    mean_context = w.prompt_len + w.max_tokens / 2
    decode = w.max_tokens * (weight_bytes + w.responses * mean_context * kv_per_token) / limits["hbm_bytes_per_s"]
    train = 8 * num_params * w.responses * (w.prompt_len + w.max_tokens) / limits["bf16_flops"]
    return decode + train


def device_limits(name: str) -> dict:
    """The limits of the GPU called `name` for the physical bound: BENCHMARK.md's on an H200, else measured here.

    BENCHMARK.md's bound (and its TRL figures and 1.9 s target) are an H200's; on another GPU (an H100: ~30% less
    memory bandwidth) a fraction of the H200's bound would say nothing about this GPU."""
    if "H200" in name:
        return H200_LIMITS
    measured = measure_device_limits()
    return dict(measured, source=f"measured on this GPU: {measured['hbm_bytes_per_s'] / 1e12:.2f} TB/s copy, "
                                 f"{measured['bf16_flops'] / 1e12:.0f} TFLOP/s bf16 matmul")  # fmt: skip


def measure_device_limits(copy_bytes: int = 1 << 30, n: int = 8192, repeats: int = 10) -> dict:
    """This GPU's device-to-device copy rate (bytes read + written per second) and large bf16 matmul rate, best of
    `repeats`, as BENCHMARK.md measured the H200's. Run after both halves, so it takes none of their memory."""
    from hybridrl.kernels.cublaslt import time_eager_us

    best_s = lambda fn: time_eager_us(fn, reps=1, rounds=repeats) / 1e6  # noqa: E731  (each call ~0.5 ms and up)

    src = torch.zeros(copy_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    hbm = 2 * copy_bytes / best_s(lambda: dst.copy_(src))
    del src, dst
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    flops = 2 * n**3 / best_s(lambda: a @ b)
    del a, b
    torch.cuda.empty_cache()
    return {"hbm_bytes_per_s": hbm, "bf16_flops": flops}


# ---- the two halves -------------------------------------------------------------------------------


PROFILE_STACK = False  # --stack: record Python frames in the profiled step (for trace_summary.py --why)
MEMORY_SNAPSHOT: tuple[int, str] | None = None  # --memory-snapshot STEP:FILE (a variant's half: FILE with .NAME before its suffix)
HOST_DELAY_MS = 0.0  # --host-delay-ms: sleep before each training micro-batch (delay_each_micro_batch)


def profile_step(trainer, step: int, top: int = 40, trace: str | None = None):
    """Runs step `step` (1-based) of `trainer.fit` under torch.profiler and prints where the GPU time went.

    With `trace`, also writes the step's Chrome trace there (gzipped when the name ends in .gz), for
    bench/trace_summary.py or a trace viewer."""
    original = trainer.train_step

    def train_step(prompts):
        if trainer.step + 1 != step:
            return original(prompts)
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        pauses: list[tuple[int, float]] = []  # (generation, seconds) of each garbage collection in the step
        started: list[float] = []

        def on_gc(phase, info):
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                pauses.append((info["generation"], time.perf_counter() - started.pop()))

        gc.callbacks.append(on_gc)
        try:
            with profile(activities=activities, with_stack=PROFILE_STACK) as prof:
                record = original(prompts)
        finally:
            gc.callbacks.remove(on_gc)
        by_gen = {g: (sum(1 for x, _ in pauses if x == g), sum(d for x, d in pauses if x == g)) for g in (0, 1, 2)}
        print("\n[profile] garbage collections in the step: " + ", ".join(f"gen{g} {n}x {1e3 * d:.1f} ms" for g, (n, d) in by_gen.items()))
        events = prof.key_averages()
        phases = sorted((e for e in events if e.key.startswith("phase/")), key=lambda e: e.key)
        print(f"\n[profile] step {step}: phases (CPU wall ms / device ms inside):")
        for e in phases:
            print(f"  {e.key:24s} cpu {e.cpu_time_total / 1e3:9.1f}  device {e.device_time_total / 1e3:9.1f}")
        print(events.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=70))
        if trace:
            prof.export_chrome_trace(trace)  # torch gzips it when the name ends in .gz
            print(f"[profile] trace written to {trace}")
        return record

    trainer.train_step = train_step


def memory_snapshot_step(trainer, step: int, path: str) -> None:
    """Records the CUDA allocator's history (every allocation and free, with Python frames) during
    step `step` (1-based) and writes the snapshot to `path` (pickle) with the bytes allocated when
    recording started, for bench/memory_peak.py."""
    import pickle

    original = trainer.train_step

    def train_step(prompts):
        if trainer.step + 1 != step:
            return original(prompts)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=4_000_000)
        try:
            record = original(prompts)
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        snapshot["hybridrl"] = {"step": step, "allocated_before": before, "peak_allocated_gib": record.get("memory/peak_allocated_gib")}
        with open(path, "wb") as f:
            pickle.dump(snapshot, f)
        print(f"[memory] step {step}: allocator snapshot written to {path} ({sum(map(len, snapshot.get('device_traces', []))):,} "
              f"trace entries); python bench/memory_peak.py {path}", flush=True)  # fmt: skip
        return record

    trainer.train_step = train_step


def parse_memory_snapshot(text: str | None) -> tuple[int, str] | None:
    if not text:
        return None
    step, sep, path = text.partition(":")
    if not sep or not step.isdigit() or int(step) < 1 or not path:
        raise SystemExit(f"--memory-snapshot {text!r}: write STEP:FILE, e.g. 3:step3.pickle")
    return int(step), path


def snapshot_for_variant(text: str, variant: str | None) -> str:
    """STEP:FILE for the default half; STEP:FILE with `.NAME` before its suffix for variant NAME."""
    if variant is None:
        return text
    step, path = parse_memory_snapshot(text)
    p = Path(path)
    return f"{step}:{p.with_name(f'{p.stem}.{variant}{p.suffix}')}"


def wall_clock_steps(trainer, device: str) -> list[float]:
    """Times every `trainer.train_step` on the host's clock between GPU syncs, as TRL's steps are
    timed (StepTimer below), beside the step record's own `timing/step`; returns the list it fills."""
    times: list[float] = []
    original = trainer.train_step

    def train_step(prompts):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        record = original(prompts)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        return record

    trainer.train_step = train_step
    return times


def full_collection_after_last_step(trainer) -> dict:
    """After the last step, while the run's objects are as training left them (frozen or not,
    `trainer.gc_freeze`), times one full garbage collection: what a generation-2 collection that
    falls inside a step would cost it. Returns the dict it fills."""
    out: dict = {}
    original = trainer.train_step

    def train_step(prompts):
        record = original(prompts)
        if trainer.step == trainer.config.train.total_steps:
            tracked, frozen = len(gc.get_objects()), gc.get_freeze_count()
            start = time.perf_counter()
            gc.collect()
            out.update(seconds=time.perf_counter() - start, tracked=tracked, frozen=frozen)
        return record

    trainer.train_step = train_step
    return out


def apply_inductor_settings(overrides: list[str]) -> list[str]:
    """Sets each `inductor.NAME=VALUE` override on `torch._inductor.config` (a dotted NAME for its
    sub-configs: `inductor.triton.cudagraphs=true`) and returns the others, hybridrl's config keys.
    For A/B runs of the compiler's options in one call: `--variant cpp:inductor.cpp_wrapper=true`."""
    from hybridrl.config.loading import parse_override

    rest = []
    for item in overrides:
        if not item.startswith("inductor."):
            rest.append(item)
            continue
        import torch._inductor.config as inductor_config

        key, value = parse_override(item)
        option = key.removeprefix("inductor.")
        *path, name = option.split(".")
        node = inductor_config
        for part in path:
            node = getattr(node, part, None)
        if node is None or not hasattr(node, name):
            raise ValueError(f"{item!r}: torch._inductor.config has no {option!r}")
        setattr(node, name, value)
        print(f"hybridrl: torch._inductor.config.{option} = {value!r}", flush=True)
    return rest


def run_hybridrl(w: Workload, model_dir: Path, prompts: list[str], steps: int, device: str, work_dir: Path,
                 overrides: list[str] = (), profile: int = 0, trace: str | None = None, checkpointing: bool = True) -> dict:  # fmt: skip
    from hybridrl import RolloutEngine, TrainerEngine
    from hybridrl.config import Config
    from hybridrl.config.loading import apply_overrides
    from hybridrl.metrics import read_records
    from hybridrl.models import load_causal_lm
    from hybridrl.rollout.native.scheduler import blocks_for

    block = 16
    shared, own = blocks_for(w.prompt_len, w.max_tokens, w.n, block)
    num_blocks = w.prompts * (shared + w.n * own) + 64  # the whole step's KV, no more (peak memory)
    data = work_dir / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    cfg = Config()
    cfg.model.path = str(model_dir)
    cfg.model.gradient_checkpointing = device == "cuda" and checkpointing  # as TRL's (on: GRPOConfig's default)
    cfg.data.train_path = str(data)
    cfg.data.max_prompt_length = w.prompt_len
    cfg.rollout.n, cfg.rollout.max_tokens, cfg.rollout.temperature = w.n, w.max_tokens, 1.0
    cfg.algorithm.name, cfg.algorithm.kl_coef, cfg.algorithm.kl_estimator = "grpo", w.beta, "k3"
    t = cfg.train
    t.total_steps, t.batch_size, t.lr = steps, w.responses, w.lr
    t.max_tokens_per_micro_batch = w.max_tokens_per_micro_batch
    t.packing, t.offload_reference = "on", device == "cuda"
    if device == "cuda":  # the settings a GPU user should run with (README, "Training speed and memory")
        t.compile = True  # decoder layers of the policy and the reference
        t.compile_layers_per_graph = 4  # four layers (and their checkpointing) per compiled graph
        t.max_tokens_per_forward = w.max_tokens_per_forward
        t.master_weights = "compensated"  # bf16 weights + bf16 Kahan compensation, bf16 AdamW moments
    cfg.trainer.output_dir, cfg.trainer.save_every, cfg.trainer.progress, cfg.trainer.resume = str(work_dir / "run"), 0, False, "off"
    cfg = apply_overrides(cfg, apply_inductor_settings(list(overrides)))  # --set / --variant, checked as `hybridrl train` checks them
    model = load_causal_lm(str(model_dir), dtype="auto", device=device)
    engine = RolloutEngine(model, load_tokenizer(model_dir), backend="native", num_kv_blocks=num_blocks,
                           max_num_seqs=w.responses, fp32_residual=cfg.rollout.fp32_residual,
                           shared_prefix_attention=cfg.rollout.shared_prefix_attention,
                           tuned_products=cfg.rollout.tuned_products,
                           step_ahead=None if cfg.rollout.step_ahead else False)  # fmt: skip
    engine.path = str(model_dir)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = TrainerEngine(actor=engine, reward_fn=reward_fn, algorithm="grpo", config=cfg)
    if HOST_DELAY_MS:
        delay_each_micro_batch(trainer, HOST_DELAY_MS)
    if profile:
        profile_step(trainer, profile, trace=trace)
    if MEMORY_SNAPSHOT is not None:
        if device == "cuda":
            memory_snapshot_step(trainer, *MEMORY_SNAPSHOT)
        else:
            print("[memory] --memory-snapshot records the CUDA allocator: no snapshot on CPU", flush=True)
    wall = wall_clock_steps(trainer, device)
    full_gc = full_collection_after_last_step(trainer)
    trainer.fit(str(data))
    records = read_records(work_dir / "run" / "metrics.jsonl")
    if not records:
        raise RuntimeError(f"hybridrl wrote no step record to {work_dir / 'run' / 'metrics.jsonl'}: the run stopped "
                           "before its first step ended (its log above says why)")  # fmt: skip
    for r in records:
        print("hybridrl step", r["step"], {k: round(v, 3) for k, v in r.items() if isinstance(v, float) and k.startswith(("timing/", "perf/", "memory/", "actor/kl", "rollout/logprob_diff", "rollout/host_syncs", "rollout/graphs_reused"))}, flush=True)
    later = records[1:] or records
    mean = lambda key: sum(r[key] for r in later if r.get(key) is not None) / max(1, sum(r.get(key) is not None for r in later))  # noqa: E731
    phases = sorted({k for r in later for k in r if k.startswith("timing/")})
    return {
        "step_time_s": mean("timing/step"),
        "step_times_s": [r["timing/step"] for r in records],
        "host_step_times_s": wall,  # the same steps on the host's clock, as TRL's are measured
        "full_gc_after_last_step": full_gc,  # seconds of one full collection then; tracked and frozen objects
        "response_tokens_per_step": mean("rollout/response_length/mean") * w.responses,
        "peak_allocated_gib": max(r.get("memory/peak_allocated_gib") or 0.0 for r in records) if device == "cuda" else None,
        "phases_s": {k.removeprefix("timing/"): mean(k) for k in phases if k.count("/") == 1},
        "rollout_engine": {k.removeprefix("timing/rollout/"): mean(k) for k in phases if k.startswith("timing/rollout/")},
        # the host's seconds issuing the update's micro-batches (near timing/train: host-limited, or held by a full launch queue)
        "train_host_issue_s": mean("timing/train/actor_host_issue"),
        # which phase sets the peak (GPU): the allocator's peak while each phase ran, over the steps after the first
        "peak_by_phase_gib": {k.removeprefix("memory/peak_allocated_gib/"): max(r[k] for r in later if k in r)
                              for k in sorted({k for r in later for k in r if k.startswith("memory/peak_allocated_gib/")})},
        "mfu_actor": mean("perf/mfu/actor") if device == "cuda" else None,
        "mfu_ref": mean("perf/mfu/ref") if device == "cuda" else None,
        "kl": later[-1].get("actor/kl"),
        "gc_s": [r.get("perf/gc_s") for r in records],  # the Python collector's time inside each step
        "compile_s": [r.get("perf/compile_s") for r in records],  # torch.compile's and Triton's compilations inside each step
        "logprob_diff_mean": mean("rollout/logprob_diff/mean"),
        "logprob_diff_max": max((r.get("rollout/logprob_diff/max") or 0.0) for r in records),
        "overrides": list(overrides),
        "compiled_graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),  # FlexAttention: no recompiles after step 1
        "num_params": sum(p.numel() for p in engine.model.parameters()),
        "weight_bytes": sum(p.numel() * p.element_size() for p in engine.model.parameters()),
    }


def run_trl(w: Workload, model_dir: Path, prompts: list[str], steps: int, device: str, work_dir: Path,
            checkpointing: bool = True) -> dict:  # fmt: skip
    import trl
    import transformers
    from datasets import Dataset

    class StepTimer(transformers.TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.start)
            # As it happens: a run cut short (a time limit) still shows the steps it measured.
            print(f"TRL step {len(self.times)}: {self.times[-1]:.2f} s", flush=True)

    args = trl.GRPOConfig(
        output_dir=str(work_dir / "trl"), max_steps=steps, learning_rate=w.lr, beta=w.beta, temperature=1.0,
        num_generations=w.n, max_completion_length=w.max_tokens,
        per_device_train_batch_size=w.responses // w.grad_accum, gradient_accumulation_steps=w.grad_accum,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, seed=0, lr_scheduler_type="constant",
        bf16=device == "cuda", use_cpu=device == "cpu", dataloader_num_workers=0, gradient_checkpointing=checkpointing,
    )  # fmt: skip
    tokenizer = load_tokenizer(model_dir)
    timer = StepTimer()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = trl.GRPOTrainer(
        model=str(model_dir), reward_funcs=reward_fn, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer, callbacks=[timer],
    )  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    later = timer.times[1:] or timer.times
    mean_length = sum(h["completions/mean_length"] for h in logs) / max(1, len(logs))
    return {
        "version": trl.__version__,
        "step_time_s": sum(later) / len(later),
        "step_times_s": timer.times,
        "response_tokens_per_step": mean_length * w.responses,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "kl": logs[-1].get("kl") if logs else None,
    }


def delay_each_micro_batch(trainer, ms: float) -> None:
    """`--host-delay-ms`: the host sleeps `ms` before it issues each training micro-batch. A probe of who
    sets the training phase's pace: if the phase grows by the sleeps, its host does; if it does not, the
    host had that much slack (the GPU was still running work queued earlier)."""
    policy = trainer.policy_trainer
    loss = policy._loss

    def delayed(micro, **kwargs):
        time.sleep(ms / 1e3)
        return loss(micro, **kwargs)

    policy._loss = delayed  # PolicyTrainer.update passes self._loss to the update loop


def run_half(system: str, w: Workload, model_dir: Path, prompts: list[str], steps: int, device: str,
             overrides: list[str] = (), profile: int = 0, trace: str | None = None, checkpointing: bool = True) -> dict:  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        if system == "hybridrl":
            return run_hybridrl(w, model_dir, prompts, steps, device, Path(tmp), overrides, profile, trace, checkpointing)
        return run_trl(w, model_dir, prompts, steps, device, Path(tmp), checkpointing)


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, items = text.partition(":")
    if not sep or not name:
        raise SystemExit(f"--variant {text!r}: write NAME:KEY=VALUE[,KEY=VALUE...]")
    return name, [i for i in items.split(",") if i]


def trl_missing() -> str | None:
    try:
        import trl  # noqa: F401
    except ImportError as e:
        return f"trl is not installed ({e})"
    return None


def run_in_subprocess(system: str, args, model_dir: Path, overrides: list[str] = (), profile: int = 0, variant: str | None = None) -> dict:
    """One half in a fresh process: its own CUDA context, allocator and peak-memory counter."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    cmd = [sys.executable, __file__, "--worker", system, "--model-dir", str(model_dir), "--worker-out", str(out),
           "--size", args.size, "--steps", str(args.steps if system == "hybridrl" else args.trl_steps),
           "--gradient-checkpointing", args.gradient_checkpointing]  # fmt: skip
    if args.tiny:
        cmd.append("--tiny")
    for item in overrides:
        cmd += ["--set", item]
    if profile:
        cmd += ["--profile", str(profile)]
        if args.trace:
            cmd += ["--trace", args.trace]
        if args.stack:
            cmd.append("--stack")
    if system == "hybridrl" and args.host_delay_ms:
        cmd += ["--host-delay-ms", str(args.host_delay_ms)]
    if system == "hybridrl" and args.memory_snapshot:
        cmd += ["--memory-snapshot", snapshot_for_variant(args.memory_snapshot, variant)]
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        return {"error": f"{system} half exited with status {proc.returncode} (its output is above)"}
    return json.loads(out.read_text())


# ---- the table ------------------------------------------------------------------------------------


def _fmt(value, spec: str, unit: str = "") -> str:
    return "-" if value is None else format(value, spec) + unit


# TRL's figures in ../shared/BENCHMARK.md (one H200; step time s, peak allocated GiB) and the step-time
# target where it names one: a reference that does not move with the TRL run of the same call, whose
# step time varies from call to call (14.6-26.4 s at W0.5B over sessions; train/NOTES.md)
BENCHMARK_MD_TRL = {"0.5B": (15.5, 22.9, 1.9), "1.5B": (20.4, 51.5, None)}
# The other two lines of the same check, against the TRL run of the same call: at least this many times
# shorter a step, and at most this fraction of its peak allocated memory.
TARGET_SPEEDUP, TARGET_MEMORY_RATIO = 8.0, 0.5


def summarise(w: Workload, h: dict, trl: dict, bound_s: float | None) -> dict:
    result = {"workload": asdict(w), "hybridrl": h, "trl": trl, "physical_bound_s": bound_s}
    if w.size in BENCHMARK_MD_TRL and h.get("step_time_s") and h.get("peak_allocated_gib"):
        trl_s, trl_gib, target_s = BENCHMARK_MD_TRL[w.size]
        result["against_benchmark_md"] = {
            "trl_step_time_s": trl_s, "trl_peak_allocated_gib": trl_gib, "target_step_time_s": target_s,
            "speedup": trl_s / h["step_time_s"], "memory_ratio": h["peak_allocated_gib"] / trl_gib,
        }  # fmt: skip
    if "step_time_s" in h:
        h["response_tokens_per_s"] = h["response_tokens_per_step"] / h["step_time_s"]
        if bound_s:
            result["hybridrl_fraction_of_bound"] = bound_s / h["step_time_s"]
    if "step_time_s" in trl:
        trl["response_tokens_per_s"] = trl["response_tokens_per_step"] / trl["step_time_s"]
    if "step_time_s" in h and "step_time_s" in trl:
        result["speedup"] = trl["step_time_s"] / h["step_time_s"]
        result["tokens_per_s_ratio"] = h["response_tokens_per_s"] / trl["response_tokens_per_s"]
        if h.get("peak_allocated_gib") and trl.get("peak_allocated_gib"):
            result["memory_ratio"] = h["peak_allocated_gib"] / trl["peak_allocated_gib"]
    target_s = result.get("against_benchmark_md", {}).get("target_step_time_s")
    if target_s and "speedup" in result:  # the workload BENCHMARK.md sets targets for, with TRL run beside it
        targets = {"step_time_s": (h["step_time_s"], target_s, h["step_time_s"] <= target_s),
                   "speedup": (result["speedup"], TARGET_SPEEDUP, result["speedup"] >= TARGET_SPEEDUP)}  # fmt: skip
        if "memory_ratio" in result:
            targets["memory_ratio"] = (result["memory_ratio"], TARGET_MEMORY_RATIO, result["memory_ratio"] <= TARGET_MEMORY_RATIO)
        result["targets"] = {k: {"value": v, "line": line, "met": met} for k, (v, line, met) in targets.items()}
    return result


def _print_early(label: str, h: dict) -> None:
    """One line of a half's figures as soon as it ends (the table comes after every half has run)."""
    if "step_times_s" in h:
        phases = h.get("phases_s", {})
        print(f"{label}: step times {[round(t, 3) for t in h['step_times_s']]} s, peak allocated {h['peak_allocated_gib']:.3f} GiB; "
              + ", ".join(f"{k} {phases[k]:.3f}" for k in ("rollout", "ref", "train") if k in phases), flush=True)  # fmt: skip


def print_table(result: dict) -> None:
    w, h, trl = result["workload"], result["hybridrl"], result["trl"]
    title = f"W{w['size']}: {w['prompts']} prompts x {w['prompt_len']} tokens, n={w['n']}, {w['max_tokens']} new tokens, GRPO kl {w['beta']}, lr {w['lr']}"
    if result.get("gradient_checkpointing"):
        title += f", gradient checkpointing {result['gradient_checkpointing']}"
    if result.get("host_delay_ms"):
        title += f"; hybridrl's host slept {result['host_delay_ms']:g} ms before each training micro-batch (--host-delay-ms)"
    print(f"\n{title}\n")
    print("| system | step time | response tokens/s | peak allocated |")
    print("| --- | --- | --- | --- |")
    for name, r in (("hybridrl (native rollout)", h), (f"TRL {trl.get('version', '')} GRPOTrainer (transformers generate)", trl)):
        if "step_time_s" not in r:
            print(f"| {name} | not run: {r.get('skipped') or r.get('error')} | | |")
            continue
        print(f"| {name} | {r['step_time_s']:.2f} s | {r['response_tokens_per_s']:,.0f} | {_fmt(r.get('peak_allocated_gib'), '.1f', ' GiB')} |")
    if "speedup" in result:
        mem = result.get("memory_ratio")
        print(f"| TRL / hybridrl | {result['speedup']:.1f}x shorter | {result['tokens_per_s_ratio']:.1f}x | "
              f"{_fmt(mem, '.0%')} of TRL's |")  # fmt: skip
    device = result.get("device")
    other_gpu = device not in (None, "cpu") and "H200" not in device  # BENCHMARK.md's figures and target are an H200's
    if "against_benchmark_md" in result:
        ref = result["against_benchmark_md"]
        target = f"; the target is {ref['target_step_time_s']} s" if ref["target_step_time_s"] else ""
        if other_gpu:
            target += f" (BENCHMARK.md's figures are one H200's; this call ran on {device})"
        print(f"\nagainst BENCHMARK.md's TRL figures ({ref['trl_step_time_s']} s, {ref['trl_peak_allocated_gib']} GiB): "
              f"{ref['speedup']:.1f}x shorter, {ref['memory_ratio']:.0%} of its memory{target}")  # fmt: skip
    if "targets" in result:
        t = result["targets"]
        met = lambda k: "met" if t[k]["met"] else "not met"  # noqa: E731
        h200 = " (an H200's target)" if other_gpu else ""
        line = (f"targets: step {t['step_time_s']['value']:.2f} s against <= {t['step_time_s']['line']} s{h200}: {met('step_time_s')}; "
                f"{t['speedup']['value']:.1f}x shorter than this call's TRL against >= {t['speedup']['line']:.0f}x: {met('speedup')}")  # fmt: skip
        if "memory_ratio" in t:
            line += f"; {t['memory_ratio']['value']:.0%} of its peak against <= {t['memory_ratio']['line']:.0%}: {met('memory_ratio')}"
        print(line)
    if "hybridrl_fraction_of_bound" in result:
        source = result.get("physical_bound_limits", {}).get("source")
        print(f"\nhybridrl step at {result['hybridrl_fraction_of_bound']:.0%} of the physical bound ({result['physical_bound_s']:.2f} s"
              + (f"; {source})" if source else ")"))  # fmt: skip
    if "phases_s" in h:
        phases = ", ".join(f"{k} {v:.3f}" for k, v in h["phases_s"].items())
        print(f"hybridrl phases (s, mean after the first step): {phases}")
        if h.get("peak_by_phase_gib"):
            print("hybridrl peak allocated by phase (GiB, steps after the first): "
                  + ", ".join(f"{k} {v:.3f}" for k, v in h["peak_by_phase_gib"].items() if k != "step"))  # fmt: skip
        if h.get("full_gc_after_last_step"):
            g = h["full_gc_after_last_step"]
            print(f"hybridrl: a full garbage collection after the last step took {g['seconds']:.3f} s "
                  f"({g['tracked']:,} objects tracked, {g['frozen']:,} frozen: trainer.gc_freeze)")  # fmt: skip
        if h.get("train_host_issue_s"):
            print(f"hybridrl training phase: the host took {h['train_host_issue_s']:.3f} s to issue its micro-batches' "
                  f"work ({h['train_host_issue_s'] / h['phases_s']['train']:.0%} of the phase)")  # fmt: skip
    if h.get("rollout_engine"):
        print("hybridrl inside the rollout phase (s): " + ", ".join(f"{k} {v:.3f}" for k, v in h["rollout_engine"].items()))
        print(f"hybridrl rollout/logprob_diff: mean {_fmt(h.get('logprob_diff_mean'), '.3e')}, max {_fmt(h.get('logprob_diff_max'), '.3e')}")
        print(f"hybridrl MFU: actor {_fmt(h.get('mfu_actor'), '.1%')}, ref {_fmt(h.get('mfu_ref'), '.1%')}; "
              f"step times {['%.2f' % s for s in h['step_times_s']]} "
              f"(host clock: {['%.2f' % s for s in h.get('host_step_times_s', [])]})")  # fmt: skip
        if h.get("gc_s"):
            print(f"hybridrl Python garbage collection per step (s): {[_fmt(s, '.3f') for s in h['gc_s']]}")
        if h.get("compile_s"):  # a step after the first that compiled: its time is not the code's steady state
            print(f"hybridrl compilation per step (s): {[_fmt(s, '.3f') for s in h['compile_s']]}")
    if "step_times_s" in trl:
        print(f"TRL step times {['%.2f' % s for s in trl['step_times_s']]}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=["0.5B", "1.5B"], default="0.5B")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on CPU (CI)")
    ap.add_argument("--steps", type=int, default=4, help="hybridrl steps (the first is not timed)")
    ap.add_argument("--trl-steps", type=int, default=3, help="TRL steps (the first is not timed)")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--gradient-checkpointing", choices=["on", "off"], default="on",
                    help="activation checkpointing for both systems on the GPU (on: TRL's GRPOConfig default)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="hybridrl config override, as `hybridrl train` takes it, or inductor.NAME=VALUE for "
                         "torch._inductor.config (repeatable)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    help="also run hybridrl with these overrides (on top of --set) and print it as an extra row (repeatable)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEP",
                    help="print a torch.profiler summary of this hybridrl step (GPU)")
    ap.add_argument("--trace", type=str, default=None, metavar="FILE",
                    help="with --profile: also write that step's Chrome trace (FILE.json.gz: gzipped); bench/trace_summary.py reads it")
    ap.add_argument("--stack", action="store_true", help="with --profile: record Python frames too (slower; for trace_summary.py --why)")
    ap.add_argument("--memory-snapshot", default=None, metavar="STEP:FILE",
                    help="record the CUDA allocator during this hybridrl step and write its snapshot to FILE, a variant NAME's to FILE with .NAME before its suffix (GPU; bench/memory_peak.py reads them)")
    ap.add_argument("--host-delay-ms", type=float, default=0.0, metavar="MS",
                    help="hybridrl's host sleeps MS before issuing each training micro-batch: if its training phase "
                         "does not grow by the sleeps, the phase is paced by its GPU, not its host")
    ap.add_argument("--worker", choices=["hybridrl", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=str, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", type=str, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    global PROFILE_STACK, MEMORY_SNAPSHOT, HOST_DELAY_MS
    PROFILE_STACK = args.stack
    HOST_DELAY_MS = args.host_delay_ms
    MEMORY_SNAPSHOT = parse_memory_snapshot(args.memory_snapshot)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    w = workload("tiny" if args.tiny else args.size)
    checkpointing = args.gradient_checkpointing == "on"
    if args.worker:  # one half, in a subprocess of the invocation below
        prompts = json.loads((Path(args.model_dir) / "prompts.json").read_text())
        steps_prompts = prompts[: w.prompts * max(args.steps, 1) * 2]
        result = run_half(args.worker, w, Path(args.model_dir), steps_prompts, args.steps, device, args.set, args.profile, args.trace,
                          checkpointing)  # fmt: skip
        Path(args.worker_out).write_text(json.dumps(result))
        return result

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        t0 = time.perf_counter()
        prompts = build_workload(w, model_dir, device)
        (model_dir / "prompts.json").write_text(json.dumps(prompts))
        print(f"[{w.size}] workload built in {time.perf_counter() - t0:.1f} s on {device}", flush=True)
        missing = "--skip-trl" if args.skip_trl else trl_missing()
        variants = [parse_variant(v) for v in args.variant]
        if device == "cuda":
            h = run_in_subprocess("hybridrl", args, model_dir, args.set, args.profile)
            _print_early("hybridrl", h)  # before the variants and TRL's half: a call cut short keeps these figures
            extra = {}
            for name, items in variants:
                extra[name] = run_in_subprocess("hybridrl", args, model_dir, args.set + items, variant=name)
                _print_early(f"hybridrl variant {name}", extra[name])
            trl = {"skipped": missing} if missing else run_in_subprocess("trl", args, model_dir)
        else:  # CPU: no memory figures to keep apart, so one process is enough (and faster for CI)
            run = lambda items, prof=0: run_half("hybridrl", w, model_dir, prompts[: w.prompts * args.steps * 2], args.steps, device, items, prof, args.trace if prof else None, checkpointing)  # noqa: E731
            h = run(args.set, args.profile)
            extra = {name: run(args.set + items) for name, items in variants}
            trl = {"skipped": missing} if missing else run_half("trl", w, model_dir, prompts[: w.prompts * args.trl_steps * 2], args.trl_steps, device,
                                                                checkpointing=checkpointing)  # fmt: skip
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    limits = device_limits(device_name) if device == "cuda" and "num_params" in h else None
    bound = physical_bound_s(w, h["num_params"], h["weight_bytes"], limits) if limits else None
    result = summarise(w, h, trl, bound)
    result["variants"] = {name: summarise(w, v, trl, bound) for name, v in extra.items()}
    for r in (result, *result["variants"].values()):
        r["gradient_checkpointing"] = args.gradient_checkpointing if device == "cuda" else None
        r["host_delay_ms"] = args.host_delay_ms  # hybridrl's host slept this long before each training micro-batch
        r["device"] = device_name
        if limits:
            r["physical_bound_limits"] = limits
    print_table(result)
    for name, v in result["variants"].items():
        print(f"\n--- variant {name}: {' '.join(v['hybridrl'].get('overrides', []))}")
        print_table(v)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o)))
    return result


if __name__ == "__main__":
    main()
