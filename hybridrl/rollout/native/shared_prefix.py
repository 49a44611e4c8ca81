"""Which decode rows share a prompt's KV blocks: the tables of cascade (shared-prefix) attention.

The n samples of a prompt share its full prompt blocks (scheduler.PromptGroup.shared_blocks, at the
head of every sample's block table). With these tables the decode step attends each group's rows
to those blocks together, reading them once per group instead of once per row
(triton_attention._shared_prefix_kernel), then each row to its own tokens. The tables live on the
device at fixed addresses (a captured decode graph reads them) and are rewritten from the host at
each host check, when rows start, finish or move.

Each group's prefix is split into chunks attended by separate programs (`splits`), so that a
step's few groups still give every SM work; the partial softmax states of the chunks live here too.
"""

from __future__ import annotations

import torch

from .scheduler import RunningSequence


MAX_SPLITS = 16  # bounds the partial-state buffers when only a few groups run
DEFAULT_SM_COUNT = 132  # an H100 / H200's, for the split count off a GPU


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class SharedPrefix:
    def __init__(
        self,
        max_slots: int,
        num_samples: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        splits: int = 0,  # chunks per group's prefix; 0: chosen from each step's batch (splits())
    ):
        self.max_slots, self.num_heads, self.num_kv_heads, self.head_dim = max_slots, num_heads, num_kv_heads, head_dim
        self.members = max(2, _pow2(num_samples))  # rows per group table entry (n, padded)
        self.fixed_splits = splits
        on_gpu = device.type == "cuda"
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else DEFAULT_SM_COUNT
        self.target_programs = 2 * sm_count
        max_groups = max(1, max_slots // 2)  # a group needs two rows to share anything
        i32 = dict(dtype=torch.int32, device=device)
        self.row_prefix = torch.zeros(max_slots, **i32)  # tokens of each row served by the prefix pass (0: none)
        self.group_rows = torch.full((max_groups, self.members), -1, **i32)  # member rows, -1 padded
        self.group_prefix = torch.zeros(max_groups, **i32)  # shared tokens of each group (0: unused entry)
        # Each (row, query head, chunk)'s unnormalised softmax state over its chunk of the prefix:
        # acc, then (max, sum), at ((row * num_heads + head) * splits + chunk) for a step's splits.
        # Sized for the most (row, chunk) pairs any batch asks for: fixed addresses for every graph.
        self.capacity = max(b * self.splits(b) for b in range(1, max_slots + 1))
        self.acc = torch.zeros(self.capacity * num_heads, head_dim, dtype=torch.float32, device=device)
        self.ml = torch.zeros(self.capacity * num_heads, 2, dtype=torch.float32, device=device)

    def fits(
        self, max_slots: int, num_samples: int, num_heads: int, num_kv_heads: int, head_dim: int, splits: int = 0
    ) -> bool:
        mine = (self.max_slots, self.num_heads, self.num_kv_heads, self.head_dim, self.fixed_splits)
        return (max_slots, num_heads, num_kv_heads, head_dim, splits) == mine and num_samples <= self.members

    def splits(self, batch: int) -> int:
        """Chunks each group's prefix is split into in a decode step over `batch` rows: enough that
        groups x KV heads x chunks makes two programs per SM, counting a group per `members` rows
        (the kernel then uses no more chunks than a group's prefix has tiles). A function of the
        batch alone, so fixed for the graph captured for a batch bucket."""
        if self.fixed_splits:
            return self.fixed_splits
        groups = -(-batch // self.members)
        return min(MAX_SPLITS, -(-self.target_programs // (groups * self.num_kv_heads)))

    def update(self, running: dict[int, RunningSequence], block_size: int) -> int:
        """Rewrites the tables for the running rows; returns the number of groups sharing a prefix."""
        by_group: dict[int, list[int]] = {}
        prefix_of: dict[int, int] = {}
        for slot, seq in running.items():
            key = id(seq.group)
            by_group.setdefault(key, []).append(slot)
            prefix_of[key] = len(seq.group.shared_blocks) * block_size
        rows = [0] * self.max_slots
        table = [[-1] * self.members for _ in range(self.group_rows.shape[0])]
        prefix = [0] * self.group_rows.shape[0]
        count = 0
        for key, slots in by_group.items():
            if len(slots) < 2 or prefix_of[key] == 0:
                continue  # nothing shared: the row attends to its whole context alone
            slots.sort()
            table[count][: len(slots)] = slots
            prefix[count] = prefix_of[key]
            for s in slots:
                rows[s] = prefix_of[key]
            count += 1
        self.row_prefix.copy_(torch.tensor(rows, dtype=torch.int32), non_blocking=True)
        self.group_rows.copy_(torch.tensor(table, dtype=torch.int32), non_blocking=True)
        self.group_prefix.copy_(torch.tensor(prefix, dtype=torch.int32), non_blocking=True)
        return count
