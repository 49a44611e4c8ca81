"""The frozen reference policy, optionally kept in CPU memory between its uses (`train.offload_reference`).

The reference is needed once per step, for one forward pass. Offloaded, its weights live in one
pinned CPU buffer per dtype and are copied to the GPU for that pass only (W0.5B: 1 GB over PCIe);
since they never change, nothing is copied back, and the GPU copy is simply dropped afterwards.
`prefetch()` starts the copy on a side stream once the rollout has released its KV cache, so it runs
while the host lays out the batch.

Starting it before the rollout instead would hide the copy entirely, but the weights would then sit
beside the KV cache: at W0.5B on an H200 that took `timing/batch` from ~0.04 to ~0.01 s and raised
the step's peak allocated memory from 6.36 to 6.63 GiB (the rollout's peak plus 0.92 GiB came out
above training's), past half of TRL's 13.2 GiB. So the copy waits for the rollout.

Streamed (`train.stream_reference`, where the pass runs through compiled layer groups): the buffers
are laid out in the order a decoder's forward reaches its weights (the token embedding, each decoder
layer, the rest) and copied stage by stage, an event after each. `prefetch()` sends the embedding
only. The rest is sent when the pass asks for its first stage, after the pass's own inputs (the
packed row's token ids and segments) were queued for the device: copies to the GPU appear to run
one after another in the order they were issued, whatever their stream (sent with the rest at the
pass's start, W1.5B's reference phase grew by what the batch phase lost). The pass then waits for
each stage's event just before the stage runs (`setup.grouped_decoder_forward` asks `StageGate`).
At W1.5B a layer's weights cross PCIe in ~2 ms and its share of the first forward takes ~5 ms, so
past the first group the pass should not wait. Measured on an H200 (train/NOTES.md, session 34) it
gains less than that: the batch phase got 9-57 ms shorter, the reference pass 10-36 ms longer;
W0.5B's step did not move, W1.5B's batch and reference phases took 0.823 s against 0.844 s in one
call. So it is off by default.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_ALIGN = 64  # elements: every parameter's view starts 128-byte aligned (bf16) in its flat buffer


def forward_stages(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[list[int]]:
    """Indices into `params` in the order a decoder's forward reaches them: the token embedding, each
    decoder layer, then the rest (the final norm, an untied lm_head). One stage with all of them where
    the model is not laid out so (`embed_tokens`, `layers`, `norm` on its base), a parameter is shared
    between stages, or some other parameter might be needed before the final norm."""
    everything = [list(range(len(params)))]
    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    embed, layers, norm = (getattr(base, name, None) for name in ("embed_tokens", "layers", "norm"))
    if not (isinstance(embed, torch.nn.Module) and isinstance(layers, torch.nn.ModuleList) and isinstance(norm, torch.nn.Module)):
        return everything
    index = {id(p): i for i, p in enumerate(params)}
    stages = [[index[id(p)] for p in module.parameters()] for module in (embed, *layers)]
    staged = {i for stage in stages for i in stage}
    if len(staged) != sum(map(len, stages)):
        return everything
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    late = {id(p) for p in norm.parameters()} | ({id(p) for p in head.parameters()} if head is not None else set())
    rest = [i for i in range(len(params)) if i not in staged]
    if any(id(params[i]) not in late for i in rest):
        return everything
    return stages + [rest]


class StageGate:
    """Makes a stream wait for the copy of a forward's weights stage by stage (events recorded after
    each stage's copy, on one side stream, so an event also covers every stage before it)."""

    def __init__(self, events: list, stream, send_rest=None):
        self.events = events
        self.stream = stream
        self.send_rest = send_rest  # called once, at the first stage asked for: issues the copies not yet issued
        self.ready = -1  # the stages up to here have been waited for

    def before_stage(self, stage: int) -> None:
        """Called on the host before stage `stage`'s kernels are issued (0: the embedding, i + 1:
        decoder layer i); later calls for a stage already waited for cost nothing."""
        if self.send_rest is not None:
            self.send_rest, send = None, self.send_rest
            send()
        stage = min(stage, len(self.events) - 1)
        if stage > self.ready:
            self.stream.wait_event(self.events[stage])
            self.ready = stage

    def wait_all(self) -> None:
        self.before_stage(len(self.events) - 1)


