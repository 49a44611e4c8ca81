"""The decode batch as static device buffers, one row ("slot") per running sequence.

A decode step reads and updates these buffers on the device alone (next token, position, step
count, done flag, output token and log-prob), so many steps run back to back, captured as a CUDA
graph, with no host round trip; the host looks at `done` only every few steps.
Rows past the running sequences are inactive: done, at position 0, writing to scratch block 0.
"""

from __future__ import annotations

import torch

from .kv_cache import PagedKVCache
from .model import NativeDecoder
from .sampling import SamplingParams


class DecodeState:
    def __init__(
        self, max_slots: int, max_blocks_per_seq: int, max_gen: int, max_stop_ids: int, device: torch.device
    ):
        i64 = dict(dtype=torch.int64, device=device)
        self.max_slots, self.max_blocks_per_seq, self.max_gen = max_slots, max_blocks_per_seq, max_gen
        self.tokens = torch.zeros(max_slots, **i64)  # input token of the next step
        self.positions = torch.zeros(max_slots, **i64)  # its position
        self.block_tables = torch.zeros(max_slots, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.row_keys = torch.zeros(max_slots, **i64)  # sampling key (sampling.row_keys_from_seeds)
        self.steps = torch.zeros(max_slots, **i64)  # tokens generated so far
        self.max_lens = torch.ones(max_slots, **i64)  # max_tokens of the sequence
        self.done = torch.ones(max_slots, dtype=torch.bool, device=device)
        # Column max_gen is a trash column: finished rows write there.
        self.out_tokens = torch.zeros(max_slots, max_gen + 1, **i64)
        self.out_logprobs = torch.zeros(max_slots, max_gen + 1, dtype=torch.float32, device=device)
        self.stop_ids = torch.full((max_stop_ids,), -1, **i64)  # padded with -1 (never a token)

    def fits(self, max_slots: int, max_blocks_per_seq: int, max_gen: int, num_stop_ids: int) -> bool:
        return (
            max_slots <= self.max_slots
            and max_blocks_per_seq <= self.max_blocks_per_seq
            and max_gen <= self.max_gen
            and num_stop_ids <= self.stop_ids.numel()
        )

    def _buffers(self) -> list[torch.Tensor]:
        return [self.tokens, self.positions, self.block_tables, self.row_keys, self.steps,
                self.max_lens, self.done, self.out_tokens, self.out_logprobs]  # fmt: skip

    def set_stop_ids(self, stop_ids: list[int]) -> None:
        self.stop_ids.fill_(-1)
        if stop_ids:
            self.stop_ids[: len(stop_ids)] = torch.tensor(stop_ids, device=self.stop_ids.device)

    def start_rows(
        self,
        slots: list[int],
        first_tokens: torch.Tensor,  # [R] sampled from the prefill logits
        first_logprobs: torch.Tensor,  # [R]
        positions: list[int],  # prompt lengths (position of the first generated token)
        block_tables: list[list[int]],
        row_keys: torch.Tensor,  # [R]
        max_lens: list[int],
    ) -> None:
        dev = self.tokens.device
        idx = torch.tensor(slots, device=dev)
        table = torch.zeros(len(slots), self.max_blocks_per_seq, dtype=torch.int32)
        for r, blocks in enumerate(block_tables):
            table[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        max_len_t = torch.tensor(max_lens, device=dev)
        stopped = (first_tokens[:, None] == self.stop_ids[None]).any(-1)
        self.tokens[idx] = first_tokens
        self.positions[idx] = torch.tensor(positions, device=dev)
        self.block_tables[idx] = table.to(dev)
        self.row_keys[idx] = row_keys
        self.steps[idx] = 1
        self.max_lens[idx] = max_len_t
        self.done[idx] = stopped | (max_len_t <= 1)
        self.out_tokens[idx, 0] = first_tokens
        self.out_logprobs[idx, 0] = first_logprobs

    def reset_rows(self, slots: list[int]) -> None:
        """Makes rows inactive (done, position 0, table of scratch block 0)."""
        if not slots:
            return
        idx = torch.tensor(slots, device=self.tokens.device)
        self.done[idx] = True
        self.positions[idx] = 0
        self.tokens[idx] = 0
        self.block_tables[idx] = 0

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Compaction: copies rows src -> dst (all buffers); the caller resets what is left."""
        s = torch.tensor(src, device=self.tokens.device)
        d = torch.tensor(dst, device=self.tokens.device)
        for buf in self._buffers():
            buf[d] = buf[s]

    def snapshot(self) -> list[torch.Tensor]:
        return [b.clone() for b in self._buffers()]

    def restore(self, snap: list[torch.Tensor]) -> None:
        for buf, saved in zip(self._buffers(), snap):
            buf.copy_(saved)

    def step(self, batch: int, decoder: NativeDecoder, cache: PagedKVCache, params: SamplingParams) -> None:
        """One decode step for rows [0, batch): forward, sample, record, advance (in place)."""
        tokens, positions, steps = self.tokens[:batch], self.positions[:batch], self.steps[:batch]
        logits = decoder.decode(tokens, positions, self.block_tables[:batch], cache)
        new_tokens, logprobs = decoder.ops.sample(logits, self.row_keys[:batch], steps, params)
        decoder.ops.advance(self, batch, new_tokens, logprobs)

    def advance(self, batch: int, new_tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Records each active row's sampled token and log-prob, marks rows that stopped or hit
        max_tokens as done, and moves the active rows one position on (rows [0, batch), in place)."""
        tokens, positions, steps = self.tokens[:batch], self.positions[:batch], self.steps[:batch]
        done = self.done[:batch]
        active = ~done
        column = torch.where(active, steps, self.max_gen)[:, None]  # finished rows -> trash column
        self.out_tokens[:batch].scatter_(1, column, new_tokens[:, None])
        self.out_logprobs[:batch].scatter_(1, column, logprobs[:, None])
        stopped = (new_tokens[:, None] == self.stop_ids[None]).any(-1)
        new_steps = steps + active
        done.logical_or_(active & (stopped | (new_steps >= self.max_lens[:batch])))
        steps.copy_(new_steps)
        positions.add_(active)
        tokens.copy_(torch.where(active, new_tokens, tokens))
