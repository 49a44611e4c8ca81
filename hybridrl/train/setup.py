"""How the trained model runs: packed attention, gradient checkpointing, torch.compile."""

from __future__ import annotations

import logging

import torch

from hybridrl.config import ConfigError, TrainConfig
from hybridrl.train.attention import enable_packed_attention, supports_packing
from hybridrl.train.lm_head import tune_lm_head
from hybridrl.train.residual import enable_fp32_residual

log = logging.getLogger("hybridrl.train")


def prepare_for_training(
    model: torch.nn.Module, train: TrainConfig, *, gradient_checkpointing: bool, checkpointed_layers: int | None = None
) -> bool:
    """Applies `model.gradient_checkpointing` (to the first `checkpointed_layers` decoder layers, all
    if None: `model.gradient_checkpointing_layers`), `train.fp32_residual` and `train.packing`;
    returns whether batches are packed.

    Packing "auto" is on for CUDA models with sdpa or eager attention (on CPU the dense packed mask
    costs more than the padding it saves on short sequences).
    """
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
        # transformers also hooks the input embeddings so that their output requires grad, which only
        # reentrant checkpointing of frozen embeddings needs. The hook sets it even under no_grad (the
        # reference pass, a frozen copy of this model), where the first layer group's input then
        # differs from the others' and torch.compile compiles the group twice.
        if hasattr(model, "disable_input_require_grads"):
            model.disable_input_require_grads()
        if checkpointed_layers is not None:
            checkpoint_first_layers(model, checkpointed_layers)
    if train.fp32_residual:
        enable_fp32_residual(model)
    on_cuda = next(model.parameters()).device.type == "cuda"
    packed = train.packing == "on" or (train.packing == "auto" and on_cuda and supports_packing(model))
    if packed:
        kernel = enable_packed_attention(model, train.packed_attention)
        log.info("packed rows: %s attention", kernel if on_cuda else "dense-mask SDPA (CPU)")
    if train.tuned_products and on_cuda:
        tune_products(model)
    return packed


