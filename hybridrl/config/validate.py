"""Cross-field checks, run once when a config is loaded. Each error names the fix."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from hybridrl.config.loading import ConfigError
from hybridrl.config.schema import Config


@dataclass(frozen=True)
class AlgorithmSpec:
    """What an algorithm name means: how it trains and its default advantage estimator."""

    kind: str  # "rl" (rollout + reward + update) or "offline" (a fixed dataset)
    advantage: str | None = None  # default advantage estimator for RL algorithms
    needs_critic: bool = False  # PPO with a learned value function


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "ppo": AlgorithmSpec("rl", "gae", needs_critic=True),
    "grpo": AlgorithmSpec("rl", "grpo"),
    "dr_grpo": AlgorithmSpec("rl", "grpo"),
    "rloo": AlgorithmSpec("rl", "rloo"),
    "reinforce_pp": AlgorithmSpec("rl", "reinforce_pp"),
    "reinforce_pp_baseline": AlgorithmSpec("rl", "reinforce_pp_baseline"),
    "dpo": AlgorithmSpec("offline"),
    "kto": AlgorithmSpec("offline"),
    "sft": AlgorithmSpec("offline"),
    "rm": AlgorithmSpec("offline"),
}

ADVANTAGES = ("gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "low_var_kl")
MASTER_WEIGHTS = ("fp32", "compensated", "none")  # train.master_weights, see hybridrl.train.precision


def algorithm_spec(name: str) -> AlgorithmSpec:
    if name not in ALGORITHMS:
        raise ConfigError(f"algorithm.name {name!r} is not known{_suggest(name, ALGORITHMS)}; choose one of {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def validate_config(cfg: Config, *, require_paths: bool = True) -> None:
    """Raises ConfigError naming the fix. `require_paths=False` for the Python API, where the
    model and dataset may be passed as objects rather than paths."""
    spec = algorithm_spec(cfg.algorithm.name)
    if cfg.trainer.resume == "on":
        cfg.trainer.resume = "auto"
    _check_choice("model.dtype", cfg.model.dtype, ("auto", "float32", "bfloat16", "float16"))
    _check_choice("data.on_bad_row", cfg.data.on_bad_row, ("error", "drop"))
    _check_choice("rollout.backend", cfg.rollout.backend, ("auto", "native", "hf"))
    _check_choice("algorithm.kl_estimator", cfg.algorithm.kl_estimator, KL_ESTIMATORS)
    _check_choice("algorithm.loss_agg", cfg.algorithm.loss_agg, LOSS_AGGS)
    _check_choice("train.lr_schedule", cfg.train.lr_schedule, ("constant", "cosine"))
    _check_choice("train.packing", cfg.train.packing, ("auto", "on", "off"))
    _check_choice("train.packed_attention", cfg.train.packed_attention, ("auto", "flash", "flex", "triton", "triton_full", "fa4", "cudnn", "cudnn_full"))
    _check_choice("train.master_weights", cfg.train.master_weights, MASTER_WEIGHTS)
    layers = cfg.model.gradient_checkpointing_layers
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
            raise ConfigError(f"model.gradient_checkpointing_layers must be a number of decoder layers (>= 0) or null for all, got {layers!r}")
        if not cfg.model.gradient_checkpointing:
            raise ConfigError("model.gradient_checkpointing_layers is set but model.gradient_checkpointing is off: "
                              "set model.gradient_checkpointing=true, or leave model.gradient_checkpointing_layers unset")  # fmt: skip
    if cfg.train.master_weights == "compensated" and cfg.model.dtype == "float16":
        raise ConfigError("train.master_weights=compensated needs a bfloat16 model, but model.dtype is float16: use model.dtype=bfloat16 or train.master_weights=fp32")
    if cfg.algorithm.advantage is not None:
        _check_choice("algorithm.advantage", cfg.algorithm.advantage, ADVANTAGES)
    if require_paths and not cfg.model.path:
        raise ConfigError("model.path is empty: set it to a HF Hub id or a local model directory, e.g. model.path=hybridrl/assets/tiny-arith")
    if require_paths and not cfg.data.train_path:
        raise ConfigError("data.train_path is empty: set it to a .jsonl, .json or .parquet file of training rows")

    _positive("train.total_steps", cfg.train.total_steps)
    _positive("train.batch_size", cfg.train.batch_size)
    _positive("train.micro_batch_size", cfg.train.micro_batch_size)
    _non_negative("train.max_tokens_per_micro_batch", cfg.train.max_tokens_per_micro_batch or 0)
    _non_negative("train.max_tokens_per_forward", cfg.train.max_tokens_per_forward or 0)
    _positive("train.ppo_epochs", cfg.train.ppo_epochs)
    _positive("train.compile_layers_per_graph", cfg.train.compile_layers_per_graph)
    if cfg.train.num_threads is not None and cfg.train.num_threads < 1:
        raise ConfigError(f"train.num_threads must be at least 1, got {cfg.train.num_threads}; leave it unset (null) for the default")
    _positive("rollout.n", cfg.rollout.n)
    _positive("rollout.max_tokens", cfg.rollout.max_tokens)
    _positive("data.max_prompt_length", cfg.data.max_prompt_length)
    _non_negative("train.lr", cfg.train.lr)
    _non_negative("train.critic_lr", cfg.train.critic_lr)
    _non_negative("train.weight_decay", cfg.train.weight_decay)
    _non_negative("train.grad_clip", cfg.train.grad_clip)
    _non_negative("train.warmup_steps", cfg.train.warmup_steps)
    _non_negative("algorithm.kl_coef", cfg.algorithm.kl_coef)
    _non_negative("algorithm.entropy_coef", cfg.algorithm.entropy_coef)
    _non_negative("rollout.temperature", cfg.rollout.temperature)
    _non_negative("trainer.save_every", cfg.trainer.save_every)
    _positive("trainer.keep_last", cfg.trainer.keep_last)
    _non_negative("trainer.preemption_grace_s", cfg.trainer.preemption_grace_s)
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p must be in (0, 1], got {cfg.rollout.top_p}")
    if not 0 <= cfg.train.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {cfg.train.min_lr_ratio}")
    if not 0 < cfg.rollout.kv_cache_fraction < 1:
        raise ConfigError(f"rollout.kv_cache_fraction must be in (0, 1), got {cfg.rollout.kv_cache_fraction}")
    if cfg.algorithm.dual_clip is not None and cfg.algorithm.dual_clip <= 1:
        raise ConfigError(f"algorithm.dual_clip must be greater than 1 (e.g. 3.0), got {cfg.algorithm.dual_clip}; set it to null to disable")
    if not 0 <= cfg.algorithm.clip_low < 1:
        raise ConfigError(f"algorithm.clip_low must be in [0, 1), got {cfg.algorithm.clip_low}")
    _non_negative("algorithm.clip_high", cfg.algorithm.clip_high)

    if spec.kind == "rl":
        _check_rl_batches(cfg)
        group_based = (cfg.algorithm.advantage or spec.advantage) in ("grpo", "rloo", "reinforce_pp_baseline")
        if group_based and cfg.rollout.n < 2:
            raise ConfigError(f"algorithm {cfg.algorithm.name} compares the responses of one prompt, so rollout.n must be at least 2 (got {cfg.rollout.n}); e.g. rollout.n=8")
        if (cfg.algorithm.advantage or spec.advantage) == "gae" and not spec.needs_critic:
            raise ConfigError("algorithm.advantage=gae needs a critic: use algorithm.name=ppo")
        if cfg.rollout.max_tokens + cfg.data.max_prompt_length > 1_000_000:
            raise ConfigError("rollout.max_tokens + data.max_prompt_length is implausibly large; lower them")
        if not cfg.reward.functions and not cfg.model.reward_model_path:
            raise ConfigError("no reward: set reward.functions (e.g. [{name: arith}]) or model.reward_model_path")
    if cfg.reward.timeout_s is not None and cfg.reward.timeout_s <= 0:
        raise ConfigError(f"reward.timeout_s must be positive or null, got {cfg.reward.timeout_s}")
    _non_negative("reward.num_workers", cfg.reward.num_workers)
    _positive("reward.model_max_batch_tokens", cfg.reward.model_max_batch_tokens)
    if cfg.reward.model_clip is not None and cfg.reward.model_clip <= 0:
        raise ConfigError(f"reward.model_clip must be positive or null, got {cfg.reward.model_clip}")


def _check_rl_batches(cfg: Config) -> None:
    t, n = cfg.train, cfg.rollout.n
    if t.batch_size % n:
        raise ConfigError(
            f"train.batch_size ({t.batch_size}) must be divisible by rollout.n ({n}): every prompt yields n responses; "
            f"e.g. train.batch_size={max(n, t.batch_size // n * n)}"
        )
    mini = t.mini_batch_size or t.batch_size
    if mini <= 0 or t.batch_size % mini:
        raise ConfigError(f"train.batch_size ({t.batch_size}) must be divisible by train.mini_batch_size ({mini}); e.g. train.mini_batch_size={t.batch_size}")
    if mini % t.micro_batch_size and not t.max_tokens_per_micro_batch:  # a token budget replaces the count
        raise ConfigError(
            f"train.mini_batch_size ({mini}) must be divisible by train.micro_batch_size ({t.micro_batch_size}); "
            f"e.g. train.micro_batch_size={_largest_divisor(mini, t.micro_batch_size)}"
        )


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} is {value!r}{_suggest(value, choices)}; choose one of {', '.join(choices)}")


def _suggest(value: str, choices) -> str:
    close = difflib.get_close_matches(str(value), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{key} must be positive, got {value}")


def _non_negative(key: str, value: float) -> None:
    if value < 0:
        raise ConfigError(f"{key} must not be negative, got {value}")
