"""Mixed precision for bf16 models: two optimizers that keep small updates from being rounded away.

A bf16 weight has 8 significant bits, so an update smaller than ~1/256 of the weight is rounded
away: at lr 1e-6 almost every AdamW step on bf16 weights would be lost. `build_optimizer`
(`train.master_weights`) picks one of:

"fp32": `MasterWeightAdamW` keeps an fp32 copy of every trainable parameter; each bf16 gradient is
added into the fp32 master's gradient the moment backward produces it (a post-accumulate-grad
hook), so gradients are accumulated over micro-batches in fp32 and the bf16 gradients never all
exist at once. `step` runs (fused) AdamW on the fp32 masters and copies them back into the bf16
parameters, which the rollout engine reads. Memory per parameter: 2 (bf16 weight) + 4 (master) +
8 (AdamW moments) + 4 (fp32 gradient, between the first backward and the step) = 18 bytes.
Clipping and the NaN check act on the master gradients: they are the optimizer's parameters.

"compensated": `CompensatedAdamW` keeps no fp32 copy. The bf16 parameter is the weight, and a bf16
compensation buffer per parameter holds what bf16 could not represent of the accumulated updates
(Kahan summation): the effective weight is p + comp, ~16 significant bits. Each step computes in
fp32: on CUDA in one Triton kernel launch over all parameters (`triton_adamw`, no temporaries), else with
PyTorch ops on slices of at most `CHUNK` elements (small tensors are concatenated into one slice):

    m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
    x = (p + comp) (1 - lr wd) - lr (m / bc1) / (sqrt(v / bc2) + eps)
    p = bf16(x);   comp = bf16(x - p)

m is stored in bf16 with round-to-nearest. v is stored in bf16 with stochastic rounding: with
b2 = 0.999 the increment (1 - b2) g^2 is below half a bf16 ulp of v once v has converged, so
round-to-nearest would freeze v (it could neither decay nor grow slowly); stochastic rounding is
unbiased, so v follows the fp32 EMA in expectation (each element carries zero-mean noise, ~3.5%
std at b2 = 0.999, half that in sqrt(v)). The random bits derive from one CPU
torch.Generator owned by the optimizer (seed 0; on accelerators it seeds the device's generator or
the kernel's Philox each step), saved in `state_dict`, so resume is bit-exact.
Gradients stay bf16 in `p.grad` (autograd accumulates micro-batches in bf16; clipping and the NaN
check act on the model's parameters). Memory per parameter: 2 (weight) + 2 (gradient) + 2 (comp)
+ 4 (bf16 m and v) = 10 bytes. fp32 parameters in the same model get fp32 state (no stochastic
rounding); fp16 parameters are refused (fp16 cannot hold g^2).
"""

from __future__ import annotations

import math

import torch

from hybridrl.train import triton_adamw

CHUNK = 1 << 22  # elements per fp32 working slice of CompensatedAdamW.step (16 MiB per fp32 temporary)


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
        # AdamW's own step, without the hook runner torch wraps around it once any plain AdamW exists in the
        # process: this step's wrapper already runs the hooks, once, around the update and the copy below.
        adamw_step = torch.optim.AdamW.step
        loss = (adamw_step.__wrapped__ if getattr(adamw_step, "hooked", False) else adamw_step)(self, closure)
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


