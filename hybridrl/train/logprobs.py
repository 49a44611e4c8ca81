"""Response log-probs, entropy and values from one forward pass, without full fp32 logits.

Only the positions that predict response tokens reach the lm_head (`lm_head.token_logprobs`: in
chunks of tokens, one chunk of logits alive at a time). The decoder runs either on the padded layout
of the `SequenceBatch` or, when `batch.packed`, on one packed row (packing.py, attention.py). Both
return `[B, T]` tensors in the batch's layout, zero on padding.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers.modeling_outputs import BaseModelOutput

from hybridrl.train.attention import BLOCK, check_window, packed_forward_inputs, packed_kernel
from hybridrl.models.loading import to_device
from hybridrl.train.batch import SequenceBatch
from hybridrl.train.lm_head import token_logprobs, token_logprobs_with_grad
from hybridrl.train.packing import pack_sequences
from hybridrl.train.setup import grouped_decoder_forward


def _run(model: torch.nn.Module, batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output `[1 or B, L, ...]` of `model`, flat positions `[N]` predicting the response tokens,
    the tokens `[N]`, their flat places `[N]` in `[B, T]`)."""
    gate = getattr(model, "_hybridrl_weights_gate", None)  # reference.OffloadedWeights, streamed
    if batch.packed:
        on_cuda = batch.input_ids.device.type == "cuda"
        check_window(model.config, int(batch.host_view()[1].sum(1).max()) if batch.size else 0)
        kernel = packed_kernel(model)
        # FlexAttention's BlockMask covers whole tiles: the row is padded to a multiple of one.
        layout = pack_sequences(batch, pad_to_multiple=BLOCK if on_cuda and kernel == "flex" else 1)
        attention = packed_forward_inputs(layout, kernel)
        if getattr(model, "_hybridrl_layer_groups", None):  # train.compile_layers_per_graph > 1
            hidden = grouped_decoder_forward(model, layout.input_ids, layout.position_ids, **attention)
            out = BaseModelOutput(last_hidden_state=hidden)
        else:
            if gate is not None:  # only the grouped forward waits stage by stage
                gate.wait_all()
            out = model(input_ids=layout.input_ids, position_ids=layout.position_ids, use_cache=False, **attention)
        return out, layout.logit_index, layout.labels, layout.target_index
    if gate is not None:
        gate.wait_all()
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids, use_cache=False)
    # Where the response tokens are, read from the host copy: `nonzero` on the device is a host sync.
    rows, cols = (to_device(i, batch.input_ids.device) for i in batch.host_view()[2].nonzero(as_tuple=True))
    L, T = batch.input_ids.shape[1], batch.response_mask.shape[1]
    return out, rows * L + batch.prompt_width - 1 + cols, batch.response_ids[rows, cols], rows * T + cols


def _tuned_products(model: torch.nn.Module) -> bool:
    """Whether the lm_head's products run the algorithms setup.tune_products chose (train.tuned_products)."""
    return getattr(model, "_hybridrl_tuned_products", False)


def _to_batch_layout(values: torch.Tensor, target: torch.Tensor, batch: SequenceBatch) -> torch.Tensor:
    B, T = batch.response_mask.shape
    return values.new_zeros(B * T).index_copy(0, target, values).view(B, T)


def response_logprobs(
    model: torch.nn.Module,
    batch: SequenceBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs `[B, T]` of the response tokens under softmax(logits / T), and entropy `[B, T]`."""
    base = getattr(model, model.base_model_prefix)
    out, positions, labels, target = _run(base, batch)
    hidden = out.last_hidden_state.flatten(0, 1)[positions]  # [N, H]
    head = model.get_output_embeddings()
    logprobs, entropy = token_logprobs(
        hidden, head.weight, head.bias, labels, temperature=temperature, chunk=chunk_size, tuned=_tuned_products(model)
    )
    logprobs = _to_batch_layout(logprobs, target, batch)
    return logprobs, (_to_batch_layout(entropy, target, batch) if with_entropy else None)


def response_logprobs_with_grad(
    model: torch.nn.Module,
    batch: SequenceBatch,
    derivatives: Callable[..., tuple[torch.Tensor | None, torch.Tensor | None]],
    inputs: dict[str, torch.Tensor],
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """response_logprobs for a loss that is a sum of per-token terms, each depending on its own
    token's log-prob and entropy alone (the policy loss: PPO-clip, KL to the reference, entropy
    bonus, under any loss aggregation). `derivatives(lp, entropy, **inputs)` gives the loss's
    derivatives (d / d lp, d / d entropy; either may be None) for a chunk of tokens `[c]`, with
    `inputs` (`[B, T]` tensors) picked at those tokens. Returns log-probs and entropy `[B, T]`
    (detached) and a 0-dim zero carrying the loss's gradient: add it to the loss
    (`lm_head.token_logprobs_with_grad`: each chunk's logits are computed once, not twice)."""
    base = getattr(model, model.base_model_prefix)
    out, positions, labels, target = _run(base, batch)
    hidden = out.last_hidden_state.flatten(0, 1)[positions]  # [N, H]
    head = model.get_output_embeddings()
    per_token = {k: v.reshape(-1)[target] for k, v in inputs.items()}  # in the lm_head's token order, once

    def token_grads(rows: slice, lp: torch.Tensor, ent: torch.Tensor):
        return derivatives(lp, ent, **{k: v[rows] for k, v in per_token.items()})

    logprobs, entropy, surrogate = token_logprobs_with_grad(
        hidden, head.weight, head.bias, labels, token_grads, temperature=temperature, chunk=chunk_size,
        tuned=_tuned_products(model),
    )
    return _to_batch_layout(logprobs, target, batch), _to_batch_layout(entropy, target, batch), surrogate


def response_values(critic: torch.nn.Module, batch: SequenceBatch) -> torch.Tensor:
    """Critic values `[B, T]`: V of the prefix before each response token."""
    out, positions, _, target = _run(critic, batch)
    values = out.logits.flatten(0, 1)[positions, 0].float()
    return _to_batch_layout(values, target, batch)
