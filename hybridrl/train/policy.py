"""The actor: log-prob passes and the policy update (PPO-clip surrogate + KL + entropy)."""

from __future__ import annotations

import functools

import torch

from hybridrl.algos import aggregate_loss, get_policy_loss, kl_penalty, masked_mean
from hybridrl.algos.kl import KL_ESTIMATOR_GRADS, kl_penalty_grad
from hybridrl.algos.policy_loss import ppo_token_loss_grad
from hybridrl.config import AlgorithmConfig, TrainConfig
from hybridrl.train.batch import SequenceBatch, rows_on
from hybridrl.train.logprobs import response_logprobs, response_logprobs_with_grad
from hybridrl.train.packing import Work, micro_batch_work, micro_batches
from hybridrl.train.epochs import update_epochs


def logprob_diff_metrics(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *, as_tensors: bool = False) -> dict:
    """How far the rollout engine's log-probs are from the trainer's: a mismatch shows here."""
    diff = (trainer_logprobs - rollout_logprobs).abs() * mask
    out = {"rollout/logprob_diff/mean": masked_mean(diff, mask), "rollout/logprob_diff/max": diff.max()}
    return out if as_tensors else {k: float(v) for k, v in out.items()}


@torch.no_grad()
def batched_logprobs(
    model: torch.nn.Module, batch: SequenceBatch, *, micro_batch_size: int, temperature: float, max_tokens: int | None = None
) -> tuple[torch.Tensor, Work]:
    """Log-probs `[B, T]` of the batch's responses, micro-batch by micro-batch, and the work done.

    The one forward structure of every log-prob pass without gradients (reference, old policy):
    the same micro-batches (token budget, packing) as the update, so their numbers agree with it.
    """
    T = batch.response_mask.shape[1]
    out = torch.zeros(batch.size, T, dtype=torch.float32, device=batch.input_ids.device)
    work = Work()
    for idx, micro in micro_batches(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens):
        work += micro_batch_work(micro)
        lp, _ = response_logprobs(model, micro, temperature=temperature)
        out[rows_on(idx, out.device), : lp.shape[1]] = lp
    return out, work


