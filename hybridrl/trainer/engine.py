"""`TrainerEngine`: builds the workers, runs the driver loop, saves and resumes.

    trainer = TrainerEngine(actor=engine, reward_fn=reward, algorithm="grpo", config=cfg)
    trainer.fit("data/train.jsonl")
"""

from __future__ import annotations

import copy
import logging
import os
import random
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.utils.deterministic
import yaml

from hybridrl import failpoints
from hybridrl.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointState,
    capture_rng,
    load_model_weights,
    restore_rng,
)
from hybridrl.config import Config, ConfigError, algorithm_spec, diff_configs, to_dict, validate_config
from hybridrl.config.loading import upgrade_deprecated_keys
from hybridrl.data import StatefulLoader, load_prompt_dataset
from hybridrl.metrics import CompileClock, ConsoleProgress, GcClock, JsonlSink, MetricsWriteError, PhaseTimer, memory_metrics
from hybridrl.models import load_critic
from hybridrl.rollout import RolloutEngine
from hybridrl.train import oom
from hybridrl.train.offline import get_offline_algorithm
from hybridrl.train.optim import build_optimizer, build_scheduler
from hybridrl.train.attention import enable_packed_attention
from hybridrl.train.policy import PolicyTrainer
from hybridrl.train.optim_offload import OffloadedOptimizerState
from hybridrl.train.reference import OffloadedWeights
from hybridrl.train.setup import compile_layers, prepare_for_training
from hybridrl.train.update import NonFiniteLossError
from hybridrl.train.value import ValueTrainer
from hybridrl.trainer.evaluation import evaluate, evaluate_offline
from hybridrl.trainer.offline_step import offline_step
from hybridrl.trainer.preemption import PreemptionHandler, StepAbandoned, StepJournal
from hybridrl.trainer.rl_step import rl_step

log = logging.getLogger("hybridrl.trainer")


def set_host_threads(num_threads: int | None, device: torch.device) -> int:
    """Sets torch's intra-op threads for this process (`train.num_threads`) and returns the count.

    Unset, a CPU run keeps torch's default, and a GPU run uses one thread. On a GPU, the host's share
    of a step is many small tensor ops: packed layouts, row indices, masks. A pool of threads makes
    such ops slower, because it has to be woken for each one. One H200 host (16 cores,
    `torch.get_num_threads()` 16): an op on a [256, 768] tensor took 0.1 ms at the median but up to
    17 ms with the pool, and at most 0.35 ms on one thread. The W0.5B reference phase, which lays
    out its micro-batches while the GPU waits, went from 0.365-0.404 s to 0.312-0.321 s per step.
    torchrun starts each worker with one thread for the same reason."""
    if num_threads is None:
        if device.type == "cpu":
            return torch.get_num_threads()
        num_threads = 1
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
        log.info("torch intra-op threads: %d (train.num_threads)", num_threads)
    return num_threads


_workspace_warned = False


