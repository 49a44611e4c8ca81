"""Generation: the `RolloutEngine` facade and its backends (`hf`, `native`)."""

from hybridrl.rollout.engine import BACKENDS, RolloutEngine, register_backend
from hybridrl.rollout.types import GeneratedSequence, GenerationRequest, RolloutSample

__all__ = ["BACKENDS", "GeneratedSequence", "GenerationRequest", "RolloutEngine", "RolloutSample", "register_backend"]
