"""`TrainerEngine`: builds the workers, runs the driver loop, saves and resumes.

    trainer = TrainerEngine(actor=engine, reward_fn=reward, algorithm="grpo", config=cfg)
    trainer.fit("data/train.jsonl")
"""

from __future__ import annotations

import copy
import logging
import random
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import yaml

from hybridrl.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointState,
    capture_rng,
    load_model_weights,
    restore_rng,
)
from hybridrl.config import Config, ConfigError, algorithm_spec, diff_configs, to_dict, validate_config
from hybridrl.data import StatefulLoader, load_prompt_dataset
from hybridrl.metrics import ConsoleProgress, JsonlSink, PhaseTimer, memory_metrics
from hybridrl.models import load_critic
from hybridrl.rollout import RolloutEngine
from hybridrl.train.offline import get_offline_algorithm
from hybridrl.train.optim import build_optimizer, build_scheduler
from hybridrl.train.policy import PolicyTrainer
from hybridrl.train.update import NonFiniteLossError
from hybridrl.train.value import ValueTrainer
from hybridrl.trainer.evaluation import evaluate, evaluate_offline
from hybridrl.trainer.offline_step import offline_step
from hybridrl.trainer.rl_step import rl_step

log = logging.getLogger("hybridrl.trainer")


class TrainerEngine:
    """The driver of a training run on one process: RL (PPO, GRPO, RLOO, REINFORCE++) or offline (SFT, DPO, KTO)."""

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
        self.optimizer = build_optimizer(self.model, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, betas=cfg.train.adam_betas, eps=cfg.train.adam_eps)
        self.scheduler = self._scheduler(self.optimizer)
        self.ref_model = None
        self.critic = None
        self.critic_trainer = None
        if self.spec.kind == "rl":
            self._setup_rl(reward_fn, critic)
        else:
            self.offline_algorithm = get_offline_algorithm(cfg.algorithm.name, cfg, self.tokenizer)
            if self.offline_algorithm.needs_reference:
                self.ref_model = frozen_copy(self.model)

        self.output_dir = Path(cfg.trainer.output_dir)
        self.checkpoints = CheckpointManager(self.output_dir / "checkpoints", keep_last=cfg.trainer.keep_last)
        self.metrics = JsonlSink(self.output_dir / "metrics.jsonl")
        self.timer = PhaseTimer(self.device)
        self.step = 0
        self.counters = {"response_tokens": 0, "tokens": 0, "skipped_updates": 0, "consecutive_skips": 0}
        self.loader: StatefulLoader | None = None
        self._resume_from: Path | None = None
        self._resume_checked = False

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
        self.policy_trainer = PolicyTrainer(self.model, self.optimizer, self.scheduler, cfg.train, cfg.algorithm, temperature=cfg.rollout.temperature)
        if self.spec.needs_critic or critic is not None:
            self.critic = self._load_critic(critic)
            c_opt = build_optimizer(self.critic, lr=cfg.train.critic_lr, weight_decay=cfg.train.weight_decay, betas=cfg.train.adam_betas, eps=cfg.train.adam_eps)
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
        (a checkpoint is written first).
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
        if eval_data is not None:
            summary["eval_before"] = self.evaluate(eval_data)
        try:
            while self.step < cfg.train.total_steps:
                record = self.train_step(self.loader.next_batch())
                if eval_data is not None and cfg.trainer.eval_every and self.step % cfg.trainer.eval_every == 0:
                    record |= {f"eval/{k}": v for k, v in self.evaluate(eval_data).items()}
                self.metrics.write(record)
                progress.update(record)
                stop = stop_when is not None and stop_when(record)
                if cfg.trainer.save_every and (self.step % cfg.trainer.save_every == 0 or self.step == cfg.train.total_steps or stop):
                    self.save_checkpoint()
                if stop:
                    break
        finally:
            progress.close()
        if eval_data is not None:
            summary["eval_after"] = self.evaluate(eval_data)
        summary |= {"steps": self.step, "output_dir": str(self.output_dir), "metrics": str(self.metrics.path),
                    "checkpoint": str(self.checkpoints.latest_intact() or "")}
        return summary

    def train_step(self, prompts) -> dict[str, Any]:
        """One step (rl_step.py or offline_step.py) turned into one step record."""
        with self.timer.phase("step"):
            result = rl_step(self, prompts) if self.spec.kind == "rl" else offline_step(self, prompts)
        self.step += 1
        times = self.timer.pop()
        n_resp, n_tok = result.pop("_num_response_tokens"), result.pop("_num_tokens")
        self.counters["response_tokens"] += n_resp
        self.counters["tokens"] += n_tok
        skipped = result.pop("train/skipped_updates")
        self._track_skips(skipped)
        step_time = times["timing/step"]
        return {
            "step": self.step,
            **result,
            **times,
            "train/skipped_steps": self.counters["skipped_updates"],
            "perf/tokens_per_s": n_resp / step_time,
            "perf/total_tokens_per_s": n_tok / step_time,
            "perf/total_response_tokens": self.counters["response_tokens"],
            **({"actor/kl": result.get("actor/kl")} if self.spec.kind == "rl" else {}),
            **memory_metrics(self.device),
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

    def evaluate(self, eval_data) -> dict[str, float]:
        if self.spec.kind == "rl":
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
        }
        ckpt = CheckpointState(step=self.step, models=models, tensors=tensors, state=state, config=to_dict(self.config))
        try:
            return self.checkpoints.save(ckpt)
        except CheckpointError as e:
            if self.config.trainer.continue_on_save_error:
                log.error("%s -- continuing (trainer.continue_on_save_error=true)", e)
                return None
            raise

    def resume_from_checkpoint(self, path: str | Path | None = None) -> None:
        """Resume from `path`, or from the latest intact checkpoint of the run when None.

        The weights, optimizer, scheduler and counters are restored now; the data-loader position
        is restored when `fit` builds the loader.
        """
        target = self.checkpoints.resolve(str(path) if path is not None else "auto")
        if target is None:
            raise CheckpointError(f"no intact checkpoint under {self.checkpoints.root} to resume from")
        self._load(target)

    def _maybe_resume(self) -> None:
        if self._resume_from is not None:  # resume_from_checkpoint() already loaded the weights
            self.loader.load_state_dict(self._resume_state["loader"])
            return
        target = self.checkpoints.resolve(self.config.trainer.resume)
        if target is None:
            if self.metrics.path.exists():
                self.metrics.truncate_after(0)
            return
        self._load(target)
        self.loader.load_state_dict(self._resume_state["loader"])

    def _load(self, target: Path) -> None:
        saved_config = CheckpointManager.load_config(target)
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
                raise CheckpointError(f"checkpoint {target} has no critic/ but this run trains one ({self.config.algorithm.name}); resume a {self.config.algorithm.name} run's checkpoint")
            load_model_weights(self.critic, target / "critic")
            self.critic_trainer.optimizer.load_state_dict(CheckpointManager.load_tensors(target, "critic_optimizer"))
            self.critic_trainer.scheduler.load_state_dict(CheckpointManager.load_tensors(target, "critic_scheduler"))
        state = CheckpointManager.load_state(target)
        self.step = state["step"]
        self.counters = state["counters"]
        restore_rng(state["rng"])
        self._resume_state = state
        self._resume_from = target
        dropped = self.metrics.truncate_after(self.step)
        log.warning("resumed from %s at step %d%s", target, self.step, f" ({dropped} later metric records dropped)" if dropped else "")

    def _write_run_config(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(self.config), sort_keys=False), encoding="utf-8")


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
    """The reward section as an engine; reward.timeout_s is the default for every entry."""
    from hybridrl.reward import RewardEngine

    entries = [dict(e) for e in cfg.reward.functions]
    if cfg.reward.timeout_s is not None:
        entries = [{"timeout_s": cfg.reward.timeout_s, **e} for e in entries]
    return RewardEngine.from_spec(entries)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model).eval().requires_grad_(False)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
