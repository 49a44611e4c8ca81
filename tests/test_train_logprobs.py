"""Chunked log-probs and entropy straight from hidden states (lm_head.py) against full logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridrl.train import lm_head
from hybridrl.train.attention import enable_packed_attention
from hybridrl.train.batch import build_sequence_batch
from hybridrl.train.lm_head import token_logprobs
from hybridrl.train.logprobs import response_logprobs


def _full(hidden, weight, bias, labels, temperature):
    z = torch.nn.functional.linear(hidden, weight, bias) / temperature
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def _lm_head_problem(seed: int, with_bias: bool, N: int = 37, H: int = 16, V: int = 50):
    """(generator, hidden, weight, bias, labels, the inputs that take gradients): an fp64 lm_head
    problem; the generator goes on to draw each test's per-token coefficients."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(V, dtype=torch.float64, generator=g, requires_grad=True) if with_bias else None
    labels = torch.randint(0, V, (N,), generator=g)
    return g, hidden, weight, bias, labels, [t for t in (hidden, weight, bias) if t is not None]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 8, 1000])
def test_chunked_logprobs_entropy_and_gradients_equal_full_logits(temperature, with_bias, chunk):
    g, hidden, weight, bias, labels, inputs = _lm_head_problem(0, with_bias)
    N = hidden.shape[0]
    g_lp, g_ent = torch.randn(N, dtype=torch.float64, generator=g), torch.randn(N, dtype=torch.float64, generator=g)

    lp, ent = token_logprobs(hidden, weight, bias, labels, temperature=temperature, chunk=chunk)
    ref_lp, ref_ent = _full(hidden, weight, bias, labels, temperature)
    torch.testing.assert_close(lp, ref_lp, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=1e-12)
    for got, want in zip(torch.autograd.grad((lp * g_lp + ent * g_ent).sum(), inputs),
                         torch.autograd.grad((ref_lp * g_lp + ref_ent * g_ent).sum(), inputs)):  # fmt: skip
        torch.testing.assert_close(got, want, atol=1e-11, rtol=1e-11)
    # Log-probs alone (entropy only reported): the entropy gradient is not computed.
    lp, ent = token_logprobs(hidden, weight, bias, labels, temperature=temperature, chunk=chunk)
    ref_lp, _ = _full(hidden, weight, bias, labels, temperature)
    for got, want in zip(torch.autograd.grad((lp * g_lp).sum(), inputs), torch.autograd.grad((ref_lp * g_lp).sum(), inputs)):
        torch.testing.assert_close(got, want, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 8, 1000])
