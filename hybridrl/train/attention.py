"""Attention over packed rows (packing.py): each token sees its own prompt and response only.

On CUDA the mask is a FlexAttention `BlockMask`: tiles that lie outside every sequence are skipped
and the kernel is compiled once. FlexAttention has no backward on CPU, so there the mask is a dense
`[1, 1, L, L]` boolean handed to SDPA. Padded (unpacked) calls are plain SDPA.

The attention implementation of a HF model is looked up by name at every forward, including the
recomputation of a gradient-checkpointed layer during backward, so packing is enabled by switching
the model, once, to an implementation registered here that serves both kinds of call.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hybridrl.train.packing import PackedLayout

NAME = "hybridrl_packed"
BLOCK = 128  # FlexAttention tile: packed rows are padded to a multiple of it on CUDA
SUPPORTED_BASES = ("sdpa", "eager", NAME)
# FlexAttention tiles for training on CUDA. On an H200 with W0.5B heads (14 query, 2 KV, dim 64) over a
# packed 13k-token micro-batch (bench/flex_attention.py), these forward tiles took the forward from
# 0.251 ms (torch's defaults) to 0.152 ms, forward + backward from 1.183 to 1.08 ms; the backward keeps
# torch's own tiles (num_warps / num_stages here equal its sm90 choice). Outputs differ from the
# defaults' by bf16 rounding only.
FLEX_KERNEL_OPTIONS = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}


def _packed_or_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    if not isinstance(attention_mask, BlockMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    flex = flex_attention if torch.compiler.is_compiling() else _compiled_flex()
    out = flex(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
               kernel_options=FLEX_KERNEL_OPTIONS)  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _compiled_flex():
    # Uncompiled, FlexAttention materialises the whole score matrix; compiled it is a fused kernel.
    return torch.compile(flex_attention)


AttentionInterface.register(NAME, _packed_or_sdpa_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # unpacked calls (e.g. generate) get SDPA's masks


def supports_packing(model: torch.nn.Module) -> bool:
    return getattr(model.config, "_attn_implementation", None) in SUPPORTED_BASES


def enable_packed_attention(model: torch.nn.Module) -> None:
    """Switches an sdpa / eager model to the implementation that also serves packed rows."""
    impl = model.config._attn_implementation
    if impl not in SUPPORTED_BASES:
        raise ValueError(
            f"packed training needs a model with sdpa or eager attention, not {impl!r}: "
            "set model.attn_implementation=sdpa, or train.packing=off"
        )
    model.config._attn_implementation = NAME


def sequence_mask(doc: torch.Tensor, branch: torch.Tensor, q_index: torch.Tensor, kv_index: torch.Tensor) -> torch.Tensor:
    """True where query token q may attend to key token kv: same prompt group (`doc`), not in the
    future, and kv is a prompt token (`branch` 0) or in q's own response."""
    same_doc = doc[q_index] == doc[kv_index]
    visible_branch = (branch[kv_index] == 0) | (branch[kv_index] == branch[q_index])
    return same_doc & (kv_index <= q_index) & visible_branch


def packed_attention_mask(layout: PackedLayout) -> BlockMask | torch.Tensor:
    """A `BlockMask` on CUDA, a dense `[1, 1, L, L]` boolean mask elsewhere."""
    L = layout.length
    device = layout.input_ids.device
    if device.type != "cuda":
        idx = torch.arange(L, device=device)
        return sequence_mask(layout.doc_ids, layout.branch_ids, idx[:, None], idx[None, :])[None, None]
    assert L % BLOCK == 0, "packed rows are padded to a multiple of the FlexAttention block on CUDA"
    return _block_mask(layout, L, device)


def _block_mask(layout: PackedLayout, L: int, device: torch.device) -> BlockMask:
    """Classifies each (query tile, key tile) as empty, full or partial from the dense mask, a few
    query tiles at a time (the whole [L, L] mask would be L^2 bytes)."""
    nb = L // BLOCK
    doc, branch = layout.doc_ids, layout.branch_ids
    kv = torch.arange(L, device=device)
    any_blocks, all_blocks = [], []
    rows_per_slab = max(1, (1 << 26) // (L * BLOCK)) * BLOCK  # ~64 MB of mask per slab
    for start in range(0, L, rows_per_slab):
        q = torch.arange(start, min(L, start + rows_per_slab), device=device)
        dense = sequence_mask(doc, branch, q[:, None], kv[None, :]).view(-1, BLOCK, nb, BLOCK)
        any_blocks.append(dense.any(3).any(1))
        all_blocks.append(dense.all(3).all(1))
    visible, full = torch.cat(any_blocks), torch.cat(all_blocks)
    partial = visible & ~full

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = blocks.sum(-1, dtype=torch.int32)
        indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts[None, None].contiguous(), indices[None, None].contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        return sequence_mask(doc, branch, q_idx, kv_idx)

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(L, L))
