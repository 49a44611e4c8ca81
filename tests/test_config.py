import pytest

from hybridrl.config import ConfigError, load_config

GOOD = """
model: {path: some/model}
data: {train_path: data.jsonl}
rollout: {n: 4}
train: {batch_size: 16, micro_batch_size: 8, lr: 1.0e-5}
"""


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_yaml_and_overrides(tmp_path):
    cfg = load_config(write(tmp_path, GOOD), ["train.lr=3e-4", "rollout.temperature=0.7", "algorithm.dual_clip=3"])
    assert cfg.train.lr == 3e-4
    assert cfg.rollout.temperature == 0.7
    assert cfg.algorithm.dual_clip == 3.0
    assert cfg.train.batch_size == 16
    assert cfg.train.adam_betas == (0.9, 0.999)


def test_unknown_key_suggests(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key train\.lr_shedule: did you mean train\.lr_schedule"):
        load_config(write(tmp_path, GOOD), ["train.lr_shedule=cosine"])
    with pytest.raises(ConfigError, match=r"unknown config key trainr"):
        load_config(write(tmp_path, GOOD + "trainr: {}\n"))


def test_batch_arithmetic_names_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.batch_size \(12\) must be divisible by rollout\.n \(8\).*train\.batch_size=8"):
        load_config(write(tmp_path, GOOD), ["train.batch_size=12", "rollout.n=8"])
    with pytest.raises(ConfigError, match=r"mini_batch_size \(16\) must be divisible by train\.micro_batch_size \(5\)"):
        load_config(write(tmp_path, GOOD), ["train.micro_batch_size=5"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=-1", "train.lr must not be negative"),
        ("train.lr=fast", "train.lr must be a number"),
        ("rollout.n=two", "rollout.n must be an integer"),
        ("rollout.top_p=1.5", r"rollout.top_p must be in \(0, 1\]"),
        ("algorithm.name=grpoo", "did you mean 'grpo'"),
        ("algorithm.dual_clip=0.5", "dual_clip must be greater than 1"),
        ("model.path=", "model.path is empty"),
        ("rollout.n=1", "rollout.n must be at least 2"),
        ("algorithm.loss_agg=mean", "algorithm.loss_agg is 'mean'"),
        ("trainer.progress=maybe", "trainer.progress must be true or false"),
    ],
)
def test_bad_values(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, GOOD), [override])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "model: [unclosed"))
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config(write(tmp_path, GOOD), ["train.lr"])


def test_apply_overrides_to_a_built_config():
    from hybridrl.config.loading import apply_overrides

    base = load_config(None, ["model.path=some/model", "data.train_path=rows.jsonl"])
    changed = apply_overrides(base, ["train.lr=2e-5", "train.adam_betas=[0.9,0.95]"])
    assert changed.train.lr == 2e-5 and changed.train.adam_betas == (0.9, 0.95)
    assert base.train.lr != 2e-5 and changed.model.path == "some/model"  # a copy; the rest kept
    with pytest.raises(ConfigError, match="train.lrr"):
        apply_overrides(base, ["train.lrr=1"])