def test_gradient_made_in_the_forward_equals_the_backwards(temperature, with_bias, chunk):
    """token_logprobs_with_grad: for a loss of per-token terms (here nonlinear in each token's
    log-prob and entropy), the gradient it makes in the forward pass is the full-logits one."""
    g, hidden, weight, bias, labels, inputs = _lm_head_problem(1, with_bias)
    N = hidden.shape[0]
    a, b = torch.randn(N, dtype=torch.float64, generator=g), torch.randn(N, dtype=torch.float64, generator=g)
    term = lambda lp, ent: (a * torch.exp(lp) + b * ent**2).sum()  # noqa: E731
    calls = []

    def token_grads(rows, lp, ent):
        calls.append(rows)
        lp, ent = lp.detach().requires_grad_(), ent.detach().requires_grad_()
        with torch.enable_grad():
            return torch.autograd.grad((a[rows] * torch.exp(lp) + b[rows] * ent**2).sum(), [lp, ent])

    lp, ent, zero = lm_head.token_logprobs_with_grad(hidden, weight, bias, labels, token_grads, temperature=temperature, chunk=chunk)
    ref_lp, ref_ent = _full(hidden, weight, bias, labels, temperature)
    torch.testing.assert_close(lp, ref_lp.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ent, ref_ent.detach(), atol=1e-12, rtol=1e-12)
    assert not lp.requires_grad and zero.item() == 0.0 and len(calls) == -(-N // chunk)
    scale = 0.5  # the incoming gradient scales what was made
    for got, want in zip(torch.autograd.grad(scale * zero, inputs), torch.autograd.grad(scale * term(ref_lp, ref_ent), inputs)):
        torch.testing.assert_close(got, want, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_gradient_made_in_the_forward_when_some_inputs_take_none(frozen):
    """A frozen lm_head (or a hidden state that takes no gradient) gets none, and the others get the
    full-logits gradient, scaled by the incoming one."""
    g, hidden, weight, bias, labels, _ = _lm_head_problem(2, with_bias=True)
    {"weight": weight, "hidden": hidden}[frozen].requires_grad_(False)
    inputs = [t for t in (hidden, weight, bias) if t.requires_grad]
    a = torch.randn(hidden.shape[0], dtype=torch.float64, generator=g)

    def token_grads(rows, lp, ent):
        return a[rows] * torch.exp(lp), None

    lp, ent, zero = lm_head.token_logprobs_with_grad(hidden, weight, bias, labels, token_grads, chunk=8)
    ref_lp, _ = _full(hidden, weight, bias, labels, 1.0)
    got = torch.autograd.grad(-3.0 * zero, inputs)
    want = torch.autograd.grad(-3.0 * (a * torch.exp(ref_lp)).sum(), inputs)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("packed", [False, True])
def test_model_logprobs_and_entropy_equal_a_full_forward(tiny_model_path, packed):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    enable_packed_attention(model)
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10]]
    responses = [[11, 12, 13], [14], [15, 16, 17, 18, 19]]
    batch = dataclasses.replace(build_sequence_batch(prompts, responses, pad_id=0), packed=packed)
    lp, ent = response_logprobs(model, batch, temperature=0.8, with_entropy=True, chunk_size=2)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        with torch.no_grad():
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1 : -1] / 0.8
        logp = torch.log_softmax(logits, -1)
        torch.testing.assert_close(lp[b, : len(r)], logp.gather(-1, torch.tensor(r)[:, None])[:, 0], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[b, : len(r)], -(logp.exp() * logp).sum(-1), atol=1e-5, rtol=0)
        assert (lp[b, len(r) :] == 0).all()


