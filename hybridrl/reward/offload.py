"""Running a decoder-only sequence classifier for scoring, with its weights either resident on the
device or kept in CPU memory and streamed to the device one decoder layer at a time.

`LayerRunner.scores(batches)` is the one entry point. The model's own forward builds what its
decoder layers are given (embeddings, attention masks, rotary tables): for that call the layers are
swapped for recorders that keep each layer's inputs, then the runner applies the real layers
itself, layer-major over a *wave* of micro-batches:

    for each wave:  record its micro-batches' layer inputs
                    for layer i:  wait for layer i's weights; start copying layer i+1's (side stream)
                                  run layer i on every micro-batch of the wave; free layer i
                    final norm at each row's last token, then the scalar head

So with `offload=True` each layer crosses the host link once per wave, not once per micro-batch,
and the device holds at most two layers' weights, the wave's hidden states and one micro-batch's
activations; nothing stays on the device between calls. The embedding table never moves: the
lookup happens in CPU memory and only its output `[B, T, H]` is copied. With `offload=False` the
same code runs on the weights in place, so the two modes compute the same numbers.

Supports the Llama layout that decoder reward models use (Llama, Qwen2/3, Mistral, Gemma):
`model.base_model.{embed_tokens, layers, norm}` and a `model.score` head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.func import functional_call

LAYOUT_FIX = ("a decoder-only AutoModelForSequenceClassification with the Llama layout "
              "(base_model.embed_tokens / .layers / .norm and a `score` head)")


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, T] right-padded, on the CPU
    lengths: torch.Tensor  # [B] real tokens per row

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def attention_mask(self) -> torch.Tensor:  # [B, T]
        positions = torch.arange(self.input_ids.shape[1])
        return (positions[None, :] < self.lengths[:, None]).long()


@dataclass
class _LayerInputs:
    hidden: torch.Tensor  # [B, T, H] on the device: the input of the next layer to run
    calls: list[tuple[tuple, dict[str, Any]]]  # per layer: the (extra args, kwargs) the model passes it
    lengths: torch.Tensor  # [B] on the device


class _Recorder(torch.nn.Module):
    """Stands in for one decoder layer during the recording forward: keeps its inputs, changes nothing."""

    def __init__(self, sink: list):
        super().__init__()
        self.sink = sink

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.sink.append((hidden_states, args, kwargs))
        return hidden_states


class _PackedWeights:
    """A module's parameters and buffers moved into one flat CPU buffer per dtype (pinned when the
    device is a GPU, so copies are asynchronous); the module's tensors become views of it."""

    def __init__(self, module: torch.nn.Module, pin: bool):
        named = list(module.named_parameters()) + list(module.named_buffers())
        self.groups: list[tuple[torch.Tensor, list[tuple[str, int, torch.Size]]]] = []
        for dtype in sorted({t.dtype for _, t in named}, key=str):
            members = [(name, t) for name, t in named if t.dtype == dtype]
            flat = torch.empty(sum(t.numel() for _, t in members), dtype=dtype, pin_memory=pin)
            layout, offset = [], 0
            for name, tensor in members:
                view = flat[offset:offset + tensor.numel()]
                view.copy_(tensor.detach().reshape(-1))
                tensor.data = view.view(tensor.shape)
                layout.append((name, offset, tensor.shape))
                offset += tensor.numel()
            self.groups.append((flat, layout))

    @property
    def num_bytes(self) -> int:
        return sum(flat.numel() * flat.element_size() for flat, _ in self.groups)

    def allocate(self, device: torch.device) -> list[torch.Tensor]:
        return [torch.empty_like(flat, device=device) for flat, _ in self.groups]

    def copy_into(self, buffers: list[torch.Tensor], non_blocking: bool) -> dict[str, torch.Tensor]:
        """Copies the weights into `buffers` (from `allocate`); returns the named device views."""
        tensors = {}
        for (flat, layout), on_device in zip(self.groups, buffers, strict=True):
            on_device.copy_(flat, non_blocking=non_blocking)
            for name, offset, shape in layout:
                tensors[name] = on_device[offset:offset + shape.numel()].view(shape)
        return tensors


def _own_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def check_layout(model: torch.nn.Module) -> None:
    base = model.base_model
    missing = [name for name in ("embed_tokens", "layers", "norm") if not hasattr(base, name)]
    if missing or not hasattr(model, "score") or base is model:
        raise ValueError(f"{type(model).__name__} is not {LAYOUT_FIX} (missing: {missing or ['score']}); "
                         "reward models must be decoder sequence classifiers with num_labels=1")


