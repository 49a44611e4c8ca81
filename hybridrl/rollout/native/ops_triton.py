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

    # Settings left None are chosen by head dim, from bench/decode_attention.py and bench/rollout.py on
    # one H200 (rollout/native/NOTES.md, session 22). The fused rotary + attention kernel (the decode
    # step's, without a shared prefix or splits): 64-token tiles, 3 pipeline stages; at head dim 64 it
    # also attends the new token from registers and reads the block table a tile ahead (W0.5B
    # rollout 0.851-0.860 s against 0.875-0.881 s), at 128 not (those cost it registers; W1.5B 1.608-
    # 1.610 s against 1.699-1.701 s with 128-token tiles). The separate attention kernel keeps
    # 128-token tiles and 2 stages.
    def __init__(self, attention_tile: int | None = None, attention_warps: int = 4, attention_split: int = 0,
                 attention_stages: int | None = None, new_token_in_registers: bool | None = None,
                 prefetch_table: bool | None = None, attention_max_registers: int | None = None):  # fmt: skip
        self.attention_tile = attention_tile  # tokens per inner-loop tile
        self.attention_warps = attention_warps
        self.attention_stages = attention_stages  # software-pipelining depth of the tile loop
        self.attention_split = attention_split  # tokens per flash-decoding split (0: no split)
        # The fused kernel attends the new token from its registers, not from the cache it wrote.
        self.new_token_in_registers = new_token_in_registers
        self.prefetch_table = prefetch_table  # with registers: block table entries read a tile ahead
        self.attention_max_registers = attention_max_registers  # per thread of the fused kernel (None: ptxas's choice)

    def _fused_settings(self, head_dim: int) -> dict:
        """The fused kernel's launch settings: those set, the rest by head dim (see __init__)."""
        small = head_dim <= 64
        return dict(
            tile=64 if self.attention_tile is None else self.attention_tile,
            num_warps=self.attention_warps,
            num_stages=3 if self.attention_stages is None else self.attention_stages,
            new_in_registers=small if self.new_token_in_registers is None else self.new_token_in_registers,
            prefetch_table=small if self.prefetch_table is None else self.prefetch_table,
            max_registers=self.attention_max_registers,
        )

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
            tile=self.attention_tile or 128, num_warps=self.attention_warps, num_stages=self.attention_stages or 2,
            split_tokens=self.attention_split,
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
            kv_table=kv_table, **self._fused_settings(2 * cos.shape[1]),
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
