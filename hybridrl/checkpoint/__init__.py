"""Atomic, verified checkpoints with exact resume; export to a HF directory."""

from hybridrl.checkpoint.export import export_checkpoint
from hybridrl.checkpoint.manager import CheckpointError, CheckpointManager, CheckpointState, load_model_weights
from hybridrl.checkpoint.rng import capture_rng, restore_rng

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointState", "capture_rng", "export_checkpoint", "load_model_weights", "restore_rng"]
