"""Learned reward models: offloaded vs resident scoring, rendering, batching, normalisation, mixing."""

import json
import math

import pytest
import torch

from conftest import TINY_MODEL, save_random_head_reward_model
from hybridrl.data import load_preference_dataset
from hybridrl.models.loading import ModelLoadError
from hybridrl.reward import RewardEngine, RewardError
from hybridrl.reward.model import RewardModel, TrainableRewardModel, right_padded, sequence_scores, token_budget_groups
from hybridrl.reward.normalize import RunningMeanStd

PROMPTS = [f"{a}+{b}=" for a, b in [(1, 2), (12, 34), (99, 9), (5, 50), (70, 7), (3, 33), (45, 54)]]
RESPONSES = ["3", "46", "1008", "", "77 and some more text", "36", "99"]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """The tiny model as a reward model with a random (seeded) head, saved as a HF directory."""
    return save_random_head_reward_model(tmp_path_factory.mktemp("rm"), seed=0)


def component(engine: RewardEngine) -> RewardModel:
    return engine.slots[0].component


def test_offloaded_and_resident_scores_are_identical(rm_dir):
    # Small budgets: several micro-batches per wave and several waves, so prefetch crosses waves.
    offloaded = RewardEngine.from_hf(str(rm_dir), offload=True, device="cpu", max_batch_tokens=24, max_wave_tokens=60)
    resident = RewardEngine.from_hf(str(rm_dir), offload=False, device="cpu", max_batch_tokens=24)
    a = offloaded.score(PROMPTS, RESPONSES)
    b = resident.score(PROMPTS, RESPONSES)
    assert a.scores == b.scores
    assert len(set(a.scores)) == len(PROMPTS)  # a real head: every pair scores differently
    # Offload keeps nothing but views of flat CPU buffers; the layers never move.
    rm = component(offloaded)
    assert rm.offload and all(p.device.type == "cpu" for p in rm.model.parameters())
    assert [len(w) for w in rm.runner._waves([right_padded([[1] * 5] * 2, 0)] * 7)] == [6, 1]  # 10 tokens each, 60 a wave


def test_scores_match_the_training_forward_and_do_not_depend_on_batching(rm_dir):
    rm = component(RewardEngine.from_hf(str(rm_dir), offload=True, device="cpu", max_batch_tokens=16))
    one_batch = component(RewardEngine.from_hf(str(rm_dir), offload=False, device="cpu", max_batch_tokens=10_000))
    scores = rm(PROMPTS, RESPONSES)
    sequences = rm.encode(PROMPTS, RESPONSES)
    batch = right_padded(sequences, rm.tokenizer.pad_token_id)
    with torch.no_grad():
        trained = sequence_scores(one_batch.model, batch.input_ids, batch.attention_mask())
    torch.testing.assert_close(torch.tensor(scores), trained, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(one_batch(PROMPTS, RESPONSES)), trained, atol=1e-5, rtol=1e-5)


def test_pairs_are_encoded_as_preference_data_is(rm_dir, tmp_path):
    rm = component(RewardEngine.from_hf(str(rm_dir), offload=False, device="cpu"))
    rows = [{"prompt": "12+34=", "chosen": "46", "rejected": "47"},
            {"prompt": [{"role": "user", "content": "1+2="}], "chosen": [{"role": "assistant", "content": "3"}],
             "rejected": [{"role": "assistant", "content": "4"}]}]
    path = tmp_path / "pref.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = load_preference_dataset(path, rm.tokenizer)
    prompts = [rows[0]["prompt"], rows[1]["prompt"]]
    assert rm.encode(prompts, ["46", "3"]) == [ex.prompt_ids + ex.chosen_ids for ex in examples]
    eos = rm.tokenizer.eos_token_id
    assert rm.encode(["1+1="], [""])[0][-1] == eos and rm.encode(["1+1="], ["2"])[0][-2:] != [eos, eos]


