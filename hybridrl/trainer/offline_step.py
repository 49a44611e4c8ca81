"""One offline step (SFT, DPO, KTO): a batch of examples -> one optimizer update."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridrl.train.optim import step_schedule
from hybridrl.train.update import optimizer_step

if TYPE_CHECKING:
    from hybridrl.trainer.engine import TrainerEngine


def offline_step(t: "TrainerEngine", examples: list) -> dict[str, Any]:
    algo, cfg = t.offline_algorithm, t.config
    norm = algo.normaliser(examples)
    with t.timer.phase("train"):
        t.model.train()
        result = optimizer_step(
            t.model, t.optimizer, algo.micro_batches(examples, cfg.train.micro_batch_size),
            lambda micro: algo.loss(t.model, t.ref_model, micro, norm, t.device),
            grad_clip=cfg.train.grad_clip,
        )
        t.model.eval()
    lr = t.optimizer.param_groups[0]["lr"]
    step_schedule(t.scheduler)
    num_tokens = sum(_num_tokens(ex) for ex in examples)
    return {
        **result.metrics,
        "actor/grad_norm": result.grad_norm,
        "actor/lr": lr,
        "train/skipped_updates": int(result.skipped),
        "_num_response_tokens": num_tokens,
        "_num_tokens": num_tokens,
    }


def _num_tokens(example) -> int:
    for fields in (("input_ids",), ("prompt_ids", "chosen_ids", "rejected_ids"), ("prompt_ids", "completion_ids")):
        if all(hasattr(example, f) for f in fields):
            return sum(len(getattr(example, f)) for f in fields)
    return 0
