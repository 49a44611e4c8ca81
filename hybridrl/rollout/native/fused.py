"""q|k|v and gate|up weights as one tensor each for the decode step: fewer, larger GEMMs.

At W0.5B's decode size each GEMM launch costs more than its bytes (BENCHMARK.md, calibration):
one q|k|v GEMM replaces three and one gate|up GEMM replaces two.

No copy is made. `fuse_parameters` (called once, when the native backend is built, before any
optimizer exists) moves each layer's q/k/v (and gate/up) parameters into one contiguous tensor and
re-points the modules' parameters at row slices of it. The trainer then trains those slices, its
optimizer updates them in place, and the decode step reads the whole tensor: the fused tensor IS
the model's weights. If something later gives a parameter new storage (`model.to(...)`,
`p.data = ...`), the slices are no longer adjacent; `FusedWeights.refresh` notices at the next
generate call and falls back to copying the current weights into buffers of its own, so a
generation never reads stale weights.
"""

from __future__ import annotations

import torch
from torch import nn

from .arch import LayerWeights


def fuse_parameters(layers: nn.ModuleList) -> int:
    """Re-points every layer's q/k/v and gate/up parameters into one tensor per group (no-op where
    they already are). Returns the number of groups moved. Call before an optimizer holds them."""
    moved = 0
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        groups = [([a.q_proj, a.k_proj, a.v_proj], "weight"), ([m.gate_proj, m.up_proj], "weight")]
        if a.q_proj.bias is not None:
            groups.append(([a.q_proj, a.k_proj, a.v_proj], "bias"))
        for modules, name in groups:
            params = [getattr(mod, name) for mod in modules]
            if span(params) is not None:
                continue
            with torch.no_grad():
                fused = torch.cat([p.detach() for p in params], dim=0)
            start = 0
            for mod, p in zip(modules, params):
                rows = p.shape[0]
                setattr(mod, name, nn.Parameter(fused[start : start + rows], requires_grad=p.requires_grad))
                start += rows
            moved += 1
    return moved


def span(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors concatenated along dim 0 as a view, when they are adjacent row blocks of one
    contiguous storage (what `fuse_parameters` makes); None otherwise."""
    first = tensors[0]
    if not all(t.is_contiguous() and t.dtype == first.dtype and t.device == first.device and t.shape[1:] == first.shape[1:] for t in tensors):
        return None
    base = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in tensors:
        if t.untyped_storage().data_ptr() != base or t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().as_strided((rows, *first.shape[1:]), (first.stride(0), *first.stride()[1:]), first.storage_offset())


class FusedWeights:
    """Per layer: q|k|v weight (and bias) and gate|up weight, as views of the model's parameters
    when `fuse_parameters` made them adjacent, else as copies refreshed on every generate call."""

    def __init__(self, layers: list[LayerWeights]):
        lw = layers[0]
        self.has_bias = lw.q_b is not None
        self.q_size, self.kv_size = lw.q_w.shape[0], lw.k_w.shape[0]
        self.inter = lw.gate_w.shape[0]
        n = len(layers)
        self.qkv_w: list[torch.Tensor | None] = [None] * n
        self.qkv_b: list[torch.Tensor | None] = [None] * n
        self.gate_up_w: list[torch.Tensor | None] = [None] * n
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}  # copies, where parameters are not adjacent
        self.copied = 0  # groups held as copies at the last refresh (0: everything shared in place)
        self.refresh(layers)

    @torch.no_grad()
    def refresh(self, layers: list[LayerWeights]) -> None:
        """Points at the parameters, or copies them in where they are not adjacent (a copy buffer
        is reused, so its address, and the graphs captured on it, stay valid)."""
        self.copied = 0
        for i, lw in enumerate(layers):
            self.qkv_w[i] = self._view_or_copy(("qkv_w", i), [lw.q_w, lw.k_w, lw.v_w])
            if self.has_bias:
                self.qkv_b[i] = self._view_or_copy(("qkv_b", i), [lw.q_b, lw.k_b, lw.v_b])
            self.gate_up_w[i] = self._view_or_copy(("gate_up_w", i), [lw.gate_w, lw.up_w])

    def _view_or_copy(self, key: tuple[str, int], parts: list[torch.Tensor]) -> torch.Tensor:
        view = span(parts)
        if view is not None:
            self._buffers.pop(key, None)
            return view
        self.copied += 1
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        buf = self._buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != parts[0].dtype or buf.device != parts[0].device:
            buf = self._buffers[key] = torch.empty(shape, dtype=parts[0].dtype, device=parts[0].device)
        torch.cat([p.detach() for p in parts], dim=0, out=buf)
        return buf

    def tensors(self) -> list[torch.Tensor]:
        return self.qkv_w + [b for b in self.qkv_b if b is not None] + self.gate_up_w
