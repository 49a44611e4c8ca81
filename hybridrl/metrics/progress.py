"""A console progress bar showing the figures a user watches: reward, KL, step time."""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm

# (record key, short label, format)
SHOWN = [
    ("reward/mean", "reward", "{:.3f}"),
    ("eval/accuracy", "eval_acc", "{:.3f}"),
    ("actor/kl", "kl", "{:.4f}"),
    ("actor/entropy", "ent", "{:.3f}"),
    ("rollout/response_length/mean", "len", "{:.1f}"),
    ("timing/step", "s/step", "{:.2f}"),
    ("sft/loss", "loss", "{:.4f}"),
    ("dpo/reward_accuracy", "pref_acc", "{:.3f}"),
    ("kto/loss", "loss", "{:.4f}"),
    ("rm/accuracy", "rm_acc", "{:.3f}"),
]


class ConsoleProgress:
    def __init__(self, total: int, initial: int = 0, enabled: bool = True, desc: str = "train"):
        self.bar = tqdm(total=total, initial=initial, desc=desc, disable=not enabled, file=sys.stderr, dynamic_ncols=True)
        self.last: dict[str, str] = {}

    def update(self, record: dict[str, Any]) -> None:
        for key, label, fmt in SHOWN:
            value = record.get(key)
            if isinstance(value, (int, float)):
                self.last[label] = fmt.format(value)
        self.bar.set_postfix(self.last, refresh=False)
        self.bar.update(1)

    def write(self, message: str) -> None:
        self.bar.write(message, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
