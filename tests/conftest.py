"""Shared fixtures: the shipped tiny model, the arithmetic data, small fast configs."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = REPO / "hybridrl" / "assets" / "tiny-arith"


@pytest.fixture(autouse=True)
def _restore_determinism():
    """train.deterministic switches torch's deterministic mode on for the process: no test leaks it."""
    import torch.utils.deterministic

    before = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.utils.deterministic.fill_uninitialized_memory = before[1]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def interpreter_loops_to_runtime_bounds() -> bool:
    """Whether Triton's CPU interpreter can run a kernel loop over a run-time bound (`range(lo, hi,
    TILE)`): Triton 3.6's interpreter turns the bound into int() of a 1-element array, which numpy
    >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"). Compiled for a
    GPU the same loops are fine."""
    import numpy

    return tuple(int(p) for p in numpy.__version__.split(".")[:2]) < (2, 4)


def bench_script(name: str):
    """Imports bench/<name>.py (the benchmarks are scripts, not a package; bench/ is on the path while
    it loads, as when it runs, so one script may import another)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "bench"))


@pytest.fixture(scope="module")
def one_thread():
    """Runs a module of tiny-model tests single-threaded: waking a second BLAS thread costs more than
    it saves (10x slower on a loaded 2-core machine). Use as `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def save_random_head_reward_model(out: Path, seed: int) -> Path:
    """The tiny model as a reward model with a random (seeded) head, saved to `out` as a HF directory:
    a stand-in for a trained reward model."""
    from hybridrl.reward.model import TrainableRewardModel

    trainable = TrainableRewardModel.from_hf(str(TINY_MODEL), device="cpu")
    torch.manual_seed(seed)
    torch.nn.init.normal_(trainable.model.score.weight, std=0.5)
    trainable.model.save_pretrained(out)
    trainable.tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    return TINY_MODEL


@pytest.fixture(scope="session")
def arith_data(tmp_path_factory) -> dict[str, Path]:
    from hybridrl.data import write_arith_dataset

    out = tmp_path_factory.mktemp("arith")
    return write_arith_dataset(out, num_train=2000, num_test=200, seed=0)


# For tests that compare two runs bit for bit (a resumed one with a straight one): on a GPU that needs torch's
# deterministic kernels (README, "What a run writes"); on CPU it changes nothing.
BIT_EXACT = {"train.deterministic": True}


def small_config(tmp_path: Path, arith_data, **overrides):
    """A fast GRPO config on the tiny model; override with dotted keys, e.g. {"train.lr": 1e-4}."""
    from hybridrl.config import load_config

    base = {
        "model.path": str(TINY_MODEL),
        "data.train_path": str(arith_data["train"]),
        "data.eval_path": str(arith_data["test"]),
        "data.max_prompt_length": 16,
        "rollout.backend": "hf",
        "rollout.n": 4,
        "rollout.max_tokens": 6,
        "train.batch_size": 32,
        "train.micro_batch_size": 16,
        "train.total_steps": 4,
        "train.lr": 1e-4,
        "trainer.output_dir": str(tmp_path / "run"),
        "trainer.save_every": 2,
        "trainer.progress": False,
        "trainer.eval_samples": 50,
        "algorithm.kl_coef": 0.001,
    }
    base.update(overrides)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


import transformers  # noqa: E402

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
