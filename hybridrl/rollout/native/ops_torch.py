"""The decode-step operations in plain PyTorch: the CPU path and the reference the Triton
kernels are tested against. Numerics follow HF's modules (fp32 statistics, cast, then weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridrl.models.norms import rms_norm

from .sampling import SamplingParams, sample


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (Su et al. 2021) in HF's rotate-half layout and HF's rounding: cos / sin
    cast to x's dtype, each product and sum rounded to it (matching HF keeps bf16 log-probs
    close to the trainer's). x [..., D], cos / sin broadcastable to [..., D/2] (HF's two halves
    of the table are equal)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, Hkv, bs, D] (one layer)
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    slots: torch.Tensor,  # [T] int64: block_id * block_size + offset
) -> None:
    bs = k_cache.shape[2]
    blocks, offsets = slots // bs, slots % bs
    k_cache[blocks, :, offsets] = k
    v_cache[blocks, :, offsets] = v


class TorchOps:
    """Decode-step building blocks; every method takes one row per running sequence."""

    shared_prefix = False  # whether decode_attention reads SharedPrefix tables (the Triton kernels do)
    reads_cache_through_table = False  # whether the cache ops honour kv_table (the Triton kernels do)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x if residual is None else residual + x
        return rms_norm(residual, weight, eps), residual

    def qk_rope_write_kv(
        self,
        q: torch.Tensor,  # [B, Hq * D]
        k: torch.Tensor,  # [B, Hkv * D]
        v: torch.Tensor,
        positions: torch.Tensor,  # [B] int64
        cos: torch.Tensor,  # [P, D/2] fp32
        sin: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, MB] int32
        kv_table=None,  # kv_cache.CacheAddresses.layer(): how the Triton kernels find the cache; unused here
    ) -> torch.Tensor:
        """Qwen3 q/k norm (if any), rotary on q and k, K/V into the cache; returns q [B, Hq, D]."""
        batch, head_dim = q.shape[0], cos.shape[1] * 2
        q, k, v = q.view(batch, -1, head_dim), k.view(batch, -1, head_dim), v.view(batch, -1, head_dim)
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
        c, s = cos[positions][:, None], sin[positions][:, None]
        q, k = apply_rope(q, c, s), apply_rope(k, c, s)
        bs = k_cache.shape[2]
        blocks = block_tables.gather(1, (positions // bs)[:, None])[:, 0].long()
        write_kv(k_cache, v_cache, k, v, blocks * bs + positions % bs)
        return q

    def prefill_rope_write_kv(
        self,
        q: torch.Tensor,  # [P * L, Hq * D] (rows may be strided: column slices of a fused q|k|v)
        k: torch.Tensor,  # [P * L, Hkv * D]
        v: torch.Tensor,
        lengths: torch.Tensor,  # [P] int64 (read by the Triton kernel: it writes a prompt's first lengths[p] tokens)
        slots: torch.Tensor,  # [P, L] int64 cache slot of each token (ignored where padded)
        valid_index: torch.Tensor,  # [N] int64 flat places of the real tokens (read here instead of lengths)
        cos: torch.Tensor,  # [>= L, D/2] fp32
        sin: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        k_cache: torch.Tensor,  # one layer's
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill's `qk_rope_write_kv`: token t of every right-padded prompt at position t; the
        real tokens' K/V go to their cache slots. Returns the rotated (q [P * L, Hq, D], k [P * L, Hkv, D])."""
        num_prompts, width = slots.shape
        head_dim = cos.shape[1] * 2
        q = q.reshape(num_prompts, width, -1, head_dim)
        k = k.reshape(num_prompts, width, -1, head_dim)
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
        c, s = cos[:width][None, :, None], sin[:width][None, :, None]
        q, k = apply_rope(q, c, s).flatten(0, 1), apply_rope(k, c, s).flatten(0, 1)
        v = v.reshape(num_prompts * width, -1, head_dim)
        write_kv(k_cache, v_cache, k[valid_index], v[valid_index], slots.flatten()[valid_index])
        return q, k

    def decode_attention(
        self,
        q: torch.Tensor,  # [B, Hq, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, MB]
        context_lens: torch.Tensor,  # [B]
        scale: float,
        prefix=None,  # SharedPrefix: only changes how the Triton kernels read shared blocks, not the result
        kv_table=None,  # as qk_rope_write_kv's
    ) -> torch.Tensor:
        """One query per sequence against its paged context; returns [B, Hq * D]."""
        batch, num_kv_heads, bs, head_dim = q.shape[0], k_cache.shape[1], k_cache.shape[2], q.shape[2]
        num_blocks = block_tables.shape[1]
        # Gather each sequence's blocks into [B, Hkv, MB * bs, D] (the CPU path's simplicity is
        # worth the copy; the GPU kernel reads the blocks in place).
        keys = k_cache[block_tables.long()].permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, -1, head_dim)
        values = v_cache[block_tables.long()].permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, -1, head_dim)
        valid = torch.arange(num_blocks * bs, device=q.device)[None] < context_lens[:, None]
        out = F.scaled_dot_product_attention(
            q[:, :, None], keys, values, attn_mask=valid[:, None, None], scale=scale, enable_gqa=True
        )
        return out.reshape(batch, -1)

    def rope_decode_attention(self, q, k, v, positions, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, block_tables,
                              scale, prefix=None, kv_table=None) -> torch.Tensor:  # fmt: skip
        """`qk_rope_write_kv` then `decode_attention` over the context up to and including the new
        token (positions + 1): one decode step's attention from the q|k|v projection; [B, Hq * D]."""
        q = self.qk_rope_write_kv(
            q, k, v, positions, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, block_tables, kv_table=kv_table
        )
        context = positions + 1
        return self.decode_attention(q, k_cache, v_cache, block_tables, context, scale, prefix=prefix, kv_table=kv_table)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def sample(
        self, logits: torch.Tensor, row_keys: torch.Tensor, steps: torch.Tensor, params: SamplingParams
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return sample(logits, row_keys, steps, params)

    def advance(self, state, batch: int, new_tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """The decode state's per-step bookkeeping (DecodeState.advance)."""
        state.advance(batch, new_tokens, logprobs)
