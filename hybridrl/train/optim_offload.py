"""Optimizer state in CPU memory between updates (`train.offload_optimizer`).

AdamW's moments (and `CompensatedAdamW`'s compensation buffer) are read once per step, by
`optimizer.step()`, yet they sit on the GPU through the rollout, the reference pass and every
forward/backward: 6 of `CompensatedAdamW`'s 10 bytes per parameter (2.8 GiB at W0.5B), 8 of
`MasterWeightAdamW`'s 18. Offloaded, they live in pinned CPU buffers; right after each step they
are copied there on a side stream (the copy runs while the next phase starts, and the device
memory is released when it is done), and right before the next step they are copied back on the
current stream. Peak memory then no longer holds the moments and the activations at once; the
price is one host-to-device copy of the state per step that nothing overlaps (W0.5B: 2.8 GB).

It works through the optimizer's own hooks, so every optimizer here (and any torch one) is served
without changes: a step pre-hook brings the state back, a post-hook sends it away, `state_dict()`
first waits for a pending copy, and a loaded state is sent away at once.
"""

from __future__ import annotations

from typing import Iterator

import torch


class OffloadedOptimizerState:
    """Keeps `optimizer`'s per-parameter state tensors in (pinned) CPU memory between its steps.

    The state tensors moved are those shaped like their parameter (moments, compensation); scalars
    such as a step count stay where they are. Off CUDA the buffers are plain CPU tensors: there is
    no memory to save, but the bookkeeping is the same (the tests use that)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._host: dict[tuple[int, str], torch.Tensor] = {}  # (id(param), state key) -> host buffer
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pending: list[torch.cuda.Event] = []  # device-to-host copies not yet known to be done
        self._handles = [
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.restore()),
            optimizer.register_step_post_hook(lambda opt, args, kwargs: self.offload()),
            optimizer.register_state_dict_pre_hook(lambda opt: self.wait()),
            optimizer.register_load_state_dict_post_hook(lambda opt: self.offload()),
        ]

    def _entries(self) -> Iterator[tuple[torch.Tensor, dict, str, torch.Tensor]]:
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p)
                if not state:
                    continue
                for key, value in list(state.items()):
                    if torch.is_tensor(value) and p.numel() > 1 and value.numel() == p.numel():
                        yield p, state, key, value

    def is_offloaded(self) -> bool:
        """True when every offloadable state tensor is in its host buffer (and there is at least one)."""
        entries = list(self._entries())
        return bool(entries) and all(value is self._host.get((id(p), key)) for p, _, key, value in entries)

    @torch.no_grad()
    def offload(self) -> None:
        """Sends the state to its host buffers; on CUDA asynchronously, on a side stream."""
        moving = [(p, state, key, value) for p, state, key, value in self._entries() if value is not self._host.get((id(p), key))]
        streams = {device: self._side_stream(device) for device in {value.device for *_, value in moving if value.is_cuda}}
        for p, state, key, value in moving:
            host = self._host.get((id(p), key))
            if host is None or host.shape != value.shape or host.dtype != value.dtype:
                host = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
                self._host[(id(p), key)] = host
            if value.is_cuda:
                stream = streams[value.device]
                with torch.cuda.stream(stream):
                    host.copy_(value, non_blocking=True)
                value.record_stream(stream)  # its memory is reused only once the copy is done
            else:
                host.copy_(value)
            state[key] = host
        for stream in streams.values():
            event = torch.cuda.Event()
            event.record(stream)
            self._pending.append(event)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        # The copies must see the step's writes, and must not overwrite a host buffer that the last
        # restore (on the current stream) may still be reading.
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    @torch.no_grad()
    def restore(self) -> None:
        """Brings the state back to each parameter's device, on the current stream."""
        for device, stream in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)  # the last offload's copies first
        for p, state, key, value in self._entries():
            if value is self._host.get((id(p), key)):
                state[key] = value.to(p.device, non_blocking=True, copy=True)

    def wait(self) -> None:
        """Blocks until the host buffers hold the last offloaded state (before reading them)."""
        for event in self._pending:
            event.synchronize()
        self._pending.clear()

    def remove(self) -> None:
        """Brings the state back and stops offloading."""
        self.restore()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
