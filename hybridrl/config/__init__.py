"""Typed configs, YAML loading with dotted overrides, and validation."""

from hybridrl.config.loading import ConfigError, diff_configs, load_config, to_dict
from hybridrl.config.schema import (
    AlgorithmConfig,
    Config,
    DataConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
    TrainerConfig,
)
from hybridrl.config.validate import ALGORITHMS, AlgorithmSpec, algorithm_spec, validate_config

__all__ = [
    "ALGORITHMS", "AlgorithmConfig", "AlgorithmSpec", "Config", "ConfigError", "DataConfig", "ModelConfig",
    "RewardConfig", "RolloutConfig", "TrainConfig", "TrainerConfig", "algorithm_spec", "diff_configs",
    "load_config", "to_dict", "validate_config",
]
