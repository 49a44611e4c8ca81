"""train.fp32_residual: a bf16 decoder whose residual stream is carried in fp32 (train/residual.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from hybridrl.models.synthetic import random_model
from hybridrl.rollout.native import NativeBackend
from hybridrl.rollout.types import GenerationRequest
from hybridrl.train.batch import build_sequence_batch
from hybridrl.train.logprobs import response_logprobs
from hybridrl.train.residual import RMSNormToWeightDtype, enable_fp32_residual, has_fp32_residual
from hybridrl.train.setup import enable_activation_checkpointing

VOCAB = 1000


pytestmark = pytest.mark.usefixtures("one_thread")


def _models(seed: int = 0):
    """(bf16 model, the same weights in fp32): 8 layers, so the residual's roundings add up."""
    exact = random_model("tiny", "cpu", num_hidden_layers=8, vocab_size=VOCAB, seed=seed)
    model = copy.deepcopy(exact).to(torch.bfloat16)
    exact.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    return model, exact


def _rollout(model, fp32_residual: bool):
    """Native-engine samples as a trainer batch, and their rollout log-probs [B, T]."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 19, 12, 30)]
    request = GenerationRequest(prompts, n=2, max_tokens=[24] * 4, temperature=1.0, seed=3)
    outs = NativeBackend(model, fp32_residual=fp32_residual).generate(request)
    batch = build_sequence_batch([prompts[o.prompt_index] for o in outs], [o.response_ids for o in outs], pad_id=0)
    rollout = torch.zeros(batch.response_mask.shape)
    for i, o in enumerate(outs):
        rollout[i, : len(o.response_ids)] = torch.tensor(o.response_logprobs)
    return batch, rollout


@torch.no_grad()
def _trainer_logprobs(model, batch, packed: bool):
    batch.packed = packed
    lp, _ = response_logprobs(model, batch)
    return lp.float()


def _mean_abs(a, b, mask):
    return ((a - b).abs() * mask).sum().item() / mask.sum().item()


@pytest.mark.parametrize("packed", [False, True])
def test_trainer_logprobs_closer_to_exact(packed):
    """Against the same weights run in fp32 (measured over seeds 0-4: 0.54x to 0.67x the error)."""
    model, exact = _models()
    wide = copy.deepcopy(model)
    enable_fp32_residual(wide)
    batch, _ = _rollout(model, fp32_residual=False)
    truth = _trainer_logprobs(exact, batch, packed)
    mask = batch.response_mask
    err_narrow = _mean_abs(_trainer_logprobs(model, batch, packed), truth, mask)
    err_wide = _mean_abs(_trainer_logprobs(wide, batch, packed), truth, mask)
    assert err_wide < 0.75 * err_narrow, (err_wide, err_narrow)


def test_same_parameters_and_state_dict_and_idempotent():
    model, _ = _models()
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    enable_fp32_residual(model)
    enable_fp32_residual(model)
    assert has_fp32_residual(model)
    assert list(model.state_dict()) == keys
    assert all(p is params[name] for name, p in model.named_parameters())
    assert isinstance(model.model.layers[0].input_layernorm, RMSNormToWeightDtype)
    assert isinstance(model.model.norm, RMSNormToWeightDtype)
    assert len(model.model.embed_tokens._forward_hooks) == 1
    ids = torch.randint(0, VOCAB, (2, 9))
    assert model(ids).logits.dtype == torch.bfloat16


def test_fp32_model_is_left_alone():
    _, exact = _models()
    enable_fp32_residual(exact)
    assert not has_fp32_residual(exact)
    assert not isinstance(exact.model.norm, RMSNormToWeightDtype)


def test_gradients_and_reference_copy():
    model, _ = _models()
    enable_fp32_residual(model)
    enable_activation_checkpointing(model)
    model.train()
    ref = copy.deepcopy(model)  # the trainer's frozen reference copy keeps the fp32 stream
    assert has_fp32_residual(ref) and isinstance(ref.model.layers[3].post_attention_layernorm, RMSNormToWeightDtype)
    ids = torch.randint(0, VOCAB, (2, 12))
    model(ids, labels=ids).loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g.float()).all() for g in grads)
    assert model.model.layers[0].input_layernorm.weight.grad.abs().sum() > 0


def test_unsupported_model_is_named():
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50)
    model = transformers.GPT2LMHeadModel(cfg).to(torch.bfloat16)
    with pytest.raises(ValueError, match="train.fp32_residual=false"):
        enable_fp32_residual(model)


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_config_key_applies_to_policy_and_reference(tmp_path, arith_data, backend):
    from conftest import small_config

    from hybridrl.cli.commands import build_trainer
    from hybridrl.metrics import read_records

    overrides = {"model.dtype": "bfloat16", "train.fp32_residual": True, "rollout.backend": backend, "train.total_steps": 2}
    trainer = build_trainer(small_config(tmp_path, arith_data, **overrides))
    assert has_fp32_residual(trainer.model) and has_fp32_residual(trainer.ref_model)
    if backend == "native":  # rollout.fp32_residual (default on) reached the engine
        assert trainer.rollout.backend.decoder.fp32_residual
    trainer.fit()
    records = read_records(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert torch.isfinite(torch.tensor(r["actor/pg_loss"]))
        assert r["rollout/logprob_diff/mean"] < 1e-2  # hf: the same forward; native: the same rounding points