def set_determinism(deterministic: bool) -> None:
    """`train.deterministic`: the process runs deterministic kernels from here on. On a GPU the
    packed rows' FlashAttention backward accumulates dQ with atomic adds, and so does `index_add_`
    for the gradient of the prompt keys that each response attends to, so two runs of the same
    config differ in the last bits from the first update on (seen on an H200: 42 of the tiny
    model's 51 tensors after four steps) and a resumed run cannot continue the straight one bit
    for bit. torch's deterministic mode switches the attention to its ordered form; the packed
    layouts of forwards with gradients then carry a table of each key's copies, and the keys'
    gradient is their ordered sum (train/attention.py, gather_rows) rather than the sorted
    `index_put_` torch would put in index_add_'s place (~9,700 more kernel launches a W0.5B step,
    in a phase bound by its host's launches). Off, torch's setting is left as the caller made it.

    `CUBLAS_WORKSPACE_CONFIG` is not set here. cuBLAS needs it for bitwise-equal results only when
    one handle runs on several streams with cuBLAS's own workspace pool; torch gives each (handle,
    stream) pair a workspace of its own, and torch 2.11 (the oldest this project supports) runs every
    product under the deterministic mode without the variable (fp32, fp64, bf16 mm and bmm checked on
    an H200). Setting it is not free there: with it, a product's host time went from ~15-40 us to
    ~55-100 us, and an addmm with a bias to ~130-200 us (train/NOTES.md, session 31; some torch
    versions parse the variable, with a regular expression, each time a cuBLAS handle is fetched,
    which is every product, and torch 2.11 has no call to set the size instead). The training
    phase's GPU then waited on its host: with the variable set, the deterministic mode cost W0.5B
    0.33-0.34 s a step; without it, 0.14 s. A value the caller set is left as it is, and named in a
    warning on torch 2.11.

    torch's deterministic mode also fills every new uninitialised tensor with NaN
    (`torch.utils.deterministic.fill_uninitialized_memory`), for code that reads memory it never
    wrote. That is switched off here: hybridrl's kernels write what they read, and the fill is one
    more kernel for each `torch.empty`, captured into every CUDA graph too (W0.5B on an H200: the
    decode loop 0.988 s with it against 0.825 s with the mode off).

    W0.5B on an H200 (train/NOTES.md, sessions 28-31), each against the mode off in the same call:
    with the sorted index_put_ the step took 2.97-3.04 s against 2.37-2.44 s (training phase
    1.760-1.820 against 1.166-1.202 s); with the ordered sum and CUBLAS_WORKSPACE_CONFIG set 2.61-2.75
    s against 2.38-2.42 s (1.374-1.533 against 1.184-1.201 s); with the ordered sum and the variable
    not set 2.56 s (2.493, 2.623) against 2.42 s (1.273-1.393 against 1.201-1.218 s)."""
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False
    global _workspace_warned
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if workspace and not _workspace_warned and torch.__version__.startswith("2.11.") and torch.cuda.is_available():
        _workspace_warned = True  # once a process (`hybridrl train` sets up before the trainer does too)
        log.warning("CUBLAS_WORKSPACE_CONFIG=%s is set: with torch 2.11 it adds ~40-150 us of host time to every cuBLAS "
                    "product (W0.5B on an H200, train.deterministic on: ~0.2 s a step). hybridrl does not need it, that option included; "
                    "unset it unless something else in this process does", workspace)  # fmt: skip


