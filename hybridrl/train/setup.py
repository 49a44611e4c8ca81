"""How the trained model runs: packed attention, gradient checkpointing, torch.compile."""

from __future__ import annotations

import logging
import warnings

import torch

from hybridrl.config import TrainConfig
from hybridrl.train.attention import enable_packed_attention, supports_packing
from hybridrl.train.residual import enable_fp32_residual

log = logging.getLogger("hybridrl.train")


def prepare_for_training(model: torch.nn.Module, train: TrainConfig, *, gradient_checkpointing: bool) -> bool:
    """Applies `model.gradient_checkpointing`, `train.fp32_residual` and `train.packing`; returns
    whether batches are packed.

    Packing "auto" is on for CUDA models with sdpa or eager attention (on CPU the dense packed mask
    costs more than the padding it saves on short sequences).
    """
    if gradient_checkpointing:
        with warnings.catch_warnings():  # renamed activation_checkpointing_enable after 5.17, which has only this name
            warnings.simplefilter("ignore", FutureWarning)
            # Non-reentrant: works with frozen inputs and keyword arguments (the packed attention mask).
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if train.fp32_residual:
        enable_fp32_residual(model)
    on_cuda = next(model.parameters()).device.type == "cuda"
    packed = train.packing == "on" or (train.packing == "auto" and on_cuda and supports_packing(model))
    if packed:
        kernel = enable_packed_attention(model, train.packed_attention)
        log.info("packed rows: %s attention", kernel if on_cuda else "dense-mask SDPA (CPU)")
    return packed


def compile_layers(model: torch.nn.Module, scope: str = "layers") -> None:
    """`torch.compile` of the model's decoder (`train.compile`, `train.compile_scope`).

    "layers": each decoder layer; one compiled graph serves all of them, and gradient checkpointing
    wraps each compiled call, so a micro-batch costs ~3 compiled calls per layer (forward,
    recomputation, backward). "model": the whole decoder (`model.<base_model_prefix>`) as one graph,
    checkpointing traced into it: two calls per micro-batch. Same numbers either way; "model" compiles
    longer the first time and leaves the host far less to do per micro-batch."""
    base = getattr(model, model.base_model_prefix)
    layers = getattr(base, "layers", None)
    if scope not in ("layers", "model"):
        raise ValueError(f"train.compile_scope must be 'layers' or 'model', not {scope!r}")
    if scope == "layers" and not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"train.compile: {type(model).__name__} has no `{model.base_model_prefix}.layers`; set train.compile=false")
    # Inductor would otherwise keep fp32 where the eager layer rounds to bf16 (RMSNorm, rotary),
    # which moves the trainer's log-probs away from the rollout engine's (it rounds as eager does).
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = True
    if scope == "model":
        base.compile()
        log.info("train.compile: the whole %s decoder compiled on first use", type(base).__name__)
        return
    for layer in layers:
        layer.compile()
    log.info("train.compile: %d decoder layers compiled on first use", len(layers))
