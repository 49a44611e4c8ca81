"""The frozen reference policy, optionally kept in CPU memory between its uses (`train.offload_reference`).

The reference is needed once per step, for one forward pass. Offloaded, its weights live in one
pinned CPU buffer per dtype and are copied to the GPU for that pass only (W0.5B: 1 GB over PCIe,
one transfer); since they never change, nothing is copied back, and the GPU copy is simply dropped
afterwards. `prefetch()` starts the copy on a side stream once the rollout has released its KV cache,
so it runs while the host lays out the batch.

Starting it before the rollout instead would hide the copy entirely, but the weights would then sit
beside the KV cache: at W0.5B on an H200 that took `timing/batch` from ~0.04 to ~0.01 s and raised
the step's peak allocated memory from 6.36 to 6.63 GiB (the rollout's peak plus 0.92 GiB came out
above training's), past half of TRL's 13.2 GiB. So the copy waits for the rollout.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_ALIGN = 64  # elements: every parameter's view starts 128-byte aligned (bf16) in its flat buffer


class OffloadedWeights:
    """Moves a frozen model's parameters to pinned CPU memory; `on_device()` brings them back for a while.

    The parameters of one dtype share one flat buffer, so a copy either way is one transfer per
    dtype, not one per parameter (W0.5B: 290 parameters)."""

    def __init__(self, model: torch.nn.Module):
        self.device = next(model.parameters()).device
        pin = self.device.type == "cuda"
        self.params = list(model.parameters())
        offsets: list[int] = []
        sizes: dict[torch.dtype, int] = {}
        for p in self.params:
            offsets.append(sizes.get(p.dtype, 0))
            sizes[p.dtype] = offsets[-1] + -(-p.numel() // _ALIGN) * _ALIGN
        self.flat = {dtype: torch.empty(n, dtype=dtype, pin_memory=pin) for dtype, n in sizes.items()}
        self._slots = [(p.dtype, off, p.shape) for p, off in zip(self.params, offsets)]
        self.host: list[torch.Tensor] = self._views(self.flat)
        for p, host in zip(self.params, self.host):
            host.copy_(p.detach())
            p.data = host
        self._stream: torch.cuda.Stream | None = None
        self._prefetched: dict[torch.dtype, torch.Tensor] | None = None

    def _views(self, flat: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
        return [flat[dtype][off : off + shape.numel()].view(shape) for dtype, off, shape in self._slots]

    def _copy_to_device(self) -> dict[torch.dtype, torch.Tensor]:
        return {dtype: host.to(self.device, non_blocking=True) for dtype, host in self.flat.items()}

    @property
    def prefetched(self) -> bool:
        return self._prefetched is not None

    def prefetch(self) -> None:
        """Starts the copy to the device on a side stream, so that it runs while the GPU does other
        work; the next `on_device()` waits for it instead of copying. No-op off CUDA, or if a copy
        is already on its way."""
        if self.device.type != "cuda" or self._prefetched is not None:
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._prefetched = self._copy_to_device()

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        if self._prefetched is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._stream)
            flat, self._prefetched = self._prefetched, None
            for t in flat.values():  # allocated on the side stream, used and freed on this one
                t.record_stream(current)
        else:
            flat = self._copy_to_device()
        for p, t in zip(self.params, self._views(flat)):
            p.data = t
        del flat
        try:
            yield
        finally:
            for p, host in zip(self.params, self.host):
                p.data = host


def weights_on_device(offloaded: OffloadedWeights | None):
    """`offloaded.on_device()`, or nothing to do when the model stays on its device."""
    return offloaded.on_device() if offloaded is not None else contextlib.nullcontext()
