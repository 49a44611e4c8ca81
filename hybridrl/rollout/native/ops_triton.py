"""The decode-step operations on CUDA: Triton kernels where PyTorch would launch many kernels,
the PyTorch reference (ops_torch) for what has no kernel here (top-k / top-p sampling)."""

from __future__ import annotations

import torch

from . import triton_attention, triton_kernels, triton_sampling
from .ops_torch import TorchOps
from .sampling import SamplingParams


class TritonOps(TorchOps):
    """Same interface as TorchOps; every method is capturable in a CUDA graph."""

    shared_prefix = True

    # Defaults measured on one H200 at W0.5B (bench/rollout.py --attn): tile 128, 4 warps, no split.
    def __init__(self, attention_tile: int = 128, attention_warps: int = 4, attention_split: int = 0, attention_stages: int = 2):
        self.attention_tile = attention_tile  # tokens per inner-loop tile
        self.attention_warps = attention_warps
        self.attention_stages = attention_stages  # software-pipelining depth of the tile loop
        self.attention_split = attention_split  # tokens per flash-decoding split (0: no split)

    def add_rms_norm(self, x, residual, weight, eps):
        return triton_kernels.add_rms_norm(x, residual, weight, eps)

    # Every kernel here that touches the KV cache can find it through an address table
    # (kv_cache.CacheAddresses), so a captured decode graph survives the cache moving.
    reads_cache_through_table = True

    def qk_rope_write_kv(self, q, k, v, positions, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, block_tables,
                         kv_table=None):  # fmt: skip
        return triton_kernels.qk_rope_write_kv(
            q, k, v, positions, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, block_tables, kv_table=kv_table
        )

    def prefill_rope_write_kv(self, q, k, v, lengths, slots, valid_index, cos, sin, q_norm, k_norm, eps, k_cache, v_cache):
        return triton_kernels.prefill_rope_write_kv(q, k, v, lengths, slots, cos, sin, q_norm, k_norm, eps, k_cache, v_cache)

    def decode_attention(self, q, k_cache, v_cache, block_tables, context_lens, scale, prefix=None, kv_table=None):
        return triton_attention.paged_decode_attention(
            q, k_cache, v_cache, block_tables, context_lens, scale,
            tile=self.attention_tile, num_warps=self.attention_warps, num_stages=self.attention_stages, split_tokens=self.attention_split,
            prefix=prefix if self.attention_split == 0 else None,  # flash-decoding splits read the whole context
            kv_table=kv_table,
        )  # fmt: skip

    def rope_decode_attention(self, q, k, v, positions, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, block_tables,
                              scale, prefix=None, kv_table=None):  # fmt: skip
        if prefix is not None or self.attention_split:  # those kernels read the rotated q of every row
            return super().rope_decode_attention(
                q, k, v, positions, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, block_tables, scale,
                prefix=prefix, kv_table=kv_table,
            )  # fmt: skip
        return triton_attention.rope_paged_decode_attention(
            q, k, v, positions, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, block_tables, scale,
            tile=self.attention_tile, num_warps=self.attention_warps, num_stages=self.attention_stages, kv_table=kv_table,
        )  # fmt: skip

    def silu_mul(self, gate, up):
        return triton_kernels.silu_mul(gate, up)

    def advance(self, state, batch, new_tokens, logprobs):
        if state.stop_ids.numel() & (state.stop_ids.numel() - 1):  # the kernel reads a power of two
            return super().advance(state, batch, new_tokens, logprobs)
        triton_kernels.advance(state, batch, new_tokens, logprobs)

    def sample(self, logits: torch.Tensor, row_keys, steps, params: SamplingParams):
        if params.filtered:
            return super().sample(logits, row_keys, steps, params)
        return triton_sampling.sample(logits, row_keys, steps, params)