class CompensatedAdamW(torch.optim.Optimizer):
    """AdamW on the model's own bf16 weights plus a bf16 compensation buffer, with bf16 moments
    (v stochastically rounded); 10 bytes per parameter with the gradient (see the module docstring).

    Per-parameter state: "step" (int), "exp_avg", "exp_avg_sq", "comp" (the parameter's dtype).
    `state_dict` adds "sr_generator", the state of the CPU generator that all random bits derive
    from, for a bit-exact resume. `fused`: CUDA parameters take the one-pass Triton kernel
    (`triton_adamw`); None uses it where Triton is installed, False always takes the PyTorch path.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2, *,
                 seed: int = 0, fused: bool | None = None):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr, eps and weight_decay must not be negative, got {lr}, {eps}, {weight_decay}")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {tuple(betas)}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in (torch.bfloat16, torch.float32):
                    raise ValueError(f"CompensatedAdamW takes bf16 (or fp32) parameters, got {p.dtype}; use fp32 master weights for fp16 models")
                if not p.is_contiguous():
                    raise ValueError("CompensatedAdamW needs contiguous parameters")
                _remove_master_hook(p)  # an earlier MasterWeightAdamW's hook would take the gradients
        if fused and not triton_adamw.available():
            raise RuntimeError("CompensatedAdamW(fused=True) needs Triton")
        self.seed = seed
        self.fused = fused
        self._rng = torch.Generator().manual_seed(seed)  # CPU; seeds every other source of random bits
        self._device_rngs: dict[str, torch.Generator] = {}  # the PyTorch path's on accelerators, reseeded each step

    def _seeds(self, n: int) -> list[int]:
        return torch.randint(0, 1 << 62, (n,), generator=self._rng).tolist()

    def _generator(self, device: torch.device) -> torch.Generator:
        if device.type == "cpu":
            return self._rng
        gen = self._device_rngs.get(str(device))
        if gen is None:
            gen = self._device_rngs[str(device)] = torch.Generator(device=device)
        return gen.manual_seed(self._seeds(1)[0])

    def _use_kernel(self, device: torch.device) -> bool:
        return device.type == "cuda" and self.fused is not False and triton_adamw.available()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            buckets: dict[tuple, list[torch.Tensor]] = {}  # parameters that share step, device and dtype
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("CompensatedAdamW does not support sparse gradients")
                state = self.state[p]
                for key in ("exp_avg", "exp_avg_sq", "comp"):
                    if key not in state:  # new, or a state written by another optimizer
                        state[key] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] = int(state.get("step", 0)) + 1
                buckets.setdefault((state["step"], p.device, p.dtype), []).append(p)
            for (step, device, _), params in buckets.items():
                if self._use_kernel(device):
                    self._kernel_step(params, group, step)
                    continue
                generator = self._generator(device)
                for segments in _slices(params, CHUNK):
                    self._update(segments, group, step, generator)
        return loss

    def _kernel_step(self, params: list[torch.Tensor], group: dict, step: int) -> None:
        b1, b2 = group["betas"]
        tensors = []
        for p in params:
            if p.numel() >= 1 << 31:
                raise RuntimeError(f"CompensatedAdamW's kernel takes tensors of fewer than 2**31 elements, got {p.numel()}; pass fused=False")
            state = self.state[p]
            tensors.append((p, state["comp"], state["exp_avg"], state["exp_avg_sq"], p.grad.contiguous()))
        triton_adamw.step(
            tensors, self._seeds(len(params)), lr=group["lr"], weight_decay=group["weight_decay"], b1=b1, b2=b2,
            eps=group["eps"], step=step,
        )  # fmt: skip

    def _update(self, segments: list[tuple[torch.Tensor, int, int]], group: dict, step: int, generator: torch.Generator) -> None:
        """One AdamW step on the elements [a, b) of each parameter in `segments`, computed in fp32."""
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        b1, b2 = group["betas"]
        views = []  # per segment: weight, compensation, m, v, gradient (flat views)
        for p, a, b in segments:
            state = self.state[p]
            grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
            views.append([t.view(-1)[a:b] for t in (p, state["comp"], state["exp_avg"], state["exp_avg_sq"], grad)])
        if len(views) == 1:
            w, comp, m_store, v_store, g = views[0]
        else:  # small tensors: one concatenated slice, scattered back below
            w, comp, m_store, v_store, g = (torch.cat(parts) for parts in zip(*views))

        g = g.float()
        m = _fp32_copy(m_store).lerp_(g, 1 - b1)
        v = _fp32_copy(v_store).mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = v.sqrt().div_(math.sqrt(1 - b2**step)).add_(eps)
        x = _fp32_copy(w).add_(comp)
        if wd != 0:
            x.mul_(1 - lr * wd)
        x.addcdiv_(m, denom, value=-lr / (1 - b1**step))
        w.copy_(x)  # round to nearest
        comp.copy_(x.sub_(w))  # the part of x that the rounded weight lacks
        m_store.copy_(m)
        if v_store.dtype == torch.bfloat16:
            stochastic_round_(v_store, v, generator)
        else:
            v_store.copy_(v)

        if len(views) > 1:
            sizes = [b - a for _, a, b in segments]
            targets = [t for seg in views for t in seg[:4]]
            sources = [t for chunks in zip(*(flat.split(sizes) for flat in (w, comp, m_store, v_store))) for t in chunks]
            torch._foreach_copy_(targets, sources)

    def state_dict(self):
        state = super().state_dict()
        state["sr_generator"] = self._rng.get_state()
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict) -> None:
        """Loads a state of this optimizer; a `MasterWeightAdamW` state's fp32 masters become weight + compensation."""
        state = dict(state_dict)
        rng = state.pop("sr_generator", None)
        masters = state.pop("master_params", None)
        super().load_state_dict(state)
        if rng is None:  # a state written by another optimizer
            self._rng.manual_seed(self.seed)
        else:
            self._rng.set_state(rng.cpu())
        if masters is not None:
            params = [p for g in self.param_groups for p in g["params"]]
            for p, master in zip(params, masters):
                x = master.to(device=p.device, dtype=torch.float32)
                p.copy_(x)
                comp = self.state[p].setdefault("comp", torch.zeros_like(p, memory_format=torch.contiguous_format))
                comp.copy_(x - p.float())


