"""The frozen reference policy, optionally kept in CPU memory between its uses (`train.offload_reference`).

The reference is needed once per step, for one forward pass. Offloaded, its weights live in pinned
CPU memory and are copied to the GPU for that pass only (W0.5B: 1 GB, ~40 ms each way); since they
never change, nothing is copied back, and the GPU copy is simply dropped afterwards.
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

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        for p, host in zip(self.params, self.host):
            p.data = host.to(self.device, non_blocking=True)
        try:
            yield
        finally:
            for p, host in zip(self.params, self.host):
                p.data = host


def weights_on_device(offloaded: OffloadedWeights | None):
    """`offloaded.on_device()`, or nothing to do when the model stays on its device."""
    return offloaded.on_device() if offloaded is not None else contextlib.nullcontext()
