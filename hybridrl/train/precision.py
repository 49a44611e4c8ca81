"""Mixed precision: the model computes in bf16, the optimizer keeps fp32 master weights and state.

A bf16 weight has 8 significant bits, so an update smaller than ~1/256 of the weight is rounded
away: at lr 1e-6 almost every AdamW step on bf16 weights would be lost. `MasterWeightAdamW` keeps an
fp32 copy of every trainable parameter; each bf16 gradient is added into the fp32 master's gradient
the moment backward produces it (a post-accumulate-grad hook), so gradients are accumulated over
micro-batches in fp32 and the bf16 gradients never all exist at once. `step` runs (fused) AdamW on
the fp32 masters and copies them back into the bf16 parameters, which the rollout engine reads.

Memory per parameter: 2 (bf16 weight) + 4 (master) + 8 (AdamW moments) + 4 (fp32 gradient, between
the first backward and the step) bytes. Clipping and the NaN check act on the master gradients:
they are the optimizer's parameters (`param_groups`).
"""

from __future__ import annotations

import torch


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW over fp32 copies of a low-precision model's parameters (see the module docstring)."""

    def __init__(self, param_groups: list[dict], **adamw_kwargs):
        self.model_params: list[torch.nn.Parameter] = []
        master_groups = []
        for group in param_groups:
            masters = []
            for p in group["params"]:
                master = p.detach().to(torch.float32, copy=True)
                masters.append(master)
                self.model_params.append(p)
                _replace_hook(p, master)
            master_groups.append({**group, "params": masters})
        super().__init__(master_groups, **adamw_kwargs)
        self.master_params = [m for g in self.param_groups for m in g["params"]]
        self._master_of = {id(p): m for p, m in zip(self.model_params, self.master_params)}

    def masters(self, params) -> list[torch.Tensor]:
        """The fp32 masters of `params` (model parameters), in that order."""
        return [self._master_of[id(p)] for p in params if id(p) in self._master_of]

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        torch._foreach_copy_(self.model_params, self.master_params)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.model_params:
            p.grad = None

    def state_dict(self):
        state = super().state_dict()
        state["master_params"] = [m.detach().clone() for m in self.master_params]
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict) -> None:
        state = dict(state_dict)
        masters = state.pop("master_params", None)
        super().load_state_dict(state)
        if masters is None:  # a state saved without masters: start them from the (loaded) model weights
            torch._foreach_copy_(self.master_params, self.model_params)
        else:
            torch._foreach_copy_(self.master_params, [m.to(self.master_params[0].device) for m in masters])
            torch._foreach_copy_(self.model_params, self.master_params)


def _replace_hook(param: torch.nn.Parameter, master: torch.Tensor) -> None:
    """Routes `param`'s gradients into `master.grad` (fp32); a newer optimizer replaces an older one's hook."""
    old = getattr(param, "_hybridrl_master_hook", None)
    if old is not None:
        old.remove()

    def fold(p: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = p.grad.float()
        else:
            master.grad.add_(p.grad)
        p.grad = None

    param._hybridrl_master_hook = param.register_post_accumulate_grad_hook(fold)


def needs_master_weights(model: torch.nn.Module) -> bool:
    return any(p.requires_grad and p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters())