def _slices(params: list[torch.Tensor], limit: int):
    """Lists of (parameter, start, end) covering `params` in order, each of at most `limit` elements."""
    pack, size = [], 0
    for p in params:
        n = p.numel()
        for a in range(0, n, limit):
            b = min(n, a + limit)
            if pack and size + b - a > limit:
                yield pack
                pack, size = [], 0
            pack.append((p, a, b))
            size += b - a
    if pack:
        yield pack


def _fp32_copy(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype != torch.float32 else t.clone()


def stochastic_round_(out: torch.Tensor, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Writes fp32 `x` into bf16 `out`, rounding up or down with probability proportional to the
    distance (unbiased). Adds a uniform 16-bit integer to the bit pattern and truncates the low
    16 bits; bf16 is sign-magnitude, so this rounds the magnitude for either sign. inf and NaN are
    copied as they are."""
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    rounded = noise.add_(x.view(torch.int32)).bitwise_and_(-(1 << 16)).view(torch.float32)  # exact in bf16
    out.copy_(torch.where(torch.isfinite(x), rounded, x))
    return out


def stochastic_round(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 `x` stochastically rounded to bf16 (see `stochastic_round_`)."""
    return stochastic_round_(torch.empty_like(x, dtype=torch.bfloat16), x.float().contiguous(), generator)


def _replace_hook(param: torch.nn.Parameter, master: torch.Tensor) -> None:
    """Routes `param`'s gradients into `master.grad` (fp32); a newer optimizer replaces an older one's hook."""
    _remove_master_hook(param)

    def fold(p: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = p.grad.float()
        else:
            master.grad.add_(p.grad)
        p.grad = None

    param._hybridrl_master_hook = param.register_post_accumulate_grad_hook(fold)


def _remove_master_hook(param: torch.nn.Parameter) -> None:
    old = getattr(param, "_hybridrl_master_hook", None)
    if old is not None:
        old.remove()
        param._hybridrl_master_hook = None


def needs_master_weights(model: torch.nn.Module) -> bool:
    return any(p.requires_grad and p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters())
