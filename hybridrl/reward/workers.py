"""Per-sample scoring on worker threads (or processes), each call with an optional deadline.

A call that overruns its deadline is abandoned, never joined: its thread is a daemon, so it cannot
block interpreter exit (a `ThreadPoolExecutor` thread would: its atexit hook joins every worker), a
fresh worker takes its slot, and in process mode its process is killed. The deadline of a sample
starts when a worker begins it, not when it is queued.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hybridrl.reward.functions import call_component, raise_site
from hybridrl.reward.types import Batch, RewardComponent, RewardError


@dataclass
class Outcome:
    """What happened to one per-sample call."""

    value: Any = None  # the raw return value, unchecked
    error: Exception | None = None
    where: str | None = None  # the raise site, for errors from worker processes (no traceback)
    timed_out: bool = False
    busy_s: float = 0.0  # seconds the call ran (up to its deadline if it timed out)
    end: float = field(default_factory=time.perf_counter)  # when it finished or was abandoned


@dataclass(eq=False)
class _Task:
    key: int
    batch: Batch
    start: float | None = None  # set when a worker begins the call
    abandoned: bool = False
    process: _WorkerProcess | None = None


class SampleRunner:
    """Runs `component` on one-sample batches, at most `num_workers` at a time.

    `submit` returns at once; `wait(keys)` blocks until each key has an `Outcome`, marking calls
    that run past `timeout_s` as timed out and abandoning them.
    """

    def __init__(
        self,
        component: RewardComponent,
        num_workers: int,
        timeout_s: float | None = None,
        processes: ProcessWorkers | None = None,
    ):
        assert num_workers >= 1, num_workers
        self.component = component
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self._processes = processes
        self._cond = threading.Condition()
        self._pending: deque[_Task] = deque()
        self._running: dict[int, _Task] = {}
        self._outcomes: dict[int, Outcome] = {}
        self._num_threads = 0  # live worker threads, abandoned ones not counted

    def submit(self, key: int, batch: Batch) -> None:
        with self._cond:
            self._pending.append(_Task(key, batch))
            self._abandon_expired(time.perf_counter())
            self._start_threads()

    def wait(self, keys: list[int]) -> dict[int, Outcome]:
        with self._cond:
            while True:
                now = time.perf_counter()
                self._abandon_expired(now)
                self._start_threads()
                if all(key in self._outcomes for key in keys):
                    return {key: self._outcomes[key] for key in keys}
                assert self._pending or self._running, "waiting for samples that were never submitted"
                self._cond.wait(timeout=self._next_deadline(now))

    def _next_deadline(self, now: float) -> float | None:
        starts = [task.start for task in self._running.values() if task.start is not None]
        if self.timeout_s is None or not starts:
            return None
        return max(0.0, min(starts) + self.timeout_s - now)

    def _abandon_expired(self, now: float) -> None:
        if self.timeout_s is None:
            return
        for task in list(self._running.values()):
            if task.start is not None and now - task.start >= self.timeout_s:
                task.abandoned = True
                del self._running[task.key]
                self._outcomes[task.key] = Outcome(timed_out=True, busy_s=now - task.start)
                self._num_threads -= 1  # its thread is left behind; a new one takes the slot
                if task.process is not None:
                    task.process.kill()

    def _start_threads(self) -> None:
        while self._pending and self._num_threads < self.num_workers:
            threading.Thread(target=self._work, name="hybridrl-reward", daemon=True).start()
            self._num_threads += 1

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._pending:
                    self._num_threads -= 1
                    return
                task = self._pending.popleft()
                self._running[task.key] = task
            outcome = self._call_in_process(task) if self._processes else self._call_here(task)
            with self._cond:
                if task.abandoned:  # timed out: its result is dropped and this thread retires
                    return
                del self._running[task.key]
                self._outcomes[task.key] = outcome
                self._cond.notify_all()

    def _mark_started(self, task: _Task, process: _WorkerProcess | None = None) -> float:
        with self._cond:
            task.process = process
            task.start = time.perf_counter()
            self._cond.notify_all()  # a waiter may now have a deadline to sleep until
            return task.start

    def _call_here(self, task: _Task) -> Outcome:
        start = self._mark_started(task)
        try:
            value = call_component(self.component, task.batch)
        except Exception as exc:
            return Outcome(error=exc, busy_s=time.perf_counter() - start)
        return Outcome(value=value, busy_s=time.perf_counter() - start)

    def _call_in_process(self, task: _Task) -> Outcome:
        try:
            process = self._processes.borrow()
        except Exception as exc:  # the component could not be sent to a fresh process
            return Outcome(error=RewardError(
                f"could not start a reward worker process ({type(exc).__name__}: {exc}); use_processes=True "
                "needs a reward function defined at module level of an importable module (no lambdas or "
                "closures)"))
        start = self._mark_started(task, process)
        try:
            status, payload, where = process.call(task.batch)
        except (EOFError, OSError):
            process.release()
            if task.abandoned:  # killed by _abandon_expired
                return Outcome(timed_out=True)
            return Outcome(error=RuntimeError(f"the reward worker process died (exit code {process.exitcode})"),
                           busy_s=time.perf_counter() - start)
        self._processes.give_back(process)
        busy_s = time.perf_counter() - start
        if status == "error":
            return Outcome(error=payload, where=where, busy_s=busy_s)
        return Outcome(value=payload, busy_s=busy_s)


def _process_main(conn, component: RewardComponent) -> None:
    """A worker process: answers one-sample batches with ("ok", value, None) or ("error", exc, site)."""
    conn.send("ready")
    while True:
        try:
            batch = conn.recv()
        except EOFError:
            return
        try:
            reply = ("ok", call_component(component, batch), None)
        except Exception as exc:
            reply = ("error", exc, raise_site(exc))
        try:
            conn.send(reply)
        except Exception as exc:  # the value or the exception does not pickle
            conn.send(("error", RuntimeError(f"could not send the result back from the worker: {exc!r}"), None))


class _WorkerProcess:
    """One spawned daemon process holding the component; `call` blocks until it answers."""

    def __init__(self, component: RewardComponent):
        ctx = multiprocessing.get_context("spawn")  # fork is unsafe in a process running threads / CUDA
        self._conn, child_conn = ctx.Pipe()
        self._process = ctx.Process(target=_process_main, args=(child_conn, component), daemon=True)
        self._process.start()
        child_conn.close()
        if self._conn.recv() != "ready":  # wait out interpreter start-up, so it never eats a deadline
            raise RuntimeError("reward worker process failed to start")

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode

    def call(self, batch: Batch) -> tuple[str, Any, str | None]:
        self._conn.send(batch)
        return self._conn.recv()

    def kill(self) -> None:
        """Stops the process at once; the thread blocked in `call` then gets EOFError."""
        self._process.kill()

    def release(self) -> None:
        """Frees the pipe and reaps the process once it is dead (called by the thread that used it)."""
        self._conn.close()
        self._process.join(timeout=1.0)


class ProcessWorkers:
    """Idle worker processes for one component, reused across calls; killed ones are not returned."""

    def __init__(self, component: RewardComponent):
        self._component = component
        self._idle: list[_WorkerProcess] = []
        self._lock = threading.Lock()

    def borrow(self) -> _WorkerProcess:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _WorkerProcess(self._component)

    def give_back(self, process: _WorkerProcess) -> None:
        with self._lock:
            self._idle.append(process)

    def close(self) -> None:
        with self._lock:
            for process in self._idle:
                process.kill()
                process.release()
            self._idle.clear()
