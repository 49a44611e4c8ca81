"""Log-probs and entropy of chosen tokens straight from hidden states, never holding `[N, vocab]` logits.

`token_logprobs(hidden [N, H], weight [V, H], labels [N])` applies the lm_head to `chunk` tokens at a
time. Forward keeps, per token, only logsumexp, log-prob and entropy; backward recomputes each
chunk's logits (one GEMM) and turns them into the logit gradient in place:

    z = logits / T,  p = softmax(z),  lp = z_y - logsumexp(z),  H = logsumexp(z) - sum_j p_j z_j
    d lp / d z_j = [j = y] - p_j,     d H / d z_j = p_j (logsumexp(z) - H - z_j)

So the memory of this phase is one chunk of logits in the model's dtype, whatever the batch size.
`token_logprobs_with_grad` does the backward's work in the forward, for losses whose per-token
derivative is known once the token's log-prob is (the policy loss): one logits GEMM per chunk, not two.
On CUDA the per-row statistics and the gradient are one Triton pass over the chunk each
(triton_logprobs.py); elsewhere the PyTorch functions below compute the same in fp32.

With `tuned=True` (`train.tuned_products`, after `tune_lm_head`) a full chunk's logits product and
its weight-gradient product run the cuBLASLt algorithm timed fastest for their shape
(kernels/cublaslt.py); the weight gradient is then added into its buffer by the product itself.

The weight's gradient is added into `weight.grad` by the backward function that makes it, where
autograd would add it there anyway (`_WeightGrad`), instead of being handed to autograd. With tied
input and output embeddings autograd would hold that `[V, H]` buffer until the embedding's own
gradient arrives at the end of the backward, through the whole backward of the decoder layers,
where a training step's peak memory is: on an H200 the W0.5B step's peak went from 6.399 to 6.211
GiB with this, W1.5B's from 17.819 to 17.379 GiB (bench/compare_trl.py; train/NOTES.md, session 32).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def logit_stats_torch(logits: torch.Tensor, labels: torch.Tensor, inv_temp: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logsumexp, log-prob of the label, entropy) per row of `[c, V]` logits, in fp32 (fp64 for fp64)."""
    z = _upcast(logits) * inv_temp
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, labels[:, None])[:, 0] - lse
    p = torch.exp(z - lse[:, None])
    entropy = lse - (p * z).sum(-1)
    return lse, lp, entropy


def logit_grad_torch(logits, labels, lse, entropy, g_lp, g_ent, inv_temp: float) -> torch.Tensor:
    """Gradient w.r.t. the `[c, V]` logits of sum(g_lp * lp + g_ent * entropy), in the logits' dtype."""
    z = _upcast(logits) * inv_temp
    p = torch.exp(z - lse[:, None])
    grad = torch.zeros_like(z)
    if g_lp is not None:
        grad -= p * g_lp[:, None]
        grad.scatter_add_(1, labels[:, None], g_lp[:, None].to(z.dtype))
    if g_ent is not None:
        grad += g_ent[:, None] * p * ((lse - entropy)[:, None] - z)
    return (grad * inv_temp).to(logits.dtype)


def _use_triton(logits: torch.Tensor) -> bool:
    if logits.device.type != "cuda":
        return False
    from hybridrl.train import triton_logprobs

    return triton_logprobs.available()


def logit_stats(logits, labels, inv_temp, out=None):
    """(logsumexp, log-prob, entropy) per row; stored into `out` (three vectors) when given."""
    if _use_triton(logits) and (out is None or out[0].dtype == torch.float32):
        from hybridrl.train import triton_logprobs

        return triton_logprobs.logit_stats(logits, labels, inv_temp, out=out)
    stats = logit_stats_torch(logits, labels, inv_temp)
    if out is None:
        return stats
    for dst, src in zip(out, stats):
        dst.copy_(src)
    return out


def logit_grad(logits, labels, lse, entropy, g_lp, g_ent, inv_temp):
    if _use_triton(logits):
        from hybridrl.train import triton_logprobs

        return triton_logprobs.logit_grad_(logits, labels, lse, entropy, g_lp, g_ent, inv_temp)
    return logit_grad_torch(logits, labels, lse, entropy, g_lp, g_ent, inv_temp)


def tune_lm_head(weight: torch.Tensor, chunk: int = 1024) -> dict[str, dict]:
    """Times cuBLASLt's algorithms for a full chunk's logits product (`[chunk, H] @ weight.T`) and
    weight-gradient product (`grad_w += grad.T @ h`), keeping the fastest where it beats PyTorch's
    (kernels/cublaslt.tune_product; once per shape and process, saved for later runs). Returns
    what was measured; {} where there is nothing to tune (no CUDA, not bf16 / fp16)."""
    from hybridrl.kernels import cublaslt

    if weight.device.type != "cuda" or not cublaslt.available() or weight.dtype not in (torch.bfloat16, torch.float16):
        return {}
    V, H = weight.shape
    with torch.cuda.device(weight.device):
        return {
            "logits": cublaslt.tune_product(chunk, V, H, weight.dtype),
            "weight_grad": cublaslt.tune_product(V, H, chunk, weight.dtype, x_transposed=True, w_transposed=False, accumulate=True),
        }


