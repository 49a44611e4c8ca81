"""The tensors of one step's responses, laid out for the forward pass, and how to split them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Sequence

import torch


@dataclass
class SequenceBatch:
    """B sequences laid out as `[left-padded prompt (P) | right-padded response (T)]`.

    The logits that predict response token t sit at position P - 1 + t.
    """

    input_ids: torch.Tensor  # [B, P+T]
    attention_mask: torch.Tensor  # [B, P+T], 1 on real tokens
    position_ids: torch.Tensor  # [B, P+T], counting real tokens only (left padding is skipped)
    response_mask: torch.Tensor  # [B, T] float, 1 on response tokens
    prompt_width: int  # P
    # Per-sequence and per-token data filled in along the step ([B] or [B, T]); None until then.
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # True: forward passes lay the rows end to end in one packed row (packing.py), each prompt once
    # for all its responses, instead of this padded layout. `select` keeps the flag.
    packed: bool = False

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_ids(self) -> torch.Tensor:  # [B, T]
        return self.input_ids[:, self.prompt_width :]

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        assert value.shape[0] == self.size, f"{key}: first dim {value.shape[0]} != batch size {self.size}"
        self.tensors[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def select(self, index: Sequence[int] | torch.Tensor) -> "SequenceBatch":
        """The rows in `index`, trimmed to their own widest prompt and response (less padding)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        mask = self.attention_mask[idx]
        resp = self.response_mask[idx]
        P, T = self.prompt_width, self.response_mask.shape[1]
        left = int((mask[:, :P].sum(0) == 0).sum().item()) if P else 0  # all-padding prompt columns
        resp_len = int(resp.sum(1).max().item()) if idx.numel() else 0
        resp_len = max(resp_len, 1)
        cols = slice(left, P + resp_len)
        return replace(
            self,
            input_ids=self.input_ids[idx][:, cols],
            attention_mask=mask[:, cols],
            position_ids=self.position_ids[idx][:, cols],
            response_mask=resp[:, :resp_len],
            prompt_width=P - left,
            tensors={k: (v[idx][:, :resp_len] if v.dim() == 2 and v.shape[1] == T else v[idx]) for k, v in self.tensors.items()},
        )

    def to(self, device: torch.device) -> "SequenceBatch":
        kw = {f.name: getattr(self, f.name).to(device) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, tensors={k: v.to(device) for k, v in self.tensors.items()}, **kw)


def build_sequence_batch(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_id: int) -> SequenceBatch:
    """Pads prompts on the left and responses on the right into one batch."""
    B = len(prompt_ids)
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(r) for r in response_ids))
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + T), dtype=torch.long)
    response_mask = torch.zeros((B, T), dtype=torch.float32)
    for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[b, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        attention_mask[b, P - len(p) : P] = 1
        if r:
            input_ids[b, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask[b, P : P + len(r)] = 1
            response_mask[b, : len(r)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return SequenceBatch(input_ids, attention_mask, position_ids, response_mask, P)


def pad_per_token(values: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """Right-pads ragged per-token floats (e.g. rollout log-probs) into `[B, width]`."""
    out = torch.zeros((len(values), width), dtype=torch.float32)
    for b, v in enumerate(values):
        if v:
            out[b, : len(v)] = torch.tensor(v, dtype=torch.float32)
    return out


def split_indices(num: int, chunk: int) -> list[list[int]]:
    return [list(range(s, min(s + chunk, num))) for s in range(0, num, chunk)]