class TrainerEngine:
    """The driver of a training run on one process: RL (PPO, GRPO, RLOO, REINFORCE++) or offline (SFT, DPO, KTO, RM).

    `actor` is the policy's RolloutEngine; for `algorithm="rm"` it is the reward model to train
    (`hybridrl.reward.model.TrainableRewardModel`).
    """

    def __init__(
        self,
        actor: RolloutEngine,
        reward_fn: Any = None,
        critic: torch.nn.Module | str | None = None,
        algorithm: str | None = None,
        config: Config | None = None,
    ):
        self.config = config if config is not None else Config()
        if algorithm is not None:
            self.config.algorithm.name = algorithm
        if not self.config.model.path and getattr(actor, "path", None):
            self.config.model.path = actor.path
        self.spec = algorithm_spec(self.config.algorithm.name)
        validate_config(self.config, require_paths=False)
        cfg = self.config
        seed_everything(cfg.train.seed)
        self.rollout = actor
        self.model = actor.model
        self.tokenizer = actor.tokenizer
        self.device = actor.device
        set_host_threads(cfg.train.num_threads, self.device)
        set_determinism(cfg.train.deterministic)
        # Before the reference is copied from it: the copy shares the attention setup.
        self.packed = prepare_for_training(
            self.model, cfg.train, gradient_checkpointing=cfg.model.gradient_checkpointing,
            checkpointed_layers=cfg.model.gradient_checkpointing_layers,
        )  # fmt: skip
        self.optimizer = build_optimizer(self.model, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, betas=cfg.train.adam_betas, eps=cfg.train.adam_eps, master_weights=cfg.train.master_weights)
        self.scheduler = self._scheduler(self.optimizer)
        self.optimizer_offloads: list[OffloadedOptimizerState] = []
        self.ref_model = None
        self.ref_offload: OffloadedWeights | None = None
        self.critic = None
        self.critic_trainer = None
        if self.spec.kind == "rl":
            self._setup_rl(reward_fn, critic)
        else:
            self.offline_algorithm = get_offline_algorithm(cfg.algorithm.name, cfg, self.tokenizer)
            if self.offline_algorithm.needs_reference:
                self.ref_model = frozen_copy(self.model)
        if cfg.train.compile:
            per_graph = cfg.train.compile_layers_per_graph
            if per_graph > 1 and not self.packed:
                raise ConfigError("train.compile_layers_per_graph > 1 applies to packed rows, and this run does not pack "
                                 "(train.packing): set train.packing=on, or train.compile_layers_per_graph=1")  # fmt: skip
            for module in (self.model, self.ref_model):
                if module is not None:
                    compile_layers(module, per_graph, dynamic_tokens=cfg.train.compile_dynamic)
            if self.critic is not None:  # values run through the critic's own forward: per-layer graphs
                compile_layers(self.critic, 1)
        if cfg.train.offload_optimizer:
            if self.device.type == "cuda":
                optimizers = [self.optimizer] + ([self.critic_trainer.optimizer] if self.critic_trainer is not None else [])
                self.optimizer_offloads = [OffloadedOptimizerState(opt) for opt in optimizers]
            else:
                log.warning("train.offload_optimizer: the model is on %s, where the optimizer state already is in CPU memory; ignored", self.device)

        self.output_dir = Path(cfg.trainer.output_dir)
        self.checkpoints = CheckpointManager(self.output_dir / "checkpoints", keep_last=cfg.trainer.keep_last)
        self.metrics = JsonlSink(self.output_dir / "metrics.jsonl")
        self.timer = PhaseTimer(self.device)
        self.gc_clock = GcClock()  # the Python collector's time inside each step (perf/gc_s)
        self.compile_clock = CompileClock()  # torch.compile's and Triton's compilations inside each step (perf/compile_s)
        self._stepped = False  # this process has run a step (its first compiles; a later one that does is logged)
        self.step = 0
        self.counters = {"response_tokens": 0, "tokens": 0, "skipped_updates": 0, "consecutive_skips": 0}
        self.loader: StatefulLoader | None = None
        self.journal: StepJournal | None = None  # undoes a step abandoned after SIGTERM (set by fit)
        self.rollout_parts = 1  # prompts are generated in this many parts; doubled on out-of-memory
        self._resume_from: Path | None = None
        self._resume_checked = False
        self._saved_step: int | None = None  # the step of the last checkpoint written or loaded
        self._unwritten_records: list[dict[str, Any]] = []  # held after a failed metrics write

    # ---- setup helpers ---------------------------------------------------------------------
    def _setup_rl(self, reward_fn, critic) -> None:
        cfg = self.config
        self.reward = as_reward_engine(reward_fn, cfg)
        self.advantage_name = cfg.algorithm.advantage or self.spec.advantage
        mini = cfg.train.mini_batch_size or cfg.train.batch_size
        self.on_policy = cfg.train.ppo_epochs == 1 and mini == cfg.train.batch_size
        # The reference is a frozen copy of the initial policy; none is kept when KL is off.
        if cfg.algorithm.kl_coef > 0:
            self.ref_model = frozen_copy(self.model)
            if cfg.train.offload_reference:
                self.ref_offload = OffloadedWeights(self.ref_model, streamed=cfg.train.stream_reference)
        self.policy_trainer = PolicyTrainer(self.model, self.optimizer, self.scheduler, cfg.train, cfg.algorithm, temperature=cfg.rollout.temperature)
        if self.spec.needs_critic or critic is not None:
            self.critic = self._load_critic(critic)
            if self.packed:
                enable_packed_attention(self.critic, cfg.train.packed_attention)
            c_opt = build_optimizer(self.critic, lr=cfg.train.critic_lr, weight_decay=cfg.train.weight_decay, betas=cfg.train.adam_betas, eps=cfg.train.adam_eps, master_weights=cfg.train.master_weights)
            self.critic_trainer = ValueTrainer(self.critic, c_opt, self._scheduler(c_opt), cfg.train, cfg.algorithm)

    def _scheduler(self, optimizer):
        t = self.config.train
        return build_scheduler(optimizer, warmup_steps=t.warmup_steps, total_steps=t.total_steps, schedule=t.lr_schedule, min_lr_ratio=t.min_lr_ratio)

    def _load_critic(self, critic) -> torch.nn.Module:
        if isinstance(critic, torch.nn.Module):
            return critic.to(self.device)
        path = critic or self.config.model.critic_path or self.config.model.path
        if not path:
            raise ConfigError("PPO needs a critic: pass critic= or set model.critic_path (or model.path to start it from the policy)")
        model = load_critic(path, dtype=self.config.model.dtype, device=self.device, trust_remote_code=self.config.model.trust_remote_code)
        return model

    def step_seed(self) -> int:
        """Sampling seed of the current step: a function of (seed, step) only, so resume is exact."""
        return (self.config.train.seed * 1_000_003 + self.step * 7919) % (2**31 - 1)

    # ---- the driver --------------------------------------------------------------------------
    def fit(self, dataset: Any = None, eval_dataset: Any = None, *, stop_when: Callable[[dict], bool] | None = None) -> dict[str, Any]:
        """Trains for `train.total_steps` steps (continuing from a checkpoint if resuming).

        `stop_when(record)` is called after each step; returning True ends training early
        (a checkpoint is written first). SIGTERM or SIGINT also ends it after the current step
        with a checkpoint (see preemption.py); the summary then names the signal under `preempted`.
        """
        cfg = self.config
        rl = self.spec.kind == "rl"
        source = dataset if dataset is not None else cfg.data.train_path
        train_data = self._prompts(source) if rl else self.offline_algorithm.load(source)
        eval_source = eval_dataset if eval_dataset is not None else cfg.data.eval_path
        eval_data = None
        if eval_source:
            eval_data = self._prompts(eval_source) if rl else self.offline_algorithm.load(eval_source)
        per_step = cfg.train.batch_size // cfg.rollout.n if rl else cfg.train.batch_size
        if per_step > len(train_data):
            raise ConfigError(
                f"each step needs {per_step} {'prompts' if rl else 'examples'} (train.batch_size {cfg.train.batch_size}"
                f"{f' / rollout.n {cfg.rollout.n}' if rl else ''}) but the dataset has only {len(train_data)}; lower train.batch_size or add data"
            )
        self.loader = StatefulLoader(train_data, per_step, shuffle=cfg.data.shuffle, seed=cfg.train.seed)
        self._maybe_resume()
        self._write_run_config()

        progress = ConsoleProgress(cfg.train.total_steps, initial=self.step, enabled=cfg.trainer.progress, desc=cfg.algorithm.name)
        summary: dict[str, Any] = {"start_step": self.step}
        self.journal = StepJournal(self.loader, self._optimizers_and_schedulers())
        # SIGTERM/SIGINT: finish (or, past the grace period, undo) the step, save, return.
        preemption = PreemptionHandler(cfg.trainer.preemption_grace_s, can_abandon=self.journal.can_undo)
        try:
            with preemption:
                if eval_data is not None:
                    summary["eval_before"] = self.evaluate(eval_data)
                self._train_loop(eval_data, stop_when, progress, preemption)
                if preemption.requested:
                    summary["preempted"] = preemption.signal_name
                    self._save_after_preemption()
        finally:
            progress.close()
            self.journal.close()
            self.journal = None
            self.gc_clock.unfreeze()  # the run's objects go back to the collector (a trainer dropped later is freed)
        if eval_data is not None and not preemption.requested:
            summary["eval_after"] = self.evaluate(eval_data)
        summary |= {"steps": self.step, "output_dir": str(self.output_dir), "metrics": str(self.metrics.path),
                    "checkpoint": str(self.checkpoints.latest_intact() or "")}
        return summary

    def _train_loop(self, eval_data, stop_when, progress: ConsoleProgress, preemption: PreemptionHandler) -> None:
        cfg = self.config
        while self.step < cfg.train.total_steps and not preemption.requested:
            try:
                self.journal.begin()  # data position, RNG and LR schedules, to undo an abandoned step
                record = self.train_step(self.loader.next_batch())
            except StepAbandoned as e:
                self.journal.undo()
                self.timer.pop()
                self.gc_clock.pop()
                self.compile_clock.pop()
                log.warning("step %d abandoned (%s); it is redone on resume", self.step + 1, e)
                return
            if eval_data is not None and cfg.trainer.eval_every and self.step % cfg.trainer.eval_every == 0:
                record |= {f"eval/{k}": v for k, v in self.evaluate(eval_data).items()}
            self._write_record(record)
            progress.update(record)
            stop = stop_when is not None and stop_when(record)
            if cfg.trainer.save_every and (self.step % cfg.trainer.save_every == 0 or self.step == cfg.train.total_steps or stop):
                self.save_checkpoint()
            if stop:
                return

    def train_step(self, prompts) -> dict[str, Any]:
        """One step (rl_step.py or offline_step.py) turned into one step record."""
        failpoints.reached("step")
        oom_retries = oom.num_retries()
        try:
            with self.gc_clock, self.compile_clock, self.timer.phase("step"):
                result = rl_step(self, prompts) if self.spec.kind == "rl" else offline_step(self, prompts)
                with self.timer.phase("gc_freeze"):  # in every record (0 mostly), so the phases still sum to the step
                    if self.config.trainer.gc_freeze and (not self._stepped or self.compile_clock.compiled()):
                        self.gc_clock.freeze()  # the long-lived objects exist now: keep later full collections short
        except torch.OutOfMemoryError as e:  # rollout and training micro-batches retry; other passes cannot
            raise oom.OutOfMemoryError("a forward pass (reference / old log-probs / values)") from e
        if self.journal is not None:
            self.journal.finish()  # an optimizer whose updates were all skipped keeps its LR schedule
        self.step += 1
        times = self.timer.pop()
        n_resp, n_tok = result.pop("_num_response_tokens"), result.pop("_num_tokens")
        self.counters["response_tokens"] += n_resp
        self.counters["tokens"] += n_tok
        skipped = result.pop("train/skipped_updates")
        self._track_skips(skipped)
        step_time = times["timing/step"]
        compiles = self.compile_clock.pop()
        if self._stepped and compiles["perf/compile_s"] > 0:
            log.info("step %d spent %.2f s of its %.2f s compiling: %s", self.step, compiles["perf/compile_s"], step_time,
                     ", ".join(self.compile_clock.names))  # fmt: skip
        self._stepped = True
        return {
            "step": self.step,
            **result,
            **times,
            "train/skipped_steps": self.counters["skipped_updates"],
            "train/oom_retries": oom.num_retries() - oom_retries,
            "perf/tokens_per_s": n_resp / step_time,
            "perf/total_tokens_per_s": n_tok / step_time,
            "perf/total_response_tokens": self.counters["response_tokens"],
            **self.gc_clock.pop(),
            **compiles,
            **({"actor/kl": result.get("actor/kl")} if self.spec.kind == "rl" else {}),
            **memory_metrics(self.device, self.timer),
        }

    def _track_skips(self, skipped: int) -> None:
        self.counters["skipped_updates"] += skipped
        self.counters["consecutive_skips"] = self.counters["consecutive_skips"] + 1 if skipped else 0
        if skipped:
            log.warning("step %d: NaN/inf in the gradients, %d update(s) skipped (optimizer untouched)", self.step, skipped)
        limit = self.config.train.max_skipped_steps
        if self.counters["consecutive_skips"] >= limit:
            raise NonFiniteLossError(
                f"{limit} consecutive steps had NaN/inf losses or gradients, so training stopped (train.max_skipped_steps). "
                "Lower train.lr, check the reward for extreme values, or enable train.grad_clip; resume from the last checkpoint."
            )

    def _write_record(self, record: dict[str, Any]) -> None:
        """Appends the step record; with trainer.continue_on_save_error, a failed write is kept and retried next step."""
        self._unwritten_records.append(record)
        self._flush_records()

    def _flush_records(self) -> None:
        try:
            while self._unwritten_records:
                self.metrics.write(self._unwritten_records[0])
                self._unwritten_records.pop(0)
        except MetricsWriteError as e:
            if not self.config.trainer.continue_on_save_error:
                raise
            log.error("%s -- continuing (trainer.continue_on_save_error=true); %d record(s) held until a write succeeds",
                      e, len(self._unwritten_records))

    def _optimizers_and_schedulers(self) -> list[tuple[torch.optim.Optimizer, Any]]:
        pairs = [(self.optimizer, self.scheduler)]
        if self.critic_trainer is not None:
            pairs.append((self.critic_trainer.optimizer, self.critic_trainer.scheduler))
        return pairs

    def evaluate(self, eval_data) -> dict[str, float]:
        if self.spec.kind == "rl":
            with self.reward.frozen_state():  # e.g. reward-model running statistics: training data only
                return evaluate(self, eval_data)
        return evaluate_offline(self, eval_data)

    def _prompts(self, source):
        if hasattr(source, "examples") and hasattr(source, "source_name"):
            return source  # already a PromptDataset
        d = self.config.data
        return load_prompt_dataset(source, self.tokenizer, prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length, on_bad_row=d.on_bad_row)

    # ---- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        models = {"model": (self.model, self.tokenizer)}
        tensors = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.critic is not None:
            models["critic"] = (self.critic, self.tokenizer)
            tensors["critic_optimizer"] = self.critic_trainer.optimizer.state_dict()
            tensors["critic_scheduler"] = self.critic_trainer.scheduler.state_dict()
        state = {
            "step": self.step,
            "counters": self.counters,
            "loader": self.loader.state_dict() if self.loader is not None else None,
            "rng": capture_rng(),
            "reward": self.reward.state_dict() if self.spec.kind == "rl" else {},
        }
        ckpt = CheckpointState(step=self.step, models=models, tensors=tensors, state=state, config=to_dict(self.config))
        try:
            path = self.checkpoints.save(ckpt)
            self._saved_step = self.step
            return path
        except CheckpointError as e:
            if self.config.trainer.continue_on_save_error:
                log.error("%s -- continuing (trainer.continue_on_save_error=true)", e)
                return None
            raise

    def _save_after_preemption(self) -> None:
        if self._saved_step != self.step and self.step > 0:
            self.save_checkpoint()
        self._flush_records()

    def resume_from_checkpoint(self, path: str | Path | None = None) -> None:
        """Resume from `path`, or from the latest intact checkpoint of the run when None.

        The weights, optimizer, scheduler and counters are restored now; the data-loader position
        is restored when `fit` builds the loader. The run's checkpoints past that step, and its
        records past it, are moved to `<output_dir>/superseded-<UTC time>/` (see `_supersede`).
        """
        target = self.checkpoints.resolve(str(path) if path is not None else "auto")
        if target is None:
            raise CheckpointError(f"no intact checkpoint under {self.checkpoints.root} to resume from")
        self._load(target)

    def _maybe_resume(self) -> None:
        if self._resume_from is not None:  # resume_from_checkpoint() already loaded the weights
            self._restore_data_position(self._resume_from)
            return
        target = self.checkpoints.resolve(self.config.trainer.resume)
        if target is None:
            # `off` starts over: the earlier run's checkpoints and records are set aside, not lost. Under
            # `auto` there is no checkpoint, so any records are those of a run stopped before its first save.
            self._supersede(0, None, keep_log=self.config.trainer.resume == "off")
            return
        self._load(target)
        self._restore_data_position(target)

    def _restore_data_position(self, target: Path) -> None:
        try:
            self.loader.load_state_dict(self._resume_state["loader"])
        except ValueError as e:
            raise CheckpointError(f"checkpoint {target} does not fit this run's data: {e}") from None

    def _load(self, target: Path) -> None:
        saved_config = upgrade_deprecated_keys(CheckpointManager.load_config(target), warn=False)
        differences = diff_configs(saved_config, to_dict(self.config))
        ignorable = ("trainer.resume", "train.total_steps", "trainer.progress")
        differences = [d for d in differences if not d.startswith(ignorable)]
        if differences:
            log.warning("resuming from %s with a different config:\n  %s", target, "\n  ".join(differences))
        load_model_weights(self.model, target / "model")
        self.optimizer.load_state_dict(CheckpointManager.load_tensors(target, "optimizer"))
        self.scheduler.load_state_dict(CheckpointManager.load_tensors(target, "scheduler"))
        if self.critic is not None:
            if not (target / "critic").is_dir():
                raise CheckpointError(f"checkpoint {target} has no critic/ but this run trains one ({self.config.algorithm.name}); resume a {self.config.algorithm.name} run's checkpoint, or set trainer.resume=off to start over")
            load_model_weights(self.critic, target / "critic")
            self.critic_trainer.optimizer.load_state_dict(CheckpointManager.load_tensors(target, "critic_optimizer"))
            self.critic_trainer.scheduler.load_state_dict(CheckpointManager.load_tensors(target, "critic_scheduler"))
        state = CheckpointManager.load_state(target)
        self.step = state["step"]
        self.counters = state["counters"]
        restore_rng(state["rng"])
        if self.spec.kind == "rl":
            self.reward.load_state_dict(state.get("reward", {}))
        self._resume_state = state
        self._resume_from = target
        self._saved_step = self.step
        dropped = self._supersede(self.step, target)
        log.warning("resumed from %s at step %d%s", target, self.step, f" ({dropped} later metric records dropped)" if dropped else "")

    def _supersede(self, step: int, keep: Path | None, keep_log: bool = False) -> int:
        """Rewinds the run's outputs to `step`; returns how many metric records were dropped, not set aside.

        The checkpoints it will not continue from (CheckpointManager.set_aside) go to
        `<output_dir>/superseded-<UTC time>/checkpoints/`, with the records past `step` beside them
        as `metrics.jsonl`, so rewinding a run (a `trainer.resume` path, `off`, or a damaged newest
        checkpoint) loses nothing. Records past a checkpoint that is simply being resumed after a
        crash are steps about to run again, and are only dropped.
        """
        base = dest = self.output_dir / f"superseded-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        n = 0
        while dest.exists():  # a second rewind within the same second
            n += 1
            dest = base.with_name(f"{base.name}.{n}")
        moved = self.checkpoints.set_aside(step, dest / "checkpoints", keep)
        cut = self.metrics.truncate_after(step, spill=dest / "metrics.jsonl" if moved or keep_log else None)
        if moved or cut.spilled:
            what = [*moved, *([f"metrics.jsonl ({cut.spilled} records past step {step})"] if cut.spilled else [])]
            log.warning("set aside in %s: %s. This run continues from step %d; delete that directory once it is no longer needed",
                        dest, ", ".join(what), step)
        return cut.dropped - cut.spilled

    def _write_run_config(self) -> None:
        path = self.output_dir / "config.yaml"
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump(to_dict(self.config), sort_keys=False), encoding="utf-8")
        except OSError as e:
            raise MetricsWriteError(f"could not write {path}: {e.strerror or e}. Free disk space or choose a writable trainer.output_dir") from e


