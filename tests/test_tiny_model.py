"""The shipped tiny model is an ordinary HF directory, partly trained: room for RL to show."""

from transformers import AutoModelForCausalLM

from hybridrl.data import make_arith_rows
from hybridrl.rollout import RolloutEngine


def test_tiny_model_is_small_and_partly_trained(tiny_model_path):
    size_mb = sum(p.stat().st_size for p in tiny_model_path.iterdir()) / 1e6
    assert size_mb < 5
    assert AutoModelForCausalLM.from_pretrained(tiny_model_path).config.model_type == "qwen2"
    engine = RolloutEngine.from_hf(str(tiny_model_path), backend="hf", device="cpu")
    rows = make_arith_rows(200, seed=0, split="test")
    samples = engine.generate([r["prompt"] for r in rows], n=1, max_tokens=6, temperature=0.0)
    accuracy = sum(s.response.strip() == r["ground_truth"] for s, r in zip(samples, rows)) / len(rows)
    assert 0.10 <= accuracy <= 0.60, accuracy
