"""Rewards: user functions (native or TRL-style), built-in scorers, learned reward models (with
CPU offload), weighted mixes, timeouts, and scoring that overlaps generation.

    reward = RewardEngine.mix([(RewardEngine.from_builtin("gsm8k"), 1.0),
                               (RewardEngine.from_fn(my_fn, timeout_s=5), 0.5),
                               (RewardEngine.from_hf("path/to/reward-model", offload=True), 0.5)])
    result = reward.score(prompts, responses, columns={"ground_truth": answers})
"""

from hybridrl.reward.engine import RewardEngine
from hybridrl.reward.functions import FunctionReward
from hybridrl.reward.scorers import BUILTIN_SCORERS
from hybridrl.reward.streaming import StreamingScorer
from hybridrl.reward.types import RewardComponent, RewardError, RewardResult, StatefulComponent

__all__ = [
    "BUILTIN_SCORERS",
    "FunctionReward",
    "RewardComponent",
    "RewardEngine",
    "RewardError",
    "RewardResult",
    "StatefulComponent",
    "StreamingScorer",
]