def token_loss_derivatives(
    lp: torch.Tensor,
    weight: torch.Tensor,
    advantages: torch.Tensor,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    kl_coef: float,
    kl_estimator: str | None,
    entropy_coef: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """d loss / d log-prob and d loss / d entropy of PolicyTrainer._objective for a chunk of tokens
    `[c]` (each token's aggregation weight given): PPO-clip, plus kl_coef x the KL estimator to
    `ref` (kl_estimator None: no KL term), minus the entropy bonus."""
    old = lp if old is None else old  # exactly on-policy: the old log-probs are these
    g_lp = ppo_token_loss_grad(lp, old, advantages, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    if kl_estimator is not None:
        g_lp = g_lp + kl_coef * kl_penalty_grad(lp, ref, kl_estimator)
    g_ent = -entropy_coef * weight if entropy_coef > 0 else None
    return weight * g_lp, g_ent


@functools.cache
def _compiled_token_loss_derivatives():
    """token_loss_derivatives as one compiled graph for any chunk length (the last chunk is shorter)."""
    return torch.compile(token_loss_derivatives, dynamic=True, fullgraph=True)


class PolicyTrainer:
    """Updates the actor on a batch that carries advantages, old and (optionally) reference log-probs."""

    def __init__(self, model, optimizer, scheduler, train: TrainConfig, algo: AlgorithmConfig, temperature: float):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train_cfg = train
        self.algo = algo
        self.temperature = temperature
        self.policy_loss = get_policy_loss("ppo")
        self.work = Work()  # computed by the last update, for MFU

    def update(self, batch: SequenceBatch, *, shuffle_seed: int) -> tuple[dict[str, float], int]:
        """PPO epochs over mini-batches; returns (metrics, number of skipped non-finite updates)."""
        metrics, skipped, self.work = update_epochs(
            self.model, self.optimizer, self.scheduler, batch, self.train_cfg, self._loss, shuffle_seed=shuffle_seed, prefix="actor"
        )
        return metrics, skipped

    def _loss(self, micro: SequenceBatch, *, num_tokens: float, num_seqs: float, max_len: int):
        agg = dict(num_tokens=num_tokens, num_seqs=num_seqs, max_response_length=max_len)
        # Entropy is always computed: it is reported every step, and costs little next to the logits.
        if self.train_cfg.fused_logprob_grad and self._closed_form():
            # The objective is a sum of per-token terms whose derivatives are known in closed form,
            # so its gradient is made in the lm_head's forward pass: each chunk's logits once, not twice.
            derivatives, inputs = self._token_derivatives(micro, agg)
            logprobs, entropy, surrogate = response_logprobs_with_grad(
                self.model, micro, derivatives, inputs, temperature=self.temperature
            )  # fmt: skip
            loss, metrics = self._objective(micro, logprobs, entropy, agg)
            return loss.detach() + surrogate, metrics
        logprobs, entropy = response_logprobs(self.model, micro, temperature=self.temperature, with_entropy=True)
        return self._objective(micro, logprobs, entropy, agg)

    def _kl_in_loss(self) -> bool:
        """Whether the KL to the reference is a term of the loss (not subtracted from the reward)."""
        return self.algo.kl_coef > 0 and not self.algo.kl_in_reward

    def _closed_form(self) -> bool:
        return not (self._kl_in_loss() and self.algo.kl_estimator not in KL_ESTIMATOR_GRADS)

    def _token_derivatives(self, micro: SequenceBatch, agg: dict):
        """The derivatives of _objective with respect to each token's log-prob and entropy, in
        closed form (algos: ppo_token_loss_grad, kl_penalty_grad), as a function of a chunk of
        tokens, and the `[B, T]` inputs it reads. Each token's weight in the loss aggregation is the
        aggregation's own derivative (it is linear in the per-token losses)."""
        algo, mask = self.algo, micro.response_mask
        probe = torch.zeros_like(mask, dtype=torch.float32, requires_grad=True)
        with torch.enable_grad():
            (weight,) = torch.autograd.grad(aggregate_loss(probe, mask, algo.loss_agg, **agg), probe)
        inputs = {"weight": weight, "advantages": micro["advantages"]}
        if "old_logprobs" in micro:
            inputs["old"] = micro["old_logprobs"]
        use_kl = "ref_logprobs" in micro and self._kl_in_loss()
        if use_kl:
            inputs["ref"] = micro["ref_logprobs"]

        options = dict(
            clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
            kl_coef=algo.kl_coef if use_kl else 0.0, kl_estimator=algo.kl_estimator if use_kl else None,
            entropy_coef=algo.entropy_coef,
        )  # fmt: skip
        # ~25 elementwise ops per 1,024-token chunk, 100+ chunks a step: on a GPU the host launching
        # them one by one is slower than the GPU runs them, so with train.compile they run as one compiled graph.
        fn = _compiled_token_loss_derivatives() if self.train_cfg.compile and mask.is_cuda else token_loss_derivatives

        def derivatives(lp, ent, weight, advantages, old=None, ref=None):
            return fn(lp, weight, advantages, old, ref, **options)

        return derivatives, inputs

    def _objective(self, micro: SequenceBatch, logprobs: torch.Tensor, entropy: torch.Tensor, agg: dict):
        """The policy loss of a micro-batch from its log-probs and entropy `[B, T]`: PPO-clip, minus
        the entropy bonus, plus the KL to the reference; a sum of per-token terms whatever the
        aggregation (response_logprobs_with_grad relies on it). Returns (loss, metrics)."""
        algo = self.algo
        mask = micro.response_mask
        metrics: dict = {}  # 0-dim tensors: read once per mini-batch (update._accumulate)
        if "old_logprobs" in micro:
            old_logprobs = micro["old_logprobs"]
        else:  # exactly on-policy: this pass IS the old-log-prob pass (see rl_step.compute_old_logprobs)
            old_logprobs = logprobs.detach()
            if "rollout_logprobs" in micro:
                metrics.update(logprob_diff_metrics(old_logprobs, micro["rollout_logprobs"], mask, as_tensors=True))
        pg_loss, pg_metrics = self.policy_loss(
            logprobs, old_logprobs, micro["advantages"], mask,
            clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip, loss_agg=algo.loss_agg, **agg,
        )
        loss = pg_loss
        metrics |= {
            "actor/pg_loss": pg_loss.detach(),
            "actor/pg_clipfrac": pg_metrics["pg_clipfrac"],
            "actor/pg_clipfrac_lower": pg_metrics["pg_clipfrac_lower"],
            "actor/ppo_kl": pg_metrics["ppo_kl"],
            "actor/entropy": masked_mean(entropy.detach(), mask),
        }
        if algo.entropy_coef > 0:
            ent_loss = aggregate_loss(entropy, mask, algo.loss_agg, **agg)
            loss = loss - algo.entropy_coef * ent_loss
        if "ref_logprobs" in micro:
            kl = kl_penalty(logprobs, micro["ref_logprobs"], algo.kl_estimator)
            metrics["actor/kl"] = masked_mean(kl.detach(), mask)
            if self._kl_in_loss():
                kl_loss = aggregate_loss(kl, mask, algo.loss_agg, **agg)
                loss = loss + algo.kl_coef * kl_loss
                metrics["actor/kl_loss"] = kl_loss.detach()
        return loss, metrics