class LayerRunner:
    """Scores micro-batches with `model` (see the module docstring).

    `offload=True`: the weights stay in CPU memory and are streamed to `device` layer by layer;
    `max_wave_tokens` bounds the padded tokens whose hidden states are held on the device at once
    (more tokens per wave: fewer weight transfers, more device memory). `offload=False`: the model
    is moved to `device` once and stays there.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, *, offload: bool, max_wave_tokens: int):
        check_layout(model)
        self.model = model.eval().requires_grad_(False)
        self.device = device
        self.offload = offload
        self.max_wave_tokens = max_wave_tokens
        self.base = model.base_model
        self.layers = list(self.base.layers)
        on_gpu = device.type == "cuda"
        if offload:
            self.model.to("cpu")
            self.packs = [_PackedWeights(layer, pin=on_gpu) for layer in self.layers]
            self.copy_stream = torch.cuda.Stream(device) if on_gpu else None
        else:
            self.model.to(device)
            self.packs = []
            self.copy_stream = None

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.model.parameters())

    # ---- one scoring call ----------------------------------------------------------------------
    @torch.inference_mode()
    def scores(self, batches: list[MicroBatch]) -> list[torch.Tensor]:
        """One float32 score per row of each micro-batch, on the CPU, in the order given."""
        if not batches:
            return []
        waves = self._waves(batches)
        small = self._small_tensors()  # final norm, rotary tables, head: tiny, copied per call
        out: list[torch.Tensor] = []
        pending = self._fetch(0)
        for w, wave in enumerate(waves):
            states = [self._record(batch, small) for batch in wave]
            for i in range(len(self.layers)):
                weights = self._wait(pending)
                last = w == len(waves) - 1 and i == len(self.layers) - 1
                # Queued before layer i's work, so the copy runs while layer i computes.
                pending = None if last else self._fetch((i + 1) % len(self.layers))
                for state in states:
                    extra, kwargs = state.calls[i]
                    state.hidden = functional_call(self.layers[i], weights, (state.hidden, *extra), kwargs)
                del weights  # layer i's device copy is freed once its work is done
            out.extend(self._head(state, small) for state in states)
        return out

    def _waves(self, batches: list[MicroBatch]) -> list[list[MicroBatch]]:
        if not self.offload:  # weights are resident: nothing to amortise, keep one micro-batch on the device
            return [[batch] for batch in batches]
        waves, tokens = [[]], 0
        for batch in batches:
            if waves[-1] and tokens + batch.num_tokens > self.max_wave_tokens:
                waves.append([])
                tokens = 0
            waves[-1].append(batch)
            tokens += batch.num_tokens
        return waves

    def _small_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """Device tensors of everything but the embedding table and the layers, by module."""
        skip = ("embed_tokens.", "layers.")
        base = {k: v for k, v in _own_tensors(self.base).items() if not k.startswith(skip)}
        head = _own_tensors(self.model.score)
        if self.offload:
            base = {k: v.to(self.device) for k, v in base.items()}
            head = {k: v.to(self.device) for k, v in head.items()}
        return {"base": base, "head": head, "norm": {k[len("norm."):]: v for k, v in base.items() if k.startswith("norm.")}}

    def _record(self, batch: MicroBatch, small: dict) -> _LayerInputs:
        """The inputs the model's forward gives each decoder layer for `batch` (layers not run)."""
        embed = self.base.embed_tokens
        embeds = embed(batch.input_ids.to(embed.weight.device)).to(self.device)
        sink: list = []
        real_layers = self.base.layers
        self.base.layers = torch.nn.ModuleList(_Recorder(sink) for _ in self.layers)
        try:
            functional_call(self.base, small["base"], (), {
                "inputs_embeds": embeds, "attention_mask": batch.attention_mask().to(self.device), "use_cache": False,
            })
        finally:
            self.base.layers = real_layers
        assert len(sink) == len(self.layers), f"the forward called {len(sink)} of {len(self.layers)} layers"
        hidden = sink[0][0]  # the embeddings as layer 0 sees them (after any scaling the model applies)
        return _LayerInputs(hidden, [(args, kwargs) for _, args, kwargs in sink], batch.lengths.to(self.device))

    def _head(self, state: _LayerInputs, small: dict) -> torch.Tensor:
        rows = torch.arange(state.hidden.shape[0], device=self.device)
        last = state.hidden[rows, state.lengths - 1]  # [B, H] each row's last real token
        normed = functional_call(self.base.norm, small["norm"], (last,))
        return functional_call(self.model.score, small["head"], (normed,))[:, 0].float().cpu()

    # ---- weights -------------------------------------------------------------------------------
    def _fetch(self, i: int):
        """Starts making layer i's weights available on the device; `_wait` returns them."""
        if not self.offload:
            return _own_tensors(self.layers[i]), None
        buffers = self.packs[i].allocate(self.device)
        if self.copy_stream is None:  # the CPU as the "device": a plain copy
            return self.packs[i].copy_into(buffers, non_blocking=False), None
        # The buffers were allocated on the compute stream, so freeing them follows its work; the
        # copy waits for the work queued so far, which may still read the memory they reuse.
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            tensors = self.packs[i].copy_into(buffers, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        return tensors, done

    def _wait(self, pending) -> dict[str, torch.Tensor]:
        tensors, done = pending
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        return tensors