def _decoder_layers(model: torch.nn.Module, fix: str) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    """(the base model, its decoder layers); ConfigError naming `fix` where the model has no such list."""
    base = getattr(model, model.base_model_prefix, model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(f"{type(model).__name__} has no `{model.base_model_prefix}.layers`: {fix}")
    return base, layers


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant activation checkpointing of every decoder layer of an HF model.

    Non-reentrant works with frozen inputs and keyword arguments (the packed attention mask).
    transformers after 5.17 names the method `activation_checkpointing_enable` and keeps
    `gradient_checkpointing_enable` as a deprecated alias until v6; 5.17 has only the old name.
    """
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpoint_first_layers(model: torch.nn.Module, n: int) -> None:
    """Gradient checkpointing for the first `n` decoder layers only (`model.gradient_checkpointing_layers`).

    A spared layer keeps the activations its backward needs instead of its input alone, and the
    backward does not run its forward again: memory for time, layer by layer. The spared layers'
    activations are alive together, from their forward through the lm_head to their backward, on
    top of what the checkpointed layers' recomputation holds later. Measured at W0.5B on an H200
    (compiled groups of four layers, 13,056-token micro-batches): sparing the last 4 of 24 layers
    took the training phase from 1.197 to 1.162 s and the peak from 6.21 to 8.11 GiB; the last 8,
    1.147 s and 10.01 GiB (~0.47 GiB a layer).
    """
    _, layers = _decoder_layers(model, "leave model.gradient_checkpointing_layers unset")
    if not 0 <= n <= len(layers):
        raise ConfigError(f"model.gradient_checkpointing_layers ({n}) must be between 0 and the model's {len(layers)} decoder layers")
    for layer in layers[n:]:
        layer.gradient_checkpointing = False  # transformers' GradientCheckpointingLayer reads it at every call
    log.info("gradient checkpointing: the first %d of %d decoder layers", n, len(layers))


def tune_products(model: torch.nn.Module) -> None:
    """`train.tuned_products`: times cuBLASLt's algorithms for the lm_head's chunk products
    (lm_head.tune_lm_head) and marks the model so that its log-prob passes run the chosen ones. Run
    before training allocates its memory; the reference, a copy of this model, inherits the mark."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        return
    reports = tune_lm_head(head.weight)
    if reports:
        model._hybridrl_tuned_products = True
        for name, r in reports.items():
            if "best_us" in r:
                log.info("train.tuned_products: lm_head %s product %.1f us (PyTorch's %.1f us): %s", name, r["best_us"], r["torch_us"], r["choice"])
            else:
                log.info("train.tuned_products: lm_head %s product: %s", name, r.get("error") or r.get("choice"))


# Decoders whose forward is embed -> rotary -> layers -> norm with nothing else in between, so that
# `grouped_decoder_forward` computes exactly what their HF forward does on a packed row.
GROUPABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class LayerGroup(torch.nn.Module):
    """Consecutive decoder layers run as one compiled graph (`train.compile_layers_per_graph`). It
    refers to the model's own layers (each keeps its gradient checkpointing) and is not registered
    in the model, so parameters, state dicts and the rollout engine's shared weights are unchanged."""

    def __init__(self, layers: list[torch.nn.Module]):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        for layer in self.layers:
            out = layer(hidden_states, **kwargs)
            hidden_states = out[0] if isinstance(out, tuple) else out
        return hidden_states


def compile_layers(model: torch.nn.Module, layers_per_graph: int = 1, *, dynamic_tokens: bool = False) -> None:
    """`torch.compile` of the model's decoder layers (`train.compile`).

    `layers_per_graph` 1: each layer is compiled (one compiled graph serves all of them); gradient
    checkpointing wraps each compiled call, so a micro-batch costs ~3 compiled calls per layer
    (forward, recomputation, backward), each with its own host-side dispatch. N > 1: groups of N
    consecutive layers (`LayerGroup`), checkpointing traced into the graph, so a micro-batch costs ~2
    calls per group; packed rows then run through `grouped_decoder_forward`. A group's backward
    returns the gradients of all its layers at once, so larger groups hold more of them alive
    (N/num_layers of the model's gradients, in the worst case) and compile longer the first time."""
    base, layers = _decoder_layers(model, "set train.compile=false")
    if layers_per_graph < 1:
        raise ConfigError(f"train.compile_layers_per_graph must be >= 1, got {layers_per_graph}")
    if layers_per_graph > 1 and getattr(model.config, "model_type", None) not in GROUPABLE_MODEL_TYPES:
        raise ConfigError(
            f"train.compile_layers_per_graph > 1 runs the decoder's layers outside its HF forward, which is known to be "
            f"equivalent for {', '.join(GROUPABLE_MODEL_TYPES)} models, not {model.config.model_type!r}: set it to 1"
        )
    # Inductor would otherwise keep fp32 where the eager layer rounds to bf16 (RMSNorm, rotary),
    # which moves the trainer's log-probs away from the rollout engine's (it rounds as eager does).
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = True
    unwrapped = plain_module_forwards(layers)
    if unwrapped:
        log.info("train.compile: %d modules run their own forward, not the hub-kernel wrapper (no hub kernel installed)",
                 unwrapped)  # fmt: skip
    if layers_per_graph == 1:
        for layer in layers:
            layer.compile()
        log.info("train.compile: %d decoder layers compiled on first use", len(layers))
        return
    groups = [LayerGroup(list(layers[i : i + layers_per_graph])) for i in range(0, len(layers), layers_per_graph)]
    for group in groups:
        group.compile()
    base._hybridrl_layer_groups = groups  # a plain list: not registered as submodules
    base._hybridrl_dynamic_tokens = dynamic_tokens  # train.compile_dynamic (grouped_decoder_forward)
    log.info("train.compile: %d decoder layers compiled in %d graphs of up to %d", len(layers), len(groups), layers_per_graph)


def plain_module_forwards(layers: torch.nn.Module | list) -> int:
    """Gives back their class's own forward to the modules under `layers` whose forward the `kernels`
    package wraps (its `use_kernelized_func`; Qwen2's and Llama's attention since transformers 5.25,
    which installs `kernels`) while no hub kernel is installed in them. The wrapper only routes calls
    to a hub kernel that `kernels.kernelize` may install; to do so it sets a context variable around
    the call. Inside activation checkpointing traced by torch.compile (compile_layers' groups) that is
    a side effect dynamo will not trace, and each group falls back to eager. With no hub kernel
    installed, the wrapped call computes exactly the class's own forward. A module that `kernelize`
    gave a hub kernel keeps its wrapper. Returns how many modules were changed (the instance's
    `forward` attribute; the class and other models are untouched)."""
    import types

    changed = 0
    for module in layers.modules() if isinstance(layers, torch.nn.Module) else (m for x in layers for m in x.modules()):
        forward = type(module).forward
        own = getattr(forward, "__wrapped__", None)
        wrappers = module.__dict__.get("_kernel_funcs")  # the wrapper's per-instance hub-kernel slots
        by_kernels = getattr(forward, "__globals__", {}).get("__name__", "").split(".")[0] == "kernels"
        if own is None or not by_kernels or not isinstance(wrappers, dict) or "forward" in module.__dict__:
            continue
        if any("forward" in getattr(w, "__dict__", {}) for w in wrappers.values()):  # kernelize installed one
            continue
        module.forward = types.MethodType(own, module)
        changed += 1
    return changed


def grouped_decoder_forward(base: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, **layer_kwargs) -> torch.Tensor:
    """The final hidden states `[1, L, H]` of a packed row through `compile_layers`' layer groups:
    what the model's own forward computes (GROUPABLE_MODEL_TYPES), one compiled call per group."""
    # An offloaded reference whose weights are still on their way (reference.OffloadedWeights, streamed):
    # each stage waits for its own weights only, 0 the embedding, i + 1 decoder layer i.
    gate = getattr(base, "_hybridrl_weights_gate", None)
    if gate is not None:
        gate.before_stage(0)
    hidden = base.embed_tokens(input_ids)
    position_embeddings = base.rotary_emb(hidden, position_ids)
    if getattr(base, "_hybridrl_dynamic_tokens", False):
        _mark_token_dims_dynamic(hidden, position_ids, position_embeddings, layer_kwargs.get("hybridrl_varlen"))
    done = 0
    for group in base._hybridrl_layer_groups:
        done += len(group.layers)
        if gate is not None:
            gate.before_stage(done)
        hidden = group(hidden, position_embeddings=position_embeddings, position_ids=position_ids, **layer_kwargs)
    if gate is not None:
        gate.wait_all()
    return base.norm(hidden)


def _mark_token_dims_dynamic(hidden, position_ids, position_embeddings, segments) -> None:
    """`train.compile_dynamic`: the layer groups are compiled for any number of tokens and segments
    from their first call. Token budgets fill micro-batches unevenly (the last one of a step is
    usually shorter), so otherwise the second size compiles every group again with these dimensions
    dynamic, after a first compilation for one fixed size. (max_q / max_k stay specialised: they
    are bucketed to powers of two, and a new bucket compiles once more.)"""
    mark = torch._dynamo.maybe_mark_dynamic
    mark(hidden, 1)
    mark(position_ids, 1)
    for t in position_embeddings:
        mark(t, 1)
    if segments is not None:  # VarlenSegments (train/attention.py)
        for t in (segments.cu_seq_q, segments.cu_seq_k, segments.kv_index):
            mark(t, 0)
        if segments.kv_copies is not None:  # torch's deterministic mode (train/attention.py, gather_rows)
            mark(segments.kv_copies, 0)
            mark(segments.kv_copies, 1)  # the most copies of a position: 1 + the responses of a prompt
