"""Response log-probs, entropy and values from a forward pass, without full fp32 logits.

The lm_head is applied to the response positions only, in chunks of the sequence; under
autograd each chunk is checkpointed, so only the hidden states are kept and a chunk's
`[B, chunk, vocab]` logits exist only while that chunk is computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hybridrl.train.batch import SequenceBatch


def _decoder_hidden(model: torch.nn.Module, batch: SequenceBatch) -> torch.Tensor:
    """Last hidden states `[B, L, H]` from the model's base (no lm_head)."""
    base = getattr(model, model.base_model_prefix)
    out = base(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids, use_cache=False)
    return out.last_hidden_state


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, temperature: float, with_entropy: bool):
    logits = F.linear(hidden, weight, bias).float()  # [B, c, V]
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)  # [B, c]
    logprobs = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - logz
    if not with_entropy:
        return logprobs, torch.zeros_like(logprobs)
    probs = torch.softmax(logits, dim=-1)
    entropy = logz - (probs * logits).sum(-1)
    return logprobs, entropy


def response_logprobs(
    model: torch.nn.Module,
    batch: SequenceBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = 512,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs `[B, T]` of the response tokens under softmax(logits / T), and entropy `[B, T]`."""
    hidden = _decoder_hidden(model, batch)
    P = batch.prompt_width
    T = batch.response_mask.shape[1]
    h = hidden[:, P - 1 : P - 1 + T]  # positions that predict the response tokens
    labels = batch.response_ids
    head = model.get_output_embeddings()
    temp = temperature if temperature > 0 else 1.0
    outs_lp, outs_ent = [], []
    for start in range(0, T, chunk_size):
        sl = slice(start, start + chunk_size)
        args = (h[:, sl], head.weight, head.bias, labels[:, sl], temp, with_entropy)
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(*args)
        outs_lp.append(lp)
        outs_ent.append(ent)
    logprobs = torch.cat(outs_lp, dim=1) * batch.response_mask
    entropy = torch.cat(outs_ent, dim=1) * batch.response_mask if with_entropy else None
    return logprobs, entropy


def response_values(critic: torch.nn.Module, batch: SequenceBatch) -> torch.Tensor:
    """Critic values `[B, T]`: V of the prefix before each response token."""
    out = critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids, use_cache=False)
    P = batch.prompt_width
    T = batch.response_mask.shape[1]
    values = out.logits[:, P - 1 : P - 1 + T, 0].float()
    return values * batch.response_mask
