"""Fused Gumbel-max sampling and log-probs in Triton (temperature / greedy; no top-k / top-p).

Two launches instead of PyTorch's dozen over [B, V] fp32 tensors: stage 1 reads each vocabulary
chunk once and keeps its max, sum of exp and best noisy score; stage 2 merges the chunks of a
row (log-sum-exp merge) and reads the chosen token's logit. The noise is sampling.gumbel_noise's
hash, bit for bit, so the CPU and GPU paths draw the same tokens up to rounding of the logs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sampling import SamplingParams

# Vocabulary entries per stage-1 program and its warps: the fastest of bench/rollout.py
# --sampler-sweep on one H200 at [256, 151936] (142 us sampled, 44 us greedy; 4096 / 8: 147, 79).
CHUNK = 2048
NUM_WARPS = 4


@triton.jit
def _lowbias32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _sample_chunk_kernel(
    logits_ptr, keys_ptr, steps_ptr, m_ptr, s_ptr, best_ptr, idx_ptr, V, inv_temp, NCHUNK,
    GREEDY: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < V
    x = tl.load(logits_ptr + row * V + offs, mask=mask, other=float("-inf")).to(tl.float32)
    # Work in log2 units (exp2 / log2 are single fast instructions): x2 = x / T * log2(e).
    x = x * (inv_temp * 1.4426950408889634)
    m = tl.max(x, axis=0)
    s = tl.sum(tl.exp2(x - m), axis=0)
    if GREEDY:
        score = x
    else:
        key = tl.load(keys_ptr + row).to(tl.uint32)
        step = tl.load(steps_ptr + row).to(tl.uint32)
        step_key = _lowbias32(key ^ _lowbias32(step))
        bits = _lowbias32(step_key ^ offs.to(tl.uint32))
        u = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2 ** -23
        # Gumbel-max in log2 units: argmax(x - ln(-ln u)) = argmax(x2 - log2(-log2 u)).
        score = tl.where(mask, x - tl.log2(-tl.log2(u)), float("-inf"))
    best = tl.max(score, axis=0)
    idx = tl.argmax(score, axis=0)
    out = row * NCHUNK + chunk
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)
    tl.store(best_ptr + out, best)
    tl.store(idx_ptr + out, chunk * CHUNK + idx)


@triton.jit
def _sample_merge_kernel(
    logits_ptr, m_ptr, s_ptr, best_ptr, idx_ptr, tok_ptr, lp_ptr, V, inv_temp, NCHUNK,
    NCHUNK_P: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, NCHUNK_P)
    mask = c < NCHUNK
    m = tl.load(m_ptr + row * NCHUNK + c, mask=mask, other=float("-inf"))
    s = tl.load(s_ptr + row * NCHUNK + c, mask=mask, other=0.0)
    best = tl.load(best_ptr + row * NCHUNK + c, mask=mask, other=float("-inf"))
    m_all = tl.max(m, axis=0)  # log2 units
    s_all = tl.sum(s * tl.exp2(m - m_all), axis=0)
    j = tl.argmax(best, axis=0)
    token = tl.load(idx_ptr + row * NCHUNK + j).to(tl.int64)
    x_tok = tl.load(logits_ptr + row * V + token).to(tl.float32) * (inv_temp * 1.4426950408889634)
    tl.store(tok_ptr + row, token)
    tl.store(lp_ptr + row, (x_tok - m_all - tl.log2(s_all)) * 0.6931471805599453)  # back to ln


def sample(
    logits: torch.Tensor, row_keys: torch.Tensor, steps: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as sampling.sample, for params without top-k / top-p."""
    assert not params.filtered, "top-k / top-p go through sampling.sample"
    batch, vocab = logits.shape
    nchunk = triton.cdiv(vocab, CHUNK)
    inv_temp = 1.0 if params.greedy else 1.0 / params.temperature
    f32 = dict(dtype=torch.float32, device=logits.device)
    m, s, best = (torch.empty(batch, nchunk, **f32) for _ in range(3))
    idx = torch.empty(batch, nchunk, dtype=torch.int32, device=logits.device)
    _sample_chunk_kernel[(batch, nchunk)](
        logits, row_keys, steps, m, s, best, idx, vocab, inv_temp, nchunk,
        GREEDY=params.greedy, CHUNK=CHUNK, num_warps=NUM_WARPS,
    )  # fmt: skip
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(batch, **f32)
    _sample_merge_kernel[(batch,)](
        logits, m, s, best, idx, tokens, logprobs, vocab, inv_temp, nchunk,
        NCHUNK_P=triton.next_power_of_2(nchunk), num_warps=1,
    )  # fmt: skip
    return tokens, logprobs
