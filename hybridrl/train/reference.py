"""The frozen reference policy, optionally kept in CPU memory between its uses (`train.offload_reference`).

The reference is needed once per step, for one forward pass. Offloaded, its weights live in pinned
CPU memory and are copied to the GPU for that pass only (W0.5B: 1 GB, ~20 ms on an H200; `prefetch()`
starts the copy while the host still prepares the pass); since they never change, nothing is copied
back, and the GPU copy is simply dropped afterwards.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class OffloadedWeights:
    """Moves a frozen model's parameters to pinned CPU memory; `on_device()` brings them back for a while."""

    def __init__(self, model: torch.nn.Module):
        self.device = next(model.parameters()).device
        pin = self.device.type == "cuda"
        self.params = list(model.parameters())
        self.host: list[torch.Tensor] = []
        for p in self.params:
            host = torch.empty(p.shape, dtype=p.dtype, pin_memory=pin)
            host.copy_(p.detach())
            self.host.append(host)
            p.data = host
        self._stream: torch.cuda.Stream | None = None
        self._prefetched: list[torch.Tensor] | None = None

    def prefetch(self) -> None:
        """Starts the copy to the device on a side stream, so that it runs while the host prepares
        the pass; the next `on_device()` waits for it instead of copying. No-op off CUDA."""
        if self.device.type != "cuda" or self._prefetched is not None:
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._prefetched = [host.to(self.device, non_blocking=True) for host in self.host]

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        if self._prefetched is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._stream)
            tensors, self._prefetched = self._prefetched, None
            for t in tensors:  # allocated on the side stream, used and freed on this one
                t.record_stream(current)
        else:
            tensors = [host.to(self.device, non_blocking=True) for host in self.host]
        for p, t in zip(self.params, tensors):
            p.data = t
        del tensors
        try:
            yield
        finally:
            for p, host in zip(self.params, self.host):
                p.data = host


def weights_on_device(offloaded: OffloadedWeights | None):
    """`offloaded.on_device()`, or nothing to do when the model stays on its device."""
    return offloaded.on_device() if offloaded is not None else contextlib.nullcontext()