def _tuned(tuned: bool, x: torch.Tensor, w: torch.Tensor, m: int, n: int, k: int, **layout):
    """tune_lm_head's product for these operands, or None (PyTorch multiplies them)."""
    if not (tuned and x.is_cuda and x.dtype == w.dtype and x.is_contiguous() and w.is_contiguous()):
        return None
    from hybridrl.kernels import cublaslt

    return cublaslt.tuned_product(m, n, k, w.dtype, device=w.device.index, **layout)


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tuned: bool) -> torch.Tensor:
    product = _tuned(tuned and bias is None, h, weight, h.shape[0], *weight.shape)
    return product(h, weight) if product is not None else F.linear(h, weight, bias)


def _add_chunk_grads(grad, h, weight, rows: slice, grad_h, grad_w, grad_b, dtype, tuned: bool = False) -> None:
    """Adds one chunk's logit gradient `grad` `[c, V]` to the hidden (its rows), weight and bias
    gradients (each None when not wanted)."""
    if grad_h is not None:
        torch.mm(grad, weight, out=grad_h[rows])  # straight into the slice: no copy
    if grad_w is not None:
        product = _tuned(tuned and grad.is_contiguous() and grad_w.dtype == h.dtype, grad, h, *grad_w.shape, h.shape[0],
                         x_transposed=True, w_transposed=False, accumulate=True)  # fmt: skip
        if product is not None:
            product(grad, h, out=grad_w)  # grad_w += grad.T @ h
        else:
            grad_w.addmm_(grad.t(), h)
    if grad_b is not None:
        grad_b += grad.sum(0, dtype=dtype)


class _WeightGrad:
    """Where the lm_head weight's gradient goes: straight into `weight.grad` when this backward is one
    that accumulates into it (`.backward()`, not `torch.autograd.grad`), else to autograd.

    Adding it in place is what autograd's AccumulateGrad would do, minus the wait: a weight that is
    also the input embedding gets a second gradient at the very end of the backward, and autograd
    keeps the first in a buffer until then. Only for a plain leaf parameter with no gradient hooks
    (a hook, e.g. the fp32 master weights' (precision.py), must see every gradient), and only when
    the engine will run the parameter's AccumulateGrad node in this backward."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.node = None
        plain = type(weight) is torch.nn.Parameter and type(weight.data) is torch.Tensor
        if plain and weight.requires_grad and weight.is_leaf and not weight._backward_hooks and not weight._post_accumulate_grad_hooks:
            self.node = torch.autograd.graph.get_gradient_edge(weight).node

    def _accumulates(self) -> bool:
        """Whether the running backward adds into the weight's `.grad` (the engine runs its node)."""
        try:
            return torch._C._will_engine_execute_node(self.node)
        except RuntimeError as e:  # torch.autograd.grad() asked for this leaf's gradient: it is captured, not accumulated
            if "autograd.grad" not in str(e):
                raise
            return False

    def deliver(self, grad_w: torch.Tensor | None, scale: torch.Tensor | None = None) -> torch.Tensor | None:
        """Called in a backward with the weight's gradient (times `scale`, a one-element tensor, when
        given; `grad_w` is then scaled in place or consumed): returns what autograd should receive."""
        if grad_w is None:
            return None
        if self.node is None or not self._accumulates():
            return grad_w if scale is None else _scale_(grad_w, scale)
        with torch.no_grad():
            if self.weight.grad is None:
                self.weight.grad = grad_w if scale is None else _scale_(grad_w, scale)
            elif scale is None:
                self.weight.grad.add_(grad_w)
            else:
                _scale_add_(self.weight.grad, grad_w, scale)
        return None


