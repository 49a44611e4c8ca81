"""Continuous batching: which prompts join the decode batch, and where their KV blocks go.

A prompt group (one prompt, its n samples) is admitted when there are n free decode slots and
blocks for its worst case: the prompt's full blocks once (shared by the n samples, reference
counted) plus, per sample, the blocks for the prompt's partial tail and max_tokens responses.
Reserving the worst case up front means no sequence is ever preempted; blocks of a sequence that
stops early return to the pool at once, and waiting prompts join the running batch at the next
host check. Admission is FIFO within a token budget per prefill (padded prompt tokens).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_cache import BlockAllocator


@dataclass
class PromptGroup:
    """One prompt and the blocks its samples use."""

    prompt_index: int
    prompt_ids: list[int]
    max_tokens: int
    num_samples: int
    shared_blocks: list[int] = field(default_factory=list)  # the prompt's full blocks
    sample_blocks: list[list[int]] = field(default_factory=list)  # each sample's own blocks

    def block_table(self, sample: int) -> list[int]:
        return self.shared_blocks + self.sample_blocks[sample]


@dataclass
class RunningSequence:
    group: PromptGroup
    sample_index: int
    slot: int


def blocks_for(prompt_len: int, max_tokens: int, num_samples: int, block_size: int) -> tuple[int, int]:
    """(shared full prompt blocks, own blocks per sample). A sample's context holds prompt_len +
    max_tokens slots (the last sampled token is fed once more while a finished row idles)."""
    shared = prompt_len // block_size
    total = -(-(prompt_len + max_tokens) // block_size)
    return shared, total - shared


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_slots: int, max_batch_tokens: int):
        self.allocator = allocator
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[PromptGroup] = deque()
        self.running: dict[int, RunningSequence] = {}  # slot -> sequence
        self.free_slots = list(range(max_slots - 1, -1, -1))  # pop() gives the lowest slot

    def add(self, group: PromptGroup) -> None:
        shared, own = blocks_for(len(group.prompt_ids), group.max_tokens, group.num_samples, self.block_size)
        need = shared + own * group.num_samples
        if need > self.allocator.num_blocks - 1:
            raise ValueError(
                f"prompt {group.prompt_index} ({len(group.prompt_ids)} tokens, n={group.num_samples}, "
                f"max_tokens={group.max_tokens}) needs {need} KV blocks but the cache has "
                f"{self.allocator.num_blocks - 1}; raise kv_cache_fraction or lower n / max_tokens"
            )
        self.waiting.append(group)

    def admit(self) -> list[PromptGroup]:
        """Pops the prompt groups to prefill now and gives them their blocks."""
        admitted: list[PromptGroup] = []
        max_len = 0
        slots_left = len(self.free_slots)
        while self.waiting:
            group = self.waiting[0]
            length = len(group.prompt_ids)
            shared, own = blocks_for(length, group.max_tokens, group.num_samples, self.block_size)
            padded = max(max_len, length) * (len(admitted) + 1)
            if (
                group.num_samples > slots_left
                or shared + own * group.num_samples > self.allocator.num_free
                or (admitted and padded > self.max_batch_tokens)
            ):
                break
            self.waiting.popleft()
            group.shared_blocks = self.allocator.allocate(shared)
            self.allocator.share(group.shared_blocks, group.num_samples - 1)
            group.sample_blocks = [self.allocator.allocate(own) for _ in range(group.num_samples)]
            admitted.append(group)
            slots_left -= group.num_samples
            max_len = max(max_len, length)
        return admitted

    def start(self, group: PromptGroup) -> list[RunningSequence]:
        seqs = []
        for j in range(group.num_samples):
            seq = RunningSequence(group, j, self.free_slots.pop())
            self.running[seq.slot] = seq
            seqs.append(seq)
        return seqs

    def finish(self, slot: int) -> RunningSequence:
        seq = self.running.pop(slot)
        self.allocator.release(seq.group.shared_blocks)
        self.allocator.release(seq.group.sample_blocks[seq.sample_index])
        self.free_slots.append(slot)
        return seq

    def compaction(self) -> tuple[list[int], list[int]]:
        """Moves that pack the running rows into slots [0, num_running): (src, dst) lists."""
        num = len(self.running)
        src = sorted(s for s in self.running if s >= num)
        dst = sorted(set(range(num)) - set(self.running))
        for s, d in zip(src, dst):
            seq = self.running.pop(s)
            seq.slot = d
            self.running[d] = seq
        self.free_slots = sorted(set(self.free_slots) - set(dst) | set(src), reverse=True)
        return src, dst

    @property
    def batch_rows(self) -> int:
        """Rows a decode step must cover: up to the highest running slot."""
        return max(self.running) + 1 if self.running else 0