def test_logits_never_exceed_one_chunk_whatever_the_batch(monkeypatch):
    """Structural memory check (CPU): every logits tensor the phase creates, forward and backward,
    has at most `chunk` rows, however many tokens the batch holds; so its memory is chunk x vocab,
    not tokens x vocab. (tests/test_train_gpu.py measures the allocator peak on a GPU.)"""
    seen = []
    stats, grad = lm_head.logit_stats, lm_head.logit_grad
    monkeypatch.setattr(lm_head, "logit_stats", lambda logits, *a, **kw: (seen.append(tuple(logits.shape)), stats(logits, *a, **kw))[1])
    monkeypatch.setattr(lm_head, "logit_grad", lambda logits, *a: (seen.append(tuple(logits.shape)), grad(logits, *a))[1])
    V, H, chunk = 300, 8, 64
    weight = torch.randn(V, H, requires_grad=True)
    for num_tokens in (100, 5000):
        seen.clear()
        hidden = torch.randn(num_tokens, H, requires_grad=True)
        lp, ent = token_logprobs(hidden, weight, None, torch.randint(0, V, (num_tokens,)), chunk=chunk)
        (lp.sum() + ent.sum()).backward()
        assert len(seen) == 2 * -(-num_tokens // chunk)
        assert max(rows for rows, _ in seen) <= chunk and all(v == V for _, v in seen)


def test_tuned_products_change_nothing_off_cuda():
    """train.tuned_products off a GPU: nothing to tune, and the lm_head multiplies as PyTorch does."""
    g, hidden, weight, bias, labels, inputs = _lm_head_problem(2, False)
    assert lm_head.tune_lm_head(weight.detach()) == {}
    lp, ent = token_logprobs(hidden, weight, None, labels, chunk=8, tuned=True)
    ref_lp, ref_ent = token_logprobs(hidden, weight, None, labels, chunk=8)
    assert torch.equal(lp, ref_lp) and torch.equal(ent, ref_ent)
    got = torch.autograd.grad((lp + ent).sum(), inputs)
    want = torch.autograd.grad((ref_lp + ref_ent).sum(), inputs)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def _tied_problem(seed: int, N: int = 29, H: int = 12, V: int = 40):
    """A tied-embedding lm_head problem in fp64: the same Parameter embeds the tokens and, through a
    nonlinear layer, projects the hidden states back onto the vocabulary; (ids, labels, g_lp, g_ent,
    weight, layer weight)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(V, H, dtype=torch.float64, generator=g))
    layer = torch.nn.Parameter(torch.randn(H, H, dtype=torch.float64, generator=g) / H**0.5)
    ids, labels = torch.randint(0, V, (N,), generator=g), torch.randint(0, V, (N,), generator=g)
    g_lp, g_ent = torch.randn(N, dtype=torch.float64, generator=g), torch.randn(N, dtype=torch.float64, generator=g)
    return ids, labels, g_lp, g_ent, weight, layer


def _tied_loss(ids, labels, g_lp, g_ent, weight, layer, *, fused: bool, seen: list | None = None):
    """sum(g_lp * lp + g_ent * entropy) through embedding -> tanh layer -> lm_head (both paths); when
    `seen` is given, records whether `weight.grad` was already set when the backward reached the
    embedding's output, i.e. before the layer's backward."""
    emb = torch.nn.functional.embedding(ids, weight)
    if seen is not None:
        emb.register_hook(lambda grad: seen.append(weight.grad is not None))
    hidden = torch.tanh(emb @ layer)
    if fused:
        lp, ent, zero = lm_head.token_logprobs_with_grad(hidden, weight, None, labels, lambda rows, lp, ent: (g_lp[rows], g_ent[rows]), chunk=8)
        return zero
    lp, ent = token_logprobs(hidden, weight, None, labels, chunk=8)
    return (g_lp * lp + g_ent * ent).sum()


@pytest.mark.parametrize("fused", [True, False])
def test_tied_weight_gradient_reaches_grad_before_the_layers_backward(fused):
    """The lm_head's part of a tied weight's gradient goes into `.grad` as soon as it is made, instead
    of waiting in autograd's buffer for the embedding's part at the end of the backward (which kept a
    `[V, H]` buffer alive through the decoder layers' backward, where the peak memory is); the sum in
    `.grad` is the plain autograd gradient, also when micro-batches accumulate."""
    ids, labels, g_lp, g_ent, weight, layer = _tied_problem(3)
    ref_w, ref_l = torch.nn.Parameter(weight.detach().clone()), torch.nn.Parameter(layer.detach().clone())
    for micro in range(2):  # a second backward accumulates into the first's .grad
        seen = []
        _tied_loss(ids, labels, g_lp * (micro + 1), g_ent, weight, layer, fused=fused, seen=seen).backward()
        assert seen == [True]
        z = torch.nn.functional.linear(torch.tanh(torch.nn.functional.embedding(ids, ref_w) @ ref_l), ref_w)
        logp = torch.log_softmax(z, -1)
        lp, ent = logp.gather(-1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
        ((g_lp * (micro + 1) * lp + g_ent * ent).sum()).backward()
        torch.testing.assert_close(weight.grad, ref_w.grad, atol=1e-11, rtol=1e-11)
        torch.testing.assert_close(layer.grad, ref_l.grad, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("fused", [True, False])
def test_tied_weight_gradient_still_through_autograd_where_it_must_be(fused):
    """`torch.autograd.grad` writes no `.grad`, and a gradient hook on the weight (the fp32 master
    weights' post-accumulate hook, say) still sees the whole gradient, once, through autograd."""
    ids, labels, g_lp, g_ent, weight, layer = _tied_problem(4)
    want_w, want_l = torch.autograd.grad(_tied_loss(ids, labels, g_lp, g_ent, weight, layer, fused=False), [weight, layer])
    got_w, got_l = torch.autograd.grad(_tied_loss(ids, labels, g_lp, g_ent, weight, layer, fused=fused), [weight, layer])
    assert weight.grad is None and layer.grad is None
    torch.testing.assert_close(got_w, want_w, atol=1e-11, rtol=1e-11)
    # Only the layer's gradient asked for: the weight's part is dropped by autograd, not written anywhere.
    (got_l,) = torch.autograd.grad(_tied_loss(ids, labels, g_lp, g_ent, weight, layer, fused=fused), [layer])
    assert weight.grad is None
    torch.testing.assert_close(got_l, want_l, atol=1e-11, rtol=1e-11)
    hooked = []
    weight.register_post_accumulate_grad_hook(lambda p: hooked.append(p.grad.clone()))
    seen = []
    _tied_loss(ids, labels, g_lp, g_ent, weight, layer, fused=fused, seen=seen).backward()
    assert seen == [False] and len(hooked) == 1
    torch.testing.assert_close(hooked[0], want_w, atol=1e-11, rtol=1e-11)
