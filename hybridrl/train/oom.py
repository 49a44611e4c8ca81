"""Out-of-memory recovery: split the work in half and retry, down to one sequence, then say what to change.

A CUDA OOM (`torch.OutOfMemoryError`) leaves the process usable once the tensors of the failed
attempt are freed. Rollout retries generate the prompts in twice as many parts (kept for the rest
of the run); a training micro-batch retries its mini-batch with every micro-batch halved, which
gives the same gradient since losses are normalised by the whole mini-batch. Every retry is
counted (`num_retries`), and the trainer reports the count per step as `train/oom_retries`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Any, Callable, Sequence

import torch

log = logging.getLogger("hybridrl.train")

SETTINGS = (
    "train.micro_batch_size (sequences per forward/backward)",
    "train.batch_size or rollout.n (sequences per step)",
    "rollout.max_tokens and data.max_prompt_length (sequence length)",
    "rollout.kv_cache_fraction (native rollout: GPU memory kept for the KV cache)",
    "model.gradient_checkpointing=true (recompute activations in backward; model.gradient_checkpointing_layers lower or unset)",
)

_retries = 0


class OutOfMemoryError(RuntimeError):
    """Out of memory even with the work split down to one sequence; names the settings to change."""

    def __init__(self, where: str):
        super().__init__(
            f"out of GPU memory in {where}, even with the work split down to one sequence at a time. "
            f"Lower one of: {'; '.join(SETTINGS)}; or use a smaller model or a GPU with more memory."
        )


def num_retries() -> int:
    """Retries so far in this process (the trainer reports the difference per step)."""
    return _retries


def _count_retry(what: str) -> None:
    global _retries
    _retries += 1
    log.warning("out of memory in %s: retrying with the work split in half", what)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def split_in_half(micro: Any) -> list[Any] | None:
    """Two halves of a micro-batch (a `SequenceBatch` or a list of examples); None if it has one item."""
    size = micro.size if hasattr(micro, "select") else len(micro)
    if size < 2:
        return None
    half = (size + 1) // 2
    if hasattr(micro, "select"):
        return [micro.select(list(range(half))), micro.select(list(range(half, size)))]
    return [micro[:half], micro[half:]]


def run_with_split_retry(micro_batches: Sequence[Any], run: Callable[[list[Any]], Any], on_retry: Callable[[], None]) -> Any:
    """`run(micro_batches)`; on OOM, `on_retry()` (e.g. zero the gradients) and again with every
    micro-batch split in half, until a micro-batch of one sequence runs out of memory."""
    micros = list(micro_batches)
    while True:
        try:
            return run(micros)
        except torch.OutOfMemoryError:
            pass  # retry outside the handler, so the failed attempt's tensors can be freed
        halves = [split_in_half(m) for m in micros]
        if any(h is None for h in halves):
            raise OutOfMemoryError("a training micro-batch") from None
        micros = [part for h in halves for part in h]
        on_retry()
        _count_retry(f"a training micro-batch ({len(micros)} micro-batches now)")


def generate_in_parts(generate: Callable[[list, int], list], prompts: list, seed: int, parts: int) -> tuple[list, int]:
    """Generates for `prompts` in `parts` consecutive parts, doubling `parts` on OOM.

    `generate(part_prompts, seed)` returns samples whose `prompt_index` counts within the part;
    part k is sampled with its own seed (part 0 with `seed`, so one part is exactly one call).
    Returns the samples, with `prompt_index` into `prompts`, and the number of parts that worked.
    """
    while True:
        try:
            samples = []
            size = -(-len(prompts) // parts)
            for k, start in enumerate(range(0, len(prompts), size)):
                part_seed = (seed + k * 1_000_033) % (2**31 - 1)
                samples += [dataclasses.replace(s, prompt_index=s.prompt_index + start)
                            for s in generate(prompts[start : start + size], part_seed)]
            return samples, parts
        except torch.OutOfMemoryError:
            pass
        if parts >= len(prompts):
            raise OutOfMemoryError("rollout (generation)") from None
        parts = min(2 * parts, len(prompts))
        _count_retry(f"rollout (generating in {parts} parts from now on)")
