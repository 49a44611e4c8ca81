"""Offline algorithms (SFT, DPO, KTO): how each reads its data and computes its loss.

Each is a small class chosen by name from OFFLINE_ALGORITHMS. The trainer gives it batches of
examples and asks for a loss per micro-batch; batching, updates, checkpoints and metrics are
shared with RL.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from hybridrl.algos import Registry, bradley_terry_loss, dpo_loss, kto_loss, sft_loss
from hybridrl.config import Config
from hybridrl.data import load_preference_dataset, load_sft_dataset, load_unpaired_dataset
from hybridrl.reward.model import right_padded, sequence_scores
from hybridrl.train.batch import SequenceBatch, build_sequence_batch, split_indices
from hybridrl.train.logprobs import response_logprobs

OFFLINE_ALGORITHMS: Registry = Registry("offline algorithm")


def sequence_logps(model: torch.nn.Module, batch: SequenceBatch) -> torch.Tensor:
    """Summed log-probs `[B]` of each sequence's completion tokens."""
    logprobs, _ = response_logprobs(model, batch)
    return logprobs.sum(-1)


def completion_batch(prompts: Sequence[list[int]], completions: Sequence[list[int]], pad_id: int) -> SequenceBatch:
    return build_sequence_batch(prompts, completions, pad_id)


