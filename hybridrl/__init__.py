"""hybridrl: reinforcement-learning post-training of language models.

    from hybridrl import RolloutEngine, RewardEngine, TrainerEngine
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Imported on first use, so that `hybridrl --help` and light submodules do not pay for torch.
_PUBLIC = {
    "Config": "hybridrl.config",
    "load_config": "hybridrl.config",
    "RewardEngine": "hybridrl.reward",
    "RolloutEngine": "hybridrl.rollout",
    "TrainerEngine": "hybridrl.trainer",
}
__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'hybridrl' has no attribute {name!r}")
