"""Token sampling with per-sequence seeds: temperature, top-k, top-p and greedy.

Sampling is Gumbel-max, argmax(logits / T + g), with the Gumbel noise g a pure function of
(sequence key, step, vocabulary index) through an integer hash. So a sequence's draws depend on
its seed alone, not on which other sequences share its batch or on any generator's state, and the
GPU kernel (triton_sampling.py) computes the very same noise without a generator object.
The returned log-prob is log_softmax(logits / T) of the chosen token, in fp32, over the whole
vocabulary (before top-k / top-p): the distribution the trainer recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (hashable: they key the captured CUDA graphs)."""

    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        return not self.greedy and (self.top_p < 1.0 or self.top_k > 0)


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' 32-bit integer hash, on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def row_keys_from_seeds(seeds: torch.Tensor) -> torch.Tensor:
    """32-bit sampling keys [B] from 64-bit seeds [B] (int64)."""
    lo = seeds & MASK32
    hi = (seeds >> 32) & MASK32
    return lowbias32(lo ^ lowbias32(hi))


def gumbel_noise(row_keys: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, V] for draw `steps[b]` of the sequence keyed `row_keys[b]`."""
    step_keys = lowbias32(row_keys ^ lowbias32(steps & MASK32))  # [B]
    vocab = torch.arange(vocab_size, device=row_keys.device, dtype=torch.int64)
    bits = lowbias32(step_keys[:, None] ^ vocab[None, :])  # [B, V]
    # 23 random bits + 0.5 is exact in fp32, so u lies strictly inside (0, 1).
    u = ((bits >> 9).to(torch.float32) + 0.5) * (2.0**-23)
    return -torch.log(-torch.log(u))


def sample(
    logits: torch.Tensor, row_keys: torch.Tensor, steps: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws one token per row. logits [B, V] (any float dtype) -> tokens [B] int64, logprobs [B]
    fp32."""
    if params.greedy:
        scaled = logits.float()
        tokens = scaled.argmax(dim=-1)
    else:
        scaled = logits.float() / params.temperature
        candidates = _filter_top_k_top_p(scaled, params) if params.filtered else scaled
        tokens = (candidates + gumbel_noise(row_keys, steps, logits.shape[-1])).argmax(dim=-1)
    logprobs = scaled.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(scaled, dim=-1)
    return tokens, logprobs


def _filter_top_k_top_p(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sets logits outside the top-k and the top-p nucleus (Holtzman et al. 2019) to -inf."""
    out = scaled
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_vals, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_vals, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (keeps the first).
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out