class OffloadedWeights:
    """Moves a frozen model's parameters to pinned CPU memory; `on_device()` brings them back for a while.

    The parameters of one dtype share one flat buffer, so a copy either way is a few transfers per
    dtype (one per stage when streamed), not one per parameter (W0.5B: 290 parameters)."""

    def __init__(self, model: torch.nn.Module, *, streamed: bool = False):
        self.device = next(model.parameters()).device
        pin = self.device.type == "cuda"
        self.params = list(model.parameters())
        self.base = getattr(model, getattr(model, "base_model_prefix", ""), model)
        self.stages = forward_stages(model, self.params)
        self.streamed = streamed and len(self.stages) > 1
        offsets: list[int] = [0] * len(self.params)
        sizes: dict[torch.dtype, int] = {}
        self._ranges: list[dict[torch.dtype, tuple[int, int]]] = []  # each stage's slice of each flat buffer
        for stage in self.stages:  # laid out stage by stage: a stage is one slice per dtype
            first = dict(sizes)
            for i in stage:
                p = self.params[i]
                offsets[i] = sizes.get(p.dtype, 0)
                sizes[p.dtype] = offsets[i] + -(-p.numel() // _ALIGN) * _ALIGN
            self._ranges.append({dtype: (first.get(dtype, 0), end) for dtype, end in sizes.items() if end > first.get(dtype, 0)})
        self.flat = {dtype: torch.empty(n, dtype=dtype, pin_memory=pin) for dtype, n in sizes.items()}
        self._slots = [(p.dtype, off, p.shape) for p, off in zip(self.params, offsets)]
        self.host: list[torch.Tensor] = self._views(self.flat)
        for p, host in zip(self.params, self.host):
            host.copy_(p.detach())
            p.data = host
        self._stream: torch.cuda.Stream | None = None
        self._events: list[torch.cuda.Event] = []
        self._prefetched: dict[torch.dtype, torch.Tensor] | None = None
        self._issued = 0  # stages whose copy to the device has been issued (since the last prefetch)

    def _views(self, flat: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
        return [flat[dtype][off : off + shape.numel()].view(shape) for dtype, off, shape in self._slots]

    def _copy_to_device(self) -> dict[torch.dtype, torch.Tensor]:
        return {dtype: host.to(self.device, non_blocking=True) for dtype, host in self.flat.items()}

    def gated(self) -> bool:
        """Whether the pass will wait for each stage as it reaches it: streamed, and the model runs
        through compiled layer groups (setup.grouped_decoder_forward, which asks the gate)."""
        return self.streamed and bool(getattr(self.base, "_hybridrl_layer_groups", None))

    def _issue(self, device_flat: dict[torch.dtype, torch.Tensor], upto: int) -> None:
        """Issues the copies of stages [_issued, upto) into `device_flat` on the side stream, each
        followed by its event."""
        while len(self._events) < len(self.stages):
            self._events.append(torch.cuda.Event())
        with torch.cuda.stream(self._stream):
            for s in range(self._issued, upto):
                for dtype, (lo, hi) in self._ranges[s].items():
                    device_flat[dtype][lo:hi].copy_(self.flat[dtype][lo:hi], non_blocking=True)
                self._events[s].record(self._stream)
        self._issued = max(self._issued, upto)

    @property
    def prefetched(self) -> bool:
        return self._prefetched is not None

    def prefetch(self) -> None:
        """Starts the copy to the device on a side stream, so that it runs while the GPU does other
        work; the next `on_device()` waits for it instead of copying. Gated (`gated()`), only the
        first stage (the embedding) is sent now, and the rest when the pass begins. No-op off CUDA,
        or if a copy is already on its way."""
        if self.device.type != "cuda" or self._prefetched is not None:
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        if not self.gated():  # the whole copy now: one transfer per dtype
            with torch.cuda.stream(self._stream):
                self._prefetched = self._copy_to_device()
            self._issued = len(self.stages)
            return
        with torch.cuda.stream(self._stream):
            self._prefetched = {dtype: torch.empty_like(host, device=self.device) for dtype, host in self.flat.items()}
        self._issued = 0
        self._issue(self._prefetched, 1)

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        gate = None
        if self._prefetched is not None:
            current = torch.cuda.current_stream(self.device)
            flat, self._prefetched = self._prefetched, None
            for t in flat.values():  # allocated on the side stream, used and freed on this one
                t.record_stream(current)
            if self.gated():  # the stages prefetch() left go once the pass has queued its inputs
                send_rest = lambda flat=flat: self._issue(flat, len(self.stages))  # noqa: E731
                gate = self.base._hybridrl_weights_gate = StageGate(self._events, current, send_rest)
            else:
                current.wait_stream(self._stream)
        else:
            flat = self._copy_to_device()
        for p, t in zip(self.params, self._views(flat)):
            p.data = t
        del flat
        try:
            yield
        finally:
            if gate is not None:
                del self.base._hybridrl_weights_gate
                gate.wait_all()  # a stage no pass reached: its copy ends before its memory can be reused
            for p, host in zip(self.params, self.host):
                p.data = host


def weights_on_device(offloaded: OffloadedWeights | None):
    """`offloaded.on_device()`, or nothing to do when the model stays on its device."""
    return offloaded.on_device() if offloaded is not None else contextlib.nullcontext()
