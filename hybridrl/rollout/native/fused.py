"""Concatenated q|k|v and gate|up weights for the decode step: fewer, larger GEMMs.

At W0.5B's decode size each GEMM launch costs more than its bytes (BENCHMARK.md, calibration):
one q|k|v GEMM replaces three and one gate|up GEMM replaces two. This is a COPY of those weights
(for Qwen2.5-0.5B about 470 MB, 47% of the layer weights; 0 for the embedding and lm_head),
allocated on first use, refreshed from the module's live tensors at the start of every generate
call (a device copy of well under a millisecond, so optimizer steps are always seen), and freed
by sleep(). `NativeBackend(fuse_weights=False)` reads the original tensors only.
"""

from __future__ import annotations

import torch

from .arch import LayerWeights


class FusedWeights:
    def __init__(self, layers: list[LayerWeights]):
        lw = layers[0]
        self.has_bias = lw.q_b is not None
        self.q_size, self.kv_size = lw.q_w.shape[0], lw.k_w.shape[0]
        self.inter = lw.gate_w.shape[0]
        like = dict(dtype=lw.q_w.dtype, device=lw.q_w.device)
        hidden = lw.q_w.shape[1]
        qkv_rows = self.q_size + 2 * self.kv_size
        self.qkv_w = [torch.empty(qkv_rows, hidden, **like) for _ in layers]
        self.qkv_b = [torch.empty(qkv_rows, **like) for _ in layers] if self.has_bias else [None] * len(layers)
        self.gate_up_w = [torch.empty(2 * self.inter, hidden, **like) for _ in layers]

    @torch.no_grad()
    def refresh(self, layers: list[LayerWeights]) -> None:
        """Copies the module's current weights in (addresses stay, so captured graphs stay valid)."""
        for i, lw in enumerate(layers):
            torch.cat([lw.q_w, lw.k_w, lw.v_w], dim=0, out=self.qkv_w[i])
            if self.has_bias:
                torch.cat([lw.q_b, lw.k_b, lw.v_b], dim=0, out=self.qkv_b[i])
            torch.cat([lw.gate_w, lw.up_w], dim=0, out=self.gate_up_w[i])

    def tensors(self) -> list[torch.Tensor]:
        return self.qkv_w + [b for b in self.qkv_b if b is not None] + self.gate_up_w