class OfflineAlgorithm:
    needs_reference = False

    def __init__(self, config: Config, tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id

    def load(self, source: Any) -> list:
        raise NotImplementedError

    def micro_batches(self, examples: list, micro_size: int) -> list[Any]:
        return [[examples[i] for i in idx] for idx in split_indices(len(examples), micro_size)]

    def normaliser(self, examples: list) -> dict[str, float]:
        """Counts over the whole mini-batch that micro-batch losses are divided by."""
        return {"num_seqs": float(len(examples))}

    def loss(self, model, ref_model, micro: list, norm: dict[str, float], device) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def logps_with_reference(self, model, ref_model, prompts, completions, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed completion log-probs `[B]` under the policy (with gradients) and the frozen reference."""
        batch = completion_batch(prompts, completions, self.pad_id).to(device)
        logps = sequence_logps(model, batch)
        with torch.no_grad():
            ref_logps = sequence_logps(ref_model, batch)
        return logps, ref_logps


@OFFLINE_ALGORITHMS.register("sft")
class SFT(OfflineAlgorithm):
    """Cross-entropy on the tokens whose loss mask is 1 (responses / assistant turns)."""

    def load(self, source):
        d = self.config.data
        return load_sft_dataset(source, self.tokenizer, prompt_key=d.prompt_key, response_key=d.response_key,
                                messages_key=d.messages_key, max_length=d.max_length, on_bad_row=d.on_bad_row)

    def _batch(self, examples) -> SequenceBatch:
        # Split each example at its first trained token: the prefix is the "prompt" of the layout.
        prompts, completions, masks = [], [], []
        for ex in examples:
            k = max(1, ex.loss_mask.index(1) if 1 in ex.loss_mask else len(ex.input_ids) - 1)
            prompts.append(ex.input_ids[:k])
            completions.append(ex.input_ids[k:])
            masks.append(ex.loss_mask[k:])
        batch = completion_batch(prompts, completions, self.pad_id)
        for b, m in enumerate(masks):
            batch.response_mask[b, : len(m)] = torch.tensor(m, dtype=torch.float32)
        return batch

    def normaliser(self, examples):
        return {"num_tokens": float(sum(sum(ex.loss_mask) for ex in examples)), "num_seqs": float(len(examples))}

    def loss(self, model, ref_model, micro, norm, device):
        batch = self._batch(micro).to(device)
        logprobs, _ = response_logprobs(model, batch)
        loss, _ = sft_loss(logprobs, batch.response_mask, loss_agg="token-mean", num_tokens=norm["num_tokens"])
        return loss, {"sft/loss": float(loss.detach())}


@OFFLINE_ALGORITHMS.register("dpo")
class DPO(OfflineAlgorithm):
    """Direct preference optimisation against a frozen reference (Rafailov et al. 2023)."""

    needs_reference = True

    def load(self, source):
        d = self.config.data
        return load_preference_dataset(source, self.tokenizer, prompt_key=d.prompt_key, chosen_key=d.chosen_key,
                                       rejected_key=d.rejected_key, max_length=d.max_length, on_bad_row=d.on_bad_row)

    def loss(self, model, ref_model, micro, norm, device):
        prompts = [ex.prompt_ids for ex in micro] * 2
        completions = [ex.chosen_ids for ex in micro] + [ex.rejected_ids for ex in micro]
        logps, ref_logps = self.logps_with_reference(model, ref_model, prompts, completions, device)
        n = len(micro)
        a = self.config.algorithm
        loss, m = dpo_loss(logps[:n], logps[n:], ref_logps[:n], ref_logps[n:], beta=a.beta, loss_type=a.dpo_loss,
                           label_smoothing=a.label_smoothing)
        metrics = {}
        if a.rpo_alpha > 0:
            # RPO (Pang et al. 2024, Eq. 6): add the chosen responses' per-token NLL, so DPO cannot
            # lower the likelihood of the preferred answers while it widens the margin.
            lengths = torch.tensor([len(ex.chosen_ids) for ex in micro], dtype=logps.dtype, device=logps.device)
            nll = -(logps[:n] / lengths).mean()
            loss = loss + a.rpo_alpha * nll
            metrics["dpo/nll_chosen"] = float(nll.detach())
        share = n / norm["num_seqs"]  # dpo_loss is a mean over the micro-batch
        return loss * share, metrics | {
            "dpo/loss": float(loss.detach()) * share,
            "dpo/rewards/chosen": float(m["rewards/chosen"]),
            "dpo/rewards/rejected": float(m["rewards/rejected"]),
            "dpo/reward_accuracy": float(m["reward_accuracy"]),
            "dpo/margin": float(m["margin"]),
        }


@OFFLINE_ALGORITHMS.register("kto")
class KTO(OfflineAlgorithm):
    """Kahneman-Tversky optimisation on unpaired desirable / undesirable completions (Ethayarajh et al. 2024)."""

    needs_reference = True

    def load(self, source):
        d = self.config.data
        return load_unpaired_dataset(source, self.tokenizer, prompt_key=d.prompt_key, completion_key=d.completion_key,
                                     label_key=d.label_key, max_length=d.max_length, on_bad_row=d.on_bad_row)

    def loss(self, model, ref_model, micro, norm, device):
        n = len(micro)
        prompts = [ex.prompt_ids for ex in micro]
        completions = [ex.completion_ids for ex in micro]
        # The KL reference point uses mismatched pairs: each prompt with the next example's completion.
        shifted = completions[1:] + completions[:1]
        logps, ref_logps = self.logps_with_reference(model, ref_model, prompts + prompts, completions + shifted, device)
        labels = torch.tensor([ex.label for ex in micro], dtype=torch.bool, device=device)
        a = self.config.algorithm
        loss, m = kto_loss(logps[:n], ref_logps[:n], labels, logps[n:].detach(), ref_logps[n:], beta=a.beta,
                           desirable_weight=a.desirable_weight, undesirable_weight=a.undesirable_weight)
        share = n / norm["num_seqs"]
        out = {"kto/loss": float(loss.detach()) * share, "kto/kl": float(m["kl"])}
        for key in ("rewards/chosen", "rewards/rejected"):
            if key in m and torch.isfinite(torch.as_tensor(m[key])):
                out[f"kto/{key}"] = float(m[key])
        return loss * share, out


@OFFLINE_ALGORITHMS.register("rm")
class RewardModeling(OfflineAlgorithm):
    """A reward model (sequence classifier, one output) on preference pairs with the Bradley-Terry
    loss, plus `algorithm.rm_margin` if set (Ouyang et al. 2022, eq. 1; Touvron et al. 2023, eq. 2).
    Pairs are encoded as DPO's are, so `RewardEngine.from_hf` scores rollouts the way it was trained."""

    def load(self, source):
        d = self.config.data
        return load_preference_dataset(source, self.tokenizer, prompt_key=d.prompt_key, chosen_key=d.chosen_key,
                                       rejected_key=d.rejected_key, max_length=d.max_length, on_bad_row=d.on_bad_row)

    def loss(self, model, ref_model, micro, norm, device):
        n = len(micro)
        sequences = [ex.prompt_ids + ex.chosen_ids for ex in micro] + [ex.prompt_ids + ex.rejected_ids for ex in micro]
        batch = right_padded(sequences, self.pad_id)
        rewards = sequence_scores(model, batch.input_ids.to(device), batch.attention_mask().to(device))  # [2n]
        margin = torch.full((n,), self.config.algorithm.rm_margin, device=device) if self.config.algorithm.rm_margin else None
        loss, m = bradley_terry_loss(rewards[:n], rewards[n:], margin)
        share = n / norm["num_seqs"]  # the loss is a mean over the micro-batch
        return loss * share, {"rm/loss": float(loss.detach()) * share, "rm/accuracy": float(m["accuracy"]),
                              "rm/margin": float(m["margin"])}


def get_offline_algorithm(name: str, config: Config, tokenizer) -> OfflineAlgorithm:
    return OFFLINE_ALGORITHMS.get(name)(config, tokenizer)
