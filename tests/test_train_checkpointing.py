"""model.gradient_checkpointing_layers: checkpointing for the first N decoder layers only."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from hybridrl.config import ConfigError, TrainConfig, load_config
from hybridrl.train.batch import build_sequence_batch
from hybridrl.train.logprobs import response_logprobs
from hybridrl.train.setup import compile_layers, enable_activation_checkpointing, prepare_for_training


def _model():
    config = transformers.Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).train()


def _batch():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 100, (4 + i,), generator=g).tolist() for i in range(3) for _ in range(2)]
    responses = [torch.randint(5, 100, (3 + i % 4,), generator=g).tolist() for i in range(6)]
    return dataclasses.replace(build_sequence_batch(prompts, responses, pad_id=0), packed=True)


def _mlp_calls(model) -> list[int]:
    """How often each layer's MLP runs from here on (forward, and recomputation in the backward)."""
    calls = [0] * len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def _grads(checkpointing: bool, layers: int | None, *, groups: int = 0):
    model = _model()
    prepare_for_training(model, TrainConfig(packing="on", packed_attention="flash"), gradient_checkpointing=checkpointing,
                         checkpointed_layers=layers)  # fmt: skip
    if groups:
        torch._dynamo.reset()
        compile_layers(model, groups)
    calls = _mlp_calls(model)
    lp, _ = response_logprobs(model, _batch())
    (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
    return calls, {name: p.grad.clone() for name, p in model.named_parameters()}


def test_checkpointing_is_enabled_under_the_current_method_name_without_a_deprecation_warning(recwarn):
    """transformers after 5.17 renamed gradient_checkpointing_enable to activation_checkpointing_enable (the old
    name warns, and goes in v6)."""
    if not hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable"):
        pytest.skip("this transformers has only gradient_checkpointing_enable")
    model = _model()
    calls = _mlp_calls(model)
    enable_activation_checkpointing(model)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    lp, _ = response_logprobs(model, _batch())
    lp.sum().backward()
    assert calls == [2] * 4  # each layer runs again in the backward
    assert not [w for w in recwarn if "checkpointing_enable" in str(w.message)]


def test_checkpointing_falls_back_to_the_old_method_name():
    """transformers 5.17 (the GPU image's) has only gradient_checkpointing_enable."""

    class OldModel:
        def __init__(self):
            self.calls = []

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            self.calls.append(gradient_checkpointing_kwargs)

    model = OldModel()
    enable_activation_checkpointing(model)
    assert model.calls == [{"use_reentrant": False}]


@pytest.mark.parametrize("layers", [0, 2, 4])
def test_only_the_first_layers_are_recomputed_and_the_gradients_do_not_change(layers):
    calls, grads = _grads(True, layers)
    assert calls == [2] * layers + [1] * (4 - layers)  # a checkpointed layer runs again in the backward
    _, plain = _grads(False, None)
    _, every = _grads(True, None)
    for name, g in grads.items():
        torch.testing.assert_close(g, plain[name], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(g, every[name], atol=1e-6, rtol=1e-5)


def test_spared_last_layer_group_compiles_and_gives_the_same_gradients():
    """With compiled layer groups (checkpointing traced into each group's graph) the last group,
    spared, still gives the fully checkpointed run's gradients."""
    _, spared = _grads(True, 2, groups=2)
    _, every = _grads(True, None, groups=2)
    for name, g in spared.items():
        torch.testing.assert_close(g, every[name], atol=1e-6, rtol=1e-5)


def test_bad_layer_counts_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="between 0 and the model's 4 decoder layers"):
        prepare_for_training(_model(), TrainConfig(), gradient_checkpointing=True, checkpointed_layers=5)
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: x}\ndata: {train_path: x}\n")
    with pytest.raises(ConfigError, match="set model.gradient_checkpointing=true"):
        load_config(str(path), ["model.gradient_checkpointing_layers=2"])
    with pytest.raises(ConfigError, match=">= 0"):
        load_config(str(path), ["model.gradient_checkpointing=true", "model.gradient_checkpointing_layers=-1"])
    cfg = load_config(str(path), ["model.gradient_checkpointing=true", "model.gradient_checkpointing_layers=3"])
    assert cfg.model.gradient_checkpointing_layers == 3
