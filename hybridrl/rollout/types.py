"""Types shared by the rollout facade and its backends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np


@dataclass
class GenerationRequest:
    """What a backend is asked to do: n samples for each tokenised prompt."""

    prompt_ids: list[list[int]]  # one token-id list per prompt (no padding)
    n: int = 1  # samples per prompt
    max_tokens: list[int] = field(default_factory=list)  # per prompt, response-token limit
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None  # sample (i, j) is seeded with seed + i * n + j where the backend can
    stop_token_ids: list[int] = field(default_factory=list)  # EOS and any extra stop tokens


@dataclass
class GeneratedSequence:
    """One finished sample as a backend returns it."""

    prompt_index: int  # index into GenerationRequest.prompt_ids
    sample_index: int  # 0 .. n-1
    response_ids: list[int]  # generated tokens, including the stop token if one was produced
    response_logprobs: list[float]  # log p(token) under softmax(logits / T) (T = 1 when greedy)
    finish_reason: str  # "stop" (a stop token) or "length" (max_tokens reached)
    # The same tokens and log-probs as numpy arrays (int64, float32), where the backend has them (the
    # native engine): the trainer lays its batch out from these instead of reading the Python lists.
    arrays: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)


# Called by a backend as soon as a sequence is finished (lets scoring overlap generation).
OnFinished = Callable[[GeneratedSequence], None]


class RolloutBackend(Protocol):
    """A generation engine bound to a model whose weights it shares, never copies."""

    name: str
    # Where the last generate() spent its time, `<part>_s` seconds and counts (NativeBackend.generate);
    # empty when the backend does not split it.
    stats: dict[str, float]

    def generate(
        self, request: GenerationRequest, on_finished: OnFinished | None = None
    ) -> list[GeneratedSequence]:
        """Returns len(prompt_ids) * n sequences ordered by (prompt_index, sample_index)."""
        ...

    def sleep(self) -> None:
        """Releases generation-only memory (KV cache) until the next generate / wake."""
        ...

    def wake(self) -> None:
        """Re-allocates generation memory released by sleep()."""
        ...


@dataclass
class RolloutSample:
    """One response as the user sees it: ids, text and log-probs."""

    prompt_index: int
    sample_index: int
    prompt: str
    prompt_ids: list[int]
    response: str
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str
    arrays: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)  # GeneratedSequence.arrays

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)


def order_sequences(seqs: Sequence[GeneratedSequence]) -> list[GeneratedSequence]:
    """Sorts backend output into the (prompt_index, sample_index) order the facade promises."""
    return sorted(seqs, key=lambda s: (s.prompt_index, s.sample_index))
