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
