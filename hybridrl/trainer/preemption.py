"""Preemption: SIGTERM / SIGINT end training at a step boundary, with a checkpoint.

Slurm and Kubernetes send SIGTERM and, some 30 s later, SIGKILL. The first SIGTERM or SIGINT asks
`fit` to stop after the current step and save. If the step is still running
`trainer.preemption_grace_s` seconds after the signal and has not applied an update yet, it is
abandoned: `StepAbandoned` is raised in the main thread (from a SIGALRM handler) and the trainer
undoes the step (see `StepJournal`), so the checkpoint is the one an uninterrupted run would have
written at that step. A step that has started updating always runs to its end. A second signal
exits at once: checkpoints and metrics lines are written atomically, so nothing on disk is
corrupt; only the work since the last checkpoint is lost.
"""

from __future__ import annotations

import copy
import logging
import os
import random
import signal
import threading
from typing import Any, Callable

import numpy as np
import torch

log = logging.getLogger("hybridrl.trainer")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StepAbandoned(BaseException):
    """The preempted step overran its grace period before updating anything.

    A BaseException, like KeyboardInterrupt, so that no `except Exception` inside the step (a
    reward function, generation) can swallow it.
    """


class PreemptionHandler:
    """Installs the SIGTERM / SIGINT / SIGALRM handlers for the duration of `with`, then restores
    the previous ones. `can_abandon()` says whether the running step may still be abandoned."""

    def __init__(self, grace_s: float, can_abandon: Callable[[], bool]):
        self.grace_s = grace_s
        self.can_abandon = can_abandon
        self.signal_name: str | None = None  # the first signal received, e.g. "SIGTERM"
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def __enter__(self) -> "PreemptionHandler":
        if threading.current_thread() is not threading.main_thread():
            log.warning("fit() runs outside the main thread, so SIGTERM/SIGINT cannot be caught to save a checkpoint first")
            return self
        for sig in (*SIGNALS, signal.SIGALRM):
            self._previous[sig] = signal.signal(sig, self._on_alarm if sig == signal.SIGALRM else self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            # os.write, not logging: this may interrupt a logging call holding its lock.
            os.write(2, f"\n{name} again: exiting now without a checkpoint; the last checkpoint is intact "
                        "and running the same command resumes from it\n".encode())
            os._exit(128 + signum)
        self.signal_name = name
        log.warning("%s received: finishing the current step (it is abandoned if it has not started updating within "
                    "trainer.preemption_grace_s=%gs), then saving a checkpoint. Send it again to exit at once.",
                    name, self.grace_s)
        if self.grace_s > 0:
            signal.setitimer(signal.ITIMER_REAL, self.grace_s)
        else:
            self._on_alarm(signal.SIGALRM, frame)

    def _on_alarm(self, signum: int, frame) -> None:
        if self.requested and self.can_abandon():
            raise StepAbandoned(f"the step overran trainer.preemption_grace_s={self.grace_s:g}s after {self.signal_name}")


class StepJournal:
    """What one step changes before its first optimizer update, kept so the step can be undone.

    Until an optimizer steps, a step has advanced only the data position and the RNG streams (and,
    at its end, the LR schedules): `undo()` puts them back, leaving the trainer exactly as before
    the step. `finish()` rewinds the LR schedule of every optimizer that did not step (all its
    updates were skipped for NaN/inf), so a skipped update leaves optimizer and schedule untouched.
    """

    def __init__(self, loader, pairs: list[tuple[torch.optim.Optimizer, Any]]):
        self.loader = loader
        self.pairs = pairs  # (optimizer, its LR scheduler)
        self.open = False
        self._stepped: set[int] = set()
        self._hooks = [opt.register_step_pre_hook(self._on_optimizer_step) for opt, _ in pairs]
        self._saved: dict[str, Any] = {}

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._stepped.add(id(optimizer))

    @property
    def updated(self) -> bool:
        """An optimizer has stepped since `begin()`: the step can no longer be undone."""
        return bool(self._stepped)

    def can_undo(self) -> bool:
        return self.open and not self.updated

    def begin(self) -> None:
        self._stepped.clear()
        self._saved = {
            "loader": self.loader.state_dict(),
            "rng": (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                    torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None),
            "schedules": [(copy.deepcopy(sched.state_dict()), [g["lr"] for g in opt.param_groups]) for opt, sched in self.pairs],
        }
        self.open = True

    def finish(self) -> None:
        if not self.open:
            return
        self.open = False  # first: from here on the step is no longer abandoned
        for (opt, sched), saved in zip(self.pairs, self._saved["schedules"]):
            if id(opt) not in self._stepped:
                _restore_schedule(opt, sched, saved)

    def undo(self) -> None:
        assert self.can_undo(), "a step that has updated the model cannot be undone"
        self.open = False
        self.loader.load_state_dict(self._saved["loader"])
        py, np_state, torch_state, cuda_states = self._saved["rng"]
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        for (opt, sched), saved in zip(self.pairs, self._saved["schedules"]):
            _restore_schedule(opt, sched, saved)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _restore_schedule(optimizer, scheduler, saved) -> None:
    state, lrs = saved
    scheduler.load_state_dict(copy.deepcopy(state))
    for group, lr in zip(optimizer.param_groups, lrs):  # the scheduler's step also set these
        group["lr"] = lr