def _scale_(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`t.mul_(g)`; on CUDA in one vectorised pass (triton_logprobs.scale_)."""
    from hybridrl.train import triton_logprobs

    return triton_logprobs.scale_(t, g) if triton_logprobs.scalable(t, g) else t.mul_(g)


def _scale_add_(dst: torch.Tensor, src: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`dst.add_(src.mul_(g))`, `src` consumed; on CUDA in one pass (triton_logprobs.scale_add_)."""
    from hybridrl.train import triton_logprobs

    if dst.dtype == src.dtype and dst.shape == src.shape and triton_logprobs.scalable(dst, g) and triton_logprobs.scalable(src, g):
        return triton_logprobs.scale_add_(dst, src, g)
    return dst.add_(src.mul_(g))


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inv_temp: float, chunk: int, tuned: bool):
        N = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        lse, lp, entropy = (torch.empty(N, dtype=dtype, device=hidden.device) for _ in range(3))
        for s in range(0, N, chunk):
            logits = _logits(hidden[s : s + chunk], weight, bias, tuned)
            logit_stats(logits, labels[s : s + chunk], inv_temp, out=(lse[s : s + chunk], lp[s : s + chunk], entropy[s : s + chunk]))
            del logits
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.inv_temp, ctx.chunk, ctx.tuned = inv_temp, chunk, tuned
        ctx.weight_grad = _WeightGrad(weight)
        ctx.set_materialize_grads(False)
        return lp, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if g_lp is None and g_ent is None:
            return None, None, None, None, None, None, None
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=lse.dtype, device=weight.device) if need_b and bias is not None else None
        chunk = ctx.chunk
        for s in range(0, hidden.shape[0], chunk):
            sl = slice(s, s + chunk)
            h = hidden[sl]
            logits = _logits(h, weight, bias, ctx.tuned)
            grad = logit_grad(
                logits, labels[sl], lse[sl], entropy[sl],
                None if g_lp is None else g_lp[sl], None if g_ent is None else g_ent[sl], ctx.inv_temp,
            )  # fmt: skip
            del logits
            _add_chunk_grads(grad, h, weight, sl, grad_h, grad_w, grad_b, lse.dtype, ctx.tuned)
        grad_w = ctx.weight_grad.deliver(grad_w)
        return grad_h, grad_w, grad_b.to(bias.dtype) if grad_b is not None else None, None, None, None, None


class _PrecomputedGrads(torch.autograd.Function):
    """A zero whose backward hands out gradients already computed (token_logprobs_with_grad),
    scaled in place by the incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, grad_h, grad_w, grad_b):
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.weight_grad = _WeightGrad(weight)
        return hidden.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        grad_h, grad_w, grad_b = ctx.saved_tensors  # each buffer is used once: scaled in place
        grad_h = None if grad_h is None else _scale_(grad_h, g)
        grad_b = None if grad_b is None else _scale_(grad_b, g)
        return grad_h, ctx.weight_grad.deliver(grad_w, scale=g), grad_b, None, None, None  # scaled as it goes into .grad


def token_logprobs_with_grad(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    token_grads: Callable[[slice, torch.Tensor, torch.Tensor], tuple[torch.Tensor | None, torch.Tensor | None]],
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
    tuned: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """token_logprobs for a loss whose derivative with respect to each token's log-prob and entropy
    is known as soon as that token's are: the gradient is made in the forward pass, so each chunk's
    logits are computed once instead of twice (forward, then again in the backward).

    `token_grads(rows, lp, entropy)` returns (d loss / d lp, d loss / d entropy) `[c]` for the tokens
    `rows` (either may be None: no such term). Returns the log-probs and entropy `[N]` (fp32,
    detached) and a 0-dim zero whose backward delivers the gradient of that loss to `hidden`,
    `weight` and `bias`: add it to the loss. The weight's gradient is held from here to the backward."""
    inv_temp = 1.0 / temperature if temperature > 0 else 1.0
    N = hidden.shape[0]
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    with torch.no_grad():
        lse, lp, entropy = (torch.empty(N, dtype=dtype, device=hidden.device) for _ in range(3))
        grad_h = torch.empty_like(hidden) if hidden.requires_grad else None
        grad_w = torch.zeros_like(weight) if weight.requires_grad and N else None
        grad_b = torch.zeros(weight.shape[0], dtype=dtype, device=weight.device) if bias is not None and bias.requires_grad and N else None
        for s in range(0, N, chunk):
            sl = slice(s, s + chunk)
            h = hidden[sl]
            logits = _logits(h, weight, bias, tuned)
            logit_stats(logits, labels[sl], inv_temp, out=(lse[sl], lp[sl], entropy[sl]))
            g_lp, g_ent = token_grads(sl, lp[sl], entropy[sl])
            if g_lp is None and g_ent is None:
                if grad_h is not None:
                    grad_h[sl] = 0
                continue
            grad = logit_grad(logits, labels[sl], lse[sl], entropy[sl], g_lp, g_ent, inv_temp)
            del logits
            _add_chunk_grads(grad, h, weight, sl, grad_h, grad_w, grad_b, dtype, tuned)
    grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
    return lp, entropy, _PrecomputedGrads.apply(hidden, weight, bias, grad_h, grad_w, grad_b)


def token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, *, temperature: float = 1.0,
    chunk: int = 1024, tuned: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs `[N]` of `labels` under softmax(hidden @ weight.T + bias) / T) and the entropy `[N]` (fp32)."""
    inv_temp = 1.0 / temperature if temperature > 0 else 1.0
    if hidden.shape[0] == 0:  # no response tokens: empty results that still belong to the graph
        empty = hidden[:, 0].float()
        return empty, empty
    return _LinearLogprobs.apply(hidden, weight, bias, labels, inv_temp, chunk, tuned)
