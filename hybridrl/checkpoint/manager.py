"""Atomic, verified, resumable checkpoints.

Layout of `<output_dir>/checkpoints/step_000042/`:

    model/               HF directory (safetensors + config + tokenizer): loadable by transformers
    critic/              the same for the critic, when there is one
    optimizer.pt ...     optimizer / scheduler state dicts (loaded with weights_only=True)
    state.json           step, token counters, data-loader position, RNG states, anything JSON
    config.yaml          the run's resolved config
    manifest.json        size and sha256 of every file above; written last

A checkpoint is first written to a hidden temporary directory, fsync'd, then renamed into place,
and `latest` is replaced atomically after that. A directory without a manifest whose sizes and
checksums match is never trusted: resume falls back to the newest intact checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from hybridrl import failpoints

log = logging.getLogger("hybridrl.checkpoint")

MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or trusted; the message says which and what to do."""


@dataclass
class CheckpointState:
    """Everything that is saved at one step."""

    step: int
    models: dict[str, tuple[torch.nn.Module, Any]] = field(default_factory=dict)  # name -> (model, tokenizer|None)
    tensors: dict[str, dict] = field(default_factory=dict)  # name -> state_dict (optimizer, scheduler)
    state: dict[str, Any] = field(default_factory=dict)  # JSON-serialisable trainer state
    config: dict[str, Any] = field(default_factory=dict)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointManager:
    def __init__(self, root: str | Path, keep_last: int = 3):
        self.root = Path(root)
        self.keep_last = keep_last

    @staticmethod
    def step_dir_name(step: int) -> str:
        return f"step_{step:06d}"

    # ---- writing -------------------------------------------------------------------------
    def save(self, ckpt: CheckpointState) -> Path:
        """Writes the checkpoint atomically and prunes old ones; returns its directory."""
        failpoints.reached("checkpoint")
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / self.step_dir_name(ckpt.step)
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            for name, (model, tokenizer) in ckpt.models.items():
                model.save_pretrained(tmp / name, safe_serialization=True)
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp / name)
            for name, state_dict in ckpt.tensors.items():
                torch.save(state_dict, tmp / f"{name}.pt")
            (tmp / "state.json").write_text(json.dumps(ckpt.state, indent=1), encoding="utf-8")
            (tmp / "config.yaml").write_text(yaml.safe_dump(ckpt.config, sort_keys=False), encoding="utf-8")
            files = {
                str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": _sha256(p)}
                for p in sorted(tmp.rglob("*")) if p.is_file()
            }
            manifest = {"step": ckpt.step, "files": files}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
            _fsync_tree(tmp)
            if final.exists():  # re-saving a step (e.g. after a resume): replace it whole
                trash = self.root / f".trash-{final.name}-{os.getpid()}"
                os.replace(final, trash)
                os.replace(tmp, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _atomic_write_text(self.root / LATEST, final.name + "\n")
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(
                f"could not write checkpoint {final}: {e.strerror or e}. The previous checkpoints are intact. "
                "Free disk space or choose a writable trainer.output_dir; set trainer.continue_on_save_error=true to keep training anyway."
            ) from e
        self._prune()
        return final

    def _prune(self) -> None:
        steps = self.list_steps()
        for path in steps[: -self.keep_last] if self.keep_last > 0 else []:
            shutil.rmtree(path, ignore_errors=True)
        for stale in [*self.root.glob(".tmp-step_*"), *self.root.glob(".trash-step_*")]:  # left by a crash mid-save
            if not stale.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(stale, ignore_errors=True)

    def set_aside(self, step: int, dest: Path, keep: Path | None = None) -> list[str]:
        """Moves the checkpoints a run continuing from `step` will not continue from into `dest`.

        Those are every checkpoint past `step` (a later point of the run being rewound, or a damaged
        one resume skipped) and the one at `step` unless it is `keep`, the checkpoint being resumed.
        Left in place they would count against `keep_last` and, after a crash before the next
        save, `latest` would send resume back to them. Nothing is deleted; `latest` is rewritten
        to name `keep` (or removed). Returns the names moved.
        """
        keep = keep.resolve() if keep is not None else None
        moving = [p for p in self.list_steps()
                  if int(p.name[5:]) > step or (int(p.name[5:]) == step and p.resolve() != keep)]
        if not moving:
            return []
        try:
            dest.mkdir(parents=True, exist_ok=True)
            for path in moving:
                os.replace(path, dest / path.name)
        except OSError as e:
            raise CheckpointError(
                f"could not move the checkpoints past step {step} out of {self.root} into {dest}: {e.strerror or e}. "
                "Move them away yourself (or delete them) and run again"
            ) from e
        marker = self.root / LATEST
        if keep is not None and keep.parent == self.root.resolve():
            _atomic_write_text(marker, keep.name + "\n")
        elif marker.is_file():
            named = marker.read_text(encoding="utf-8").strip()
            if not named or not (self.root / named).is_dir():
                marker.unlink()
        return [p.name for p in moving]

    # ---- reading -------------------------------------------------------------------------
    def list_steps(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        dirs = [p for p in self.root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()]
        return sorted(dirs, key=lambda p: int(p.name[5:]))

    @staticmethod
    def verify(path: Path) -> str | None:
        """None if the checkpoint is intact, else what is wrong with it."""
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            return "it has no manifest.json (it was not completely written)"
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            files = manifest["files"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError):
            return "its manifest.json is corrupt"
        for rel, meta in files.items():
            p = path / rel
            if not p.is_file():
                return f"{rel} is missing"
            if p.stat().st_size != meta["size"]:
                return f"{rel} has {p.stat().st_size} bytes, the manifest says {meta['size']} (truncated or overwritten)"
            if _sha256(p) != meta["sha256"]:
                return f"{rel} does not match its checksum (corrupted)"
        return None

    def latest_intact(self) -> Path | None:
        """The newest checkpoint that verifies, warning about each damaged one skipped."""
        marker = self.root / LATEST
        candidates = self.list_steps()
        if marker.is_file():
            named = self.root / marker.read_text(encoding="utf-8").strip()
            if named in candidates:  # the marker wins ties; anything newer was never marked complete
                candidates = [c for c in candidates if int(c.name[5:]) <= int(named.name[5:])]
        for path in reversed(candidates):
            problem = self.verify(path)
            if problem is None:
                return path
            log.warning("checkpoint %s is damaged (%s); falling back to an older one", path, problem)
        return None

    def resolve(self, resume: str) -> Path | None:
        """The checkpoint directory to resume from for `trainer.resume` (auto / off / a path)."""
        if resume == "off":
            return None
        if resume == "auto":
            intact = self.latest_intact()
            if intact is None and self.list_steps():
                raise CheckpointError(
                    f"{self.root} holds checkpoints but none is intact (see the warnings above), so the run cannot resume. "
                    "Move the damaged directories away and run again, or set trainer.resume=off to start over"
                )
            return intact
        path = Path(resume)
        if path.is_dir() and (path / LATEST).is_file():  # a checkpoints root was given
            intact = CheckpointManager(path).latest_intact()
            if intact is None:
                raise CheckpointError(f"trainer.resume={resume}: no intact checkpoint there (see the warnings above); pick another or use trainer.resume=off")
            return intact
        if not path.is_dir():
            raise CheckpointError(f"trainer.resume={resume}: no such checkpoint directory; use auto, off, or a path like {self.root}/step_000010")
        problem = self.verify(path)
        if problem is not None:
            raise CheckpointError(f"checkpoint {path} cannot be trusted: {problem}. Resume from another one (see {self.root}) or use trainer.resume=auto")
        return path

    @staticmethod
    def load_tensors(path: Path, name: str) -> dict:
        # weights_only: a checkpoint is data; a pickle that would run code is refused, not run.
        try:
            return torch.load(path / f"{name}.pt", map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"{path / f'{name}.pt'} holds more than tensors and plain data, so it is not loaded "
                                  f"(weights_only=True): {str(e).splitlines()[0]}. Resume from a checkpoint hybridrl wrote") from None

    @staticmethod
    def load_state(path: Path) -> dict[str, Any]:
        return json.loads((path / "state.json").read_text(encoding="utf-8"))

    @staticmethod
    def load_config(path: Path) -> dict[str, Any]:
        return yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8")) or {}


def load_model_weights(model: torch.nn.Module, model_dir: Path) -> None:
    """Loads a saved HF directory's safetensors into an existing module, in place."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir} holds no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shapes differ: another model size
        first = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e).splitlines()[0])
        raise CheckpointError(
            f"weights in {model_dir} do not fit the model ({first}). The checkpoint was written for another model; "
            "check model.path, or set trainer.resume=off to start over"
        ) from None
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not (k.endswith("lm_head.weight") and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise CheckpointError(
            f"weights in {model_dir} do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}. "
            "The checkpoint was written for another model; check model.path"
        )
