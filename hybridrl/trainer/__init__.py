"""The driver loops: RL (PPO, GRPO, RLOO, REINFORCE++) and offline (SFT, DPO, KTO, reward model)."""

from hybridrl.trainer.engine import TrainerEngine

__all__ = ["TrainerEngine"]
