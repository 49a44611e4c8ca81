"""Token sampling with per-sequence seeds: temperature, top-k, top-p and greedy.

Sampling is Gumbel-max, argmax(x + g) for x = logits / T, with the Gumbel noise g a pure function
of (sequence key, step, index) through an integer hash. So a sequence's draws depend on its seed
alone, not on which other sequences share its batch or on any generator's state, and the GPU
kernel (triton_sampling.py) computes the very same noise without a generator object.

Without top-k / top-p the draw has two levels, so that noise is needed for one chunk of the
vocabulary only instead of all of it: the vocabulary is cut into chunks of SAMPLE_CHUNK entries;
a chunk c is chosen by Gumbel-max over the chunks' log-masses L_c = logsumexp(x over c), with the
chunk's noise hashed at index CHUNK_DOMAIN | c (no vocabulary index reaches it); then a token of
that chunk by Gumbel-max over its entries, with the token noise of the one-level draw. P(i) =
P(chunk of i) * P(i | chunk) = exp(L_c) / sum exp(L) * exp(x_i - L_c) = softmax(x)_i, exactly.
With top-k / top-p the draw stays one-level over the filtered vocabulary.

The returned log-prob is log_softmax(logits / T) of the chosen token, in fp32, over the whole
vocabulary (before top-k / top-p): the distribution the trainer recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF
# Vocabulary entries per chunk of the two-level draw, shared by this reference and the Triton
# kernel (whose stage-1 chunk it also is). It decides which token a given (seed, step) draws, so
# the CPU and GPU paths must agree on it; the distribution is softmax(logits / T) for any value.
SAMPLE_CHUNK = 8192
# The chunk noise is hashed at index CHUNK_DOMAIN | c; token noise at vocabulary indices < 2**31.
CHUNK_DOMAIN = 1 << 31


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


def step_keys_of(row_keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """32-bit key [B] of draw `steps[b]` of the sequence keyed `row_keys[b]`."""
    return lowbias32(row_keys ^ lowbias32(steps & MASK32))


def hashed_gumbel(step_keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, K] at the indices `index` ([B, K] or [1, K], int64 in [0, 2**32))."""
    bits = lowbias32(step_keys[:, None] ^ index)
    # 23 random bits + 0.5 is exact in fp32, so u lies strictly inside (0, 1).
    u = ((bits >> 9).to(torch.float32) + 0.5) * (2.0**-23)
    return -torch.log(-torch.log(u))


def gumbel_noise(row_keys: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, V] for draw `steps[b]` of the sequence keyed `row_keys[b]`."""
    vocab = torch.arange(vocab_size, device=row_keys.device, dtype=torch.int64)
    return hashed_gumbel(step_keys_of(row_keys, steps), vocab[None, :])


def two_level_gumbel_max(
    scaled: torch.Tensor, row_keys: torch.Tensor, steps: torch.Tensor, chunk: int = SAMPLE_CHUNK
) -> torch.Tensor:
    """Tokens [B] drawn from softmax(scaled) [B, V] fp32: a chunk by Gumbel-max over the chunks'
    log-masses, then a token of it by Gumbel-max over its entries (see the module docstring)."""
    batch, vocab = scaled.shape
    num_chunks = -(-vocab // chunk)
    step_keys = step_keys_of(row_keys, steps)
    if num_chunks == 1:  # chunk 0 is the only choice; its entries past the vocabulary (-inf) never win
        index = torch.arange(vocab, device=scaled.device)[None, :]
        return (scaled + hashed_gumbel(step_keys, index)).argmax(dim=-1)
    padded = torch.nn.functional.pad(scaled, (0, num_chunks * chunk - vocab), value=float("-inf"))
    padded = padded.view(batch, num_chunks, chunk)
    log_mass = torch.logsumexp(padded, dim=-1)  # [B, C]; -inf for a chunk of -inf only (mass 0)
    chunks = torch.arange(num_chunks, device=scaled.device, dtype=torch.int64) | CHUNK_DOMAIN
    chosen = (log_mass + hashed_gumbel(step_keys, chunks[None, :])).argmax(dim=-1)  # [B]
    index = chosen[:, None] * chunk + torch.arange(chunk, device=scaled.device)  # [B, chunk]
    x = padded.gather(1, chosen[:, None, None].expand(batch, 1, chunk))[:, 0]  # -inf past V
    within = (x + hashed_gumbel(step_keys, index)).argmax(dim=-1)
    return chosen * chunk + within


def sample(
    logits: torch.Tensor,
    row_keys: torch.Tensor,
    steps: torch.Tensor,
    params: SamplingParams,
    chunk: int = SAMPLE_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws one token per row. logits [B, V] (any float dtype) -> tokens [B] int64, logprobs [B]
    fp32. `chunk`: the two-level draw's chunk size; leave it at SAMPLE_CHUNK (the Triton kernel's
    default too) outside tests, since it decides which token a (seed, step) draws."""
    if params.greedy:
        scaled = logits.float()
        tokens = scaled.argmax(dim=-1)
    elif params.filtered:
        scaled = logits.float() / params.temperature
        candidates = _filter_top_k_top_p(scaled, params)
        tokens = (candidates + gumbel_noise(row_keys, steps, logits.shape[-1])).argmax(dim=-1)
    else:
        scaled = logits.float() / params.temperature
        tokens = two_level_gumbel_max(scaled, row_keys, steps, chunk)
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
