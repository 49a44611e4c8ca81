"""`hybridrl` command line: train, demo, export, make-data.

User errors (a bad config, dataset, checkpoint, reward function) print one message that names
the problem and the fix, and exit with status 2; `--debug` shows the traceback too.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

EPILOG = """examples:
  hybridrl demo                                   # GRPO on the tiny model, CPU, a few minutes
  hybridrl make-data arith data/arith             # write the arithmetic task (train/test jsonl)
  hybridrl train examples/arith_grpo.yaml         # train from a YAML config
  hybridrl train examples/arith_grpo.yaml train.lr=1e-5 rollout.n=4 trainer.output_dir=runs/x
  hybridrl export runs/x/checkpoints/step_000050 exported-model

A run writes <output_dir>/metrics.jsonl (one JSON record per step), <output_dir>/config.yaml and
<output_dir>/checkpoints/step_XXXXXX/. Running the same command again resumes from the latest
intact checkpoint (trainer.resume=auto); trainer.resume=off starts over, moving the earlier run's
checkpoints and records to <output_dir>/superseded-<time>/.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hybridrl",
        description="Reinforcement-learning post-training of language models (PPO, GRPO, RLOO, REINFORCE++, DPO, KTO, SFT).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    t = sub.add_parser("train", help="train from a YAML config", formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Train from a YAML config, with dotted key=value overrides.\n\n"
                                   "Sections: model, data, rollout, reward, algorithm, train, trainer; every field is\n"
                                   "documented in hybridrl/config/schema.py. Example:\n"
                                   "  hybridrl train examples/arith_grpo.yaml train.total_steps=50 rollout.n=8")
    t.add_argument("config", help="YAML config file")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.lr=1e-5")
    t.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks for errors")

    d = sub.add_parser("demo", help="GRPO on the tiny arithmetic model on CPU; prints accuracy before and after")
    d.add_argument("--output-dir", default="runs/demo", help="where data, metrics and checkpoints go (default: runs/demo)")
    d.add_argument("--steps", type=int, default=None, help="RL steps (default: the demo config's)")
    d.add_argument("--algorithm", default="grpo", choices=["grpo", "ppo", "rloo", "reinforce_pp_baseline"], help="RL algorithm (default: grpo)")
    d.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks for errors")

    e = sub.add_parser("export", help="export a checkpoint's model as a HF directory")
    e.add_argument("checkpoint", help="a checkpoint directory (…/checkpoints/step_XXXXXX) or a checkpoints root (uses the latest)")
    e.add_argument("out_dir", help="new directory to write (config, safetensors, tokenizer)")
    e.add_argument("--model", default="model", help="which model of the checkpoint: model (the policy) or critic")
    e.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks for errors")

    m = sub.add_parser("make-data", help="write a synthetic dataset (train/test jsonl)")
    m.add_argument("task", choices=["arith", "arith-preference", "arith-unpaired", "arith-sft"], help="which dataset")
    m.add_argument("out_dir", help="directory to write train.jsonl and test.jsonl into")
    m.add_argument("--num-train", type=int, default=5000)
    m.add_argument("--num-test", type=int, default=500)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks for errors")
    return p


def user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions that are the user's to fix: reported as one message, not a traceback."""
    from hybridrl.checkpoint import CheckpointError
    from hybridrl.config import ConfigError
    from hybridrl.data import DataError
    from hybridrl.metrics import MetricsWriteError
    from hybridrl.models import ModelLoadError
    from hybridrl.reward import RewardError
    from hybridrl.train.oom import OutOfMemoryError
    from hybridrl.train.update import NonFiniteLossError

    return (ConfigError, DataError, ModelLoadError, CheckpointError, RewardError, MetricsWriteError, NonFiniteLossError,
            OutOfMemoryError)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    setup_logging(args.debug)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - sorted into user errors and bugs below
        if args.debug or not isinstance(e, user_error_types()):
            raise
        print(f"error: {e}", file=sys.stderr)
        print("(run with --debug for the traceback)", file=sys.stderr)
        return 2


def run(args) -> int:
    if args.command == "train":
        from hybridrl.cli.commands import train

        return train(args.config, args.overrides)
    if args.command == "demo":
        from hybridrl.cli.demo import demo

        return demo(args.output_dir, steps=args.steps, algorithm=args.algorithm)
    if args.command == "export":
        from hybridrl.checkpoint import export_checkpoint

        out = export_checkpoint(args.checkpoint, args.out_dir, model=args.model)
        print(f"exported {args.checkpoint} -> {out} (load it with transformers.AutoModelForCausalLM.from_pretrained)")
        return 0
    if args.command == "make-data":
        from hybridrl.cli.commands import make_data

        return make_data(args.task, args.out_dir, num_train=args.num_train, num_test=args.num_test, seed=args.seed)
    raise AssertionError(args.command)


def setup_logging(debug: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        pass


if __name__ == "__main__":
    sys.exit(main())
