"""Fused two-level Gumbel-max sampling and log-probs in Triton (temperature / greedy; no top-k /
top-p). Draws the same tokens as sampling.sample (see its docstring for the scheme).

Two launches. Stage 1, one program per (row, vocabulary chunk of SAMPLE_CHUNK): the chunk's max and
sum of exp (greedy: also its argmax), no noise. Stage 2, one program per row: merges the chunks
(log-sum-exp merge: the log-prob's normaliser), picks a chunk by Gumbel-max over the chunks'
log-masses, then reads that one chunk's logits again and picks a token by Gumbel-max over them.
So the hash and the two logs of the Gumbel noise run over nchunk + SAMPLE_CHUNK values a row, not
over the whole vocabulary. The noise is sampling.hashed_gumbel's hash, bit for bit, so the CPU and
GPU paths draw the same tokens up to rounding of the logs and exps (near-exact ties).
Shapes depend on (batch, vocab) only and nothing syncs with the host: capturable in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sampling import SAMPLE_CHUNK, SamplingParams

# Warps of the stage-1 programs (and the sampled stage 2, which reads one chunk). bench/rollout.py
# --sampler-sweep on one H200 at [256, 151936], sampled / greedy: 8192 / 8 warps 42.0 / 43.7 us,
# 2048 / 4 59.3 / 44.7, 1024 / 4 42.4 / 52.0, 16384 / 16 62.2 / 62.7 (the one-level kernel: 142 / 44).
NUM_WARPS = 8


@triton.jit
def _lowbias32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _neg_log2_neg_log2_u(bits):
    """Gumbel noise in log2 units from 32 hash bits: -log2(-log2 u) = G / ln 2 + a constant."""
    u = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2 ** -23
    return -tl.log2(-tl.log2(u))


@triton.jit
def _chunk_stats_kernel(
    logits_ptr, m_ptr, s_ptr, idx_ptr, V, inv_temp, NCHUNK, GREEDY: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * V + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    # Log2 units (exp2 / log2 are single fast instructions): x2 = x / T * log2(e).
    x = x * (inv_temp * 1.4426950408889634)
    m = tl.max(x, axis=0)
    m_sub = tl.where(m == float("-inf"), 0.0, m)  # a chunk of -inf only: s = 0, no NaN
    s = tl.sum(tl.exp2(x - m_sub), axis=0)
    out = row * NCHUNK + chunk
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)
    if GREEDY:
        tl.store(idx_ptr + out, chunk * CHUNK + tl.argmax(x, axis=0))


@triton.jit
def _pick_kernel(
    logits_ptr, keys_ptr, steps_ptr, m_ptr, s_ptr, idx_ptr, tok_ptr, lp_ptr, V, inv_temp, NCHUNK,
    GREEDY: tl.constexpr, CHUNK: tl.constexpr, NCHUNK_P: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, NCHUNK_P)
    cmask = c < NCHUNK
    m = tl.load(m_ptr + row * NCHUNK + c, mask=cmask, other=float("-inf"))  # log2 units
    s = tl.load(s_ptr + row * NCHUNK + c, mask=cmask, other=0.0)
    m_all = tl.max(m, axis=0)
    s_all = tl.sum(s * tl.exp2(m - m_all), axis=0)
    if GREEDY:
        token = tl.load(idx_ptr + row * NCHUNK + tl.argmax(m, axis=0)).to(tl.int64)
    else:
        key = tl.load(keys_ptr + row).to(tl.uint32)
        step = tl.load(steps_ptr + row).to(tl.uint32)
        step_key = _lowbias32(key ^ _lowbias32(step))
        # Level 1: a chunk by Gumbel-max over the log-masses m + log2(s) (log2 units), the noise
        # hashed at index 2**31 | c (sampling.CHUNK_DOMAIN), which no vocabulary index reaches.
        # A chunk without mass (padding past NCHUNK, or -inf logits only) has s = 0: never chosen.
        g_chunk = _neg_log2_neg_log2_u(_lowbias32(step_key ^ (c.to(tl.uint32) | 0x80000000)))
        has_mass = s > 0.0
        score = m + tl.log2(tl.where(has_mass, s, 1.0)) + g_chunk
        j = tl.argmax(tl.where(has_mass, score, float("-inf")), axis=0)
        # Level 2: a token of chunk j by Gumbel-max, the one-level draw's token noise.
        offs = j * CHUNK + tl.arange(0, CHUNK)
        mask = offs < V
        x = tl.load(logits_ptr + row * V + offs, mask=mask, other=float("-inf")).to(tl.float32)
        x = x * (inv_temp * 1.4426950408889634)
        g = _neg_log2_neg_log2_u(_lowbias32(step_key ^ offs.to(tl.uint32)))
        token = (j * CHUNK + tl.argmax(tl.where(mask, x + g, float("-inf")), axis=0)).to(tl.int64)
    x_tok = tl.load(logits_ptr + row * V + token).to(tl.float32) * (inv_temp * 1.4426950408889634)
    tl.store(tok_ptr + row, token)
    tl.store(lp_ptr + row, (x_tok - m_all - tl.log2(s_all)) * 0.6931471805599453)  # back to ln


def sample(
    logits: torch.Tensor,
    row_keys: torch.Tensor,
    steps: torch.Tensor,
    params: SamplingParams,
    chunk: int = SAMPLE_CHUNK,
    num_warps: int = NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as sampling.sample, for params without top-k / top-p. `chunk` (a power of 2)
    other than SAMPLE_CHUNK draws other tokens than sampling.sample's default (from the same
    distribution): for tests and bench/rollout.py --sampler-sweep."""
    assert not params.filtered, "top-k / top-p go through sampling.sample"
    batch, vocab = logits.shape
    nchunk = triton.cdiv(vocab, chunk)
    inv_temp = 1.0 if params.greedy else 1.0 / params.temperature
    f32 = dict(dtype=torch.float32, device=logits.device)
    m, s = torch.empty(batch, nchunk, **f32), torch.empty(batch, nchunk, **f32)
    idx = torch.empty(batch, nchunk, dtype=torch.int32, device=logits.device) if params.greedy else m  # unused
    _chunk_stats_kernel[(batch, nchunk)](
        logits, m, s, idx, vocab, inv_temp, nchunk, GREEDY=params.greedy, CHUNK=chunk, num_warps=num_warps,
    )  # fmt: skip
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(batch, **f32)
    _pick_kernel[(batch,)](
        logits, row_keys, steps, m, s, idx, tokens, logprobs, vocab, inv_temp, nchunk,
        GREEDY=params.greedy, CHUNK=chunk, NCHUNK_P=triton.next_power_of_2(nchunk),
        num_warps=1 if params.greedy else num_warps,
    )  # fmt: skip
    return tokens, logprobs