def test_token_budget_groups():
    assert token_budget_groups([3, 9, 4, 9, 1], max_tokens=18) == [[1, 3], [2, 0, 4]]
    assert token_budget_groups([30, 2], max_tokens=10) == [[0], [1]]  # too long alone: its own group
    assert token_budget_groups([], max_tokens=10) == []


def test_running_normalisation_and_clipping(rm_dir):
    stats = RunningMeanStd()
    stats.update([1.0, 2.0])
    stats.update([3.0, 6.0])
    assert stats.mean == pytest.approx(3.0) and stats.std == pytest.approx(math.sqrt(3.5))  # population std of 1,2,3,6
    engine = RewardEngine.from_hf(str(rm_dir), offload=False, device="cpu", normalize=True, clip=1.0)
    raw = component(engine).raw_scores(component(engine).encode(PROMPTS, RESPONSES))
    scores = engine.score(PROMPTS, RESPONSES).scores
    mean, std = sum(raw) / len(raw), torch.tensor(raw).std(unbiased=False).item()
    assert scores == pytest.approx([max(-1.0, min(1.0, (r - mean) / std)) for r in raw], abs=1e-5)
    saved = engine.state_dict()
    assert saved["reward_model"]["normalizer"]["count"] == len(PROMPTS)
    with engine.frozen_state():  # evaluation leaves no trace
        engine.score(PROMPTS[:2], RESPONSES[:2])
    assert engine.state_dict() == saved


def test_mixes_with_function_rewards_and_streams_after_generation(rm_dir):
    rm = RewardEngine.from_hf(str(rm_dir), offload=True, device="cpu")
    mixed = RewardEngine.mix([(rm, 2.0), (RewardEngine.from_builtin("arith"), 0.5)])
    truth = [str(eval(p[:-1])) for p in PROMPTS]
    model_scores = rm.score(PROMPTS, RESPONSES).scores
    result = mixed.score(PROMPTS, RESPONSES, {"ground_truth": truth})
    expected = [2.0 * m + 0.5 * (r == t) for m, r, t in zip(model_scores, RESPONSES, truth)]
    assert result.scores == pytest.approx(expected, abs=1e-6)
    # Streaming: the function scores per sample as responses finish; the model once, on the whole batch.
    scorer = mixed.stream({"ground_truth": truth}, num_workers=2)
    for i in reversed(range(len(PROMPTS))):
        scorer.submit(i, PROMPTS[i], RESPONSES[i])
    streamed = scorer.finish(len(PROMPTS))
    assert streamed.scores == pytest.approx(expected, abs=1e-6)
    assert {"timing/reward", "timing/reward_exposed", "reward/overlap_ratio"} <= set(streamed.metrics)
    with pytest.raises(RewardError, match="scores whole batches"):
        RewardEngine.from_component(component(rm), timeout_s=1.0)


def test_a_language_model_is_not_a_reward_model():
    with pytest.raises(ModelLoadError, match="no reward head"):
        RewardEngine.from_hf(str(TINY_MODEL), device="cpu")


@pytest.mark.gpu
def test_offload_memory_on_gpu(rm_dir):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    config = Qwen2Config(hidden_size=512, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=1000, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config).to(torch.bfloat16)
    tokenizer = TrainableRewardModel.from_hf(str(TINY_MODEL), device="cpu").tokenizer
    resident = RewardModel(model, tokenizer, offload=False, device="cuda", max_batch_tokens=256)
    expected = resident(PROMPTS * 8, RESPONSES * 8)
    resident.runner.model.to("cpu")
    offloaded = RewardModel(model, tokenizer, offload=True, device="cuda", max_batch_tokens=256, max_wave_tokens=1024)
    weight_bytes = offloaded.runner.weight_bytes
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    scores = offloaded(PROMPTS * 8, RESPONSES * 8)
    peak = torch.cuda.max_memory_allocated() - base
    assert torch.cuda.memory_allocated() == base  # nothing left on the device between calls
    assert peak <= 0.25 * weight_bytes, (peak, weight_bytes)
    assert scores == pytest.approx(expected, abs=0.05)