def as_reward_engine(reward_fn: Any, cfg: Config):
    """Accepts a RewardEngine, a plain function, or None (build from the config's reward section)."""
    from hybridrl.reward import RewardEngine

    if isinstance(reward_fn, RewardEngine):
        return reward_fn
    if callable(reward_fn):
        return RewardEngine.from_fn(reward_fn, timeout_s=cfg.reward.timeout_s)
    if reward_fn is None:
        return reward_from_config(cfg)
    raise TypeError(f"reward_fn must be a RewardEngine or a function fn(prompts, responses, **columns) -> list[float], got {type(reward_fn).__name__}")


def reward_from_config(cfg: Config):
    """The reward section as an engine (reward.timeout_s is the default for every function entry),
    plus the learned reward model of model.reward_model_path if set."""
    from hybridrl.reward import RewardEngine

    r, parts = cfg.reward, []
    if r.functions:
        entries = [dict(e) for e in r.functions]
        if r.timeout_s is not None:
            entries = [{"timeout_s": r.timeout_s, **e} for e in entries]
        parts.append((RewardEngine.from_spec(entries), 1.0))
    if cfg.model.reward_model_path:
        model = RewardEngine.from_hf(
            cfg.model.reward_model_path, offload=r.model_offload, device=cfg.train.device, dtype=cfg.model.dtype,
            normalize=r.model_normalize, clip=r.model_clip, max_batch_tokens=r.model_max_batch_tokens,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        parts.append((model, r.model_weight))
    return parts[0][0] if len(parts) == 1 and parts[0][1] == 1.0 else RewardEngine.mix(parts)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model).eval().requires_grad_(False)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
