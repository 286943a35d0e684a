"""Supervising a llama.cpp program (llama-cli for `zipmoe run`, llama-server for `zipmoe serve`) under a memory
budget, as pyzipmoe.Llama's memory monitor supervises a model in its own process.

The program's cache lives in another process, so the monitor (controller.MemoryMonitor, unchanged: the same
`auto` formula, hysteresis and floor) talks to it through a control file (ZIPMOE_CONTROL) instead of the native
library: `RemoteRuntime` stands in for the library, as far as the monitor uses it. A new budget is split here with
the library's zipmoe_budget_split_tiers (cache_control.apply_shares, as for pyzipmoe.Llama) and written to the file; the
program's glue (ggml_zipmoe/src/op/zipmoe-control.cpp) applies it with zipmoe_cache_apply_split where its next graph
begins (or within 20 ms, between graphs), and writes back what its runtime holds, which the monitor counts as the
model's. The file's layout is CONTROL_WORDS 64-bit words, described in zipmoe-control.cpp.

At the floor (even the model's minimum no longer fits), the program is stopped with SIGTERM and the command
fails with one line and exit status 3 (OutOfMemoryError), instead of the kernel's OOM killer killing it.
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import OutOfMemoryError, ZipmoeError
from .config import BUDGET_ENV, CONTROL_ENV, split_shares

CONTROL_WORDS = 16
CONTROL_MAGIC = int.from_bytes(b"ZMCTL001", "little")
(W_MAGIC, W_SEQ, W_POLICY, W_HOT, W_WARM, W_SM, W_IN_FLIGHT, W_READS, W_TOKEN_HOT, W_APPLIED, W_RESIDENT,
 W_TRANSIENT, W_CALLS, W_PID, W_POLLS, W_PEAK_RESIDENT) = range(16)
READY_SECONDS = 600.0  # how long the supervisor waits for the program's first report (a large model's load)


class ControlFile:
    """The shared words: made by the supervisor, mapped by both sides."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, CONTROL_WORDS * 8)
            self._map = mmap.mmap(fd, CONTROL_WORDS * 8, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.words = np.frombuffer(self._map, dtype="<u8")  # one aligned 8-byte store per word
        self.words[W_MAGIC] = CONTROL_MAGIC

    @classmethod
    def create(cls) -> ControlFile:
        folder = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
        return cls(folder / f"zipmoe-control-{os.getpid()}-{time.monotonic_ns()}")

    def publish(self, split: Any, policy: int) -> None:
        """A split (zipmoe_budget_split) for the program to apply; a seqlock keeps it whole."""
        seq = int(self.words[W_SEQ])
        self.words[W_SEQ] = seq + 1 if seq % 2 == 0 else seq + 2  # odd: being written
        for w, value in ((W_POLICY, policy), (W_HOT, split.hot), (W_WARM, split.warm), (W_SM, split.sm),
                         (W_IN_FLIGHT, split.in_flight), (W_READS, split.reads), (W_TOKEN_HOT, split.token_hot)):
            self.words[w] = int(value)
        self.words[W_SEQ] = int(self.words[W_SEQ]) + 1  # even: complete

    @property
    def reporting(self) -> bool:
        """Whether the program has written what its runtime holds at least once."""
        return int(self.words[W_POLLS]) > 0

    def value(self, w: int) -> int:
        return int(self.words[w])

    def close(self) -> None:
        del self.words
        self._map.close()
        try:
            self.path.unlink()
        except OSError:
            pass


class RemoteRuntime:
    """What the memory monitor calls of the native library, for a cache in another process: its statistics from
    the control file, a new split written to it. Slots (a planner's plans) are not sent: a supervised program
    adapts by shares."""

    def __init__(self, ctl: ControlFile) -> None:
        self.ctl = ctl
        self.applied: list[tuple[int, int]] = []  # (hot, token_hot) of each split published, for reports

    def zipmoe_stats_get(self, s: Any) -> None:
        c = self.ctl
        s.hot_bytes, s.warm_bytes, s.sm_bytes, s.decoding_bytes = c.value(W_RESIDENT), 0, 0, 0
        s.pool_bytes, s.staging_transient_bytes = 0, c.value(W_TRANSIENT)
        s.materialize_calls = c.value(W_CALLS)
        s.peak_resident_bytes = c.value(W_PEAK_RESIDENT)

    def zipmoe_cache_apply_split(self, split: Any, policy: int) -> int:
        self.ctl.publish(split, policy)
        self.applied.append((int(split.hot), int(split.token_hot)))
        return 0


def supervised(env: Mapping[str, str], model: str, budget: str | int | None) -> bool:
    """Whether a program started with `env` on `model` runs under the supervisor: a zipmoe model with a budget."""
    from .llama import is_zipmoe_file

    return budget is not None and BUDGET_ENV in env and bool(is_zipmoe_file(model))


def run_program(argv: Sequence[str], env: Mapping[str, str], *, model: str, budget: str | int | None,
                policy: str | None = None, hot_share: float | None = None, sm_share: float | None = None,
                interval: float = 0.5, report: dict[str, Any] | None = None) -> int:
    """Runs a llama.cpp program attached to this terminal (runner.run_foreground), its cache's budget following the
    memory available when `supervised`; its exit status. OutOfMemoryError at the floor. `report` (if given)
    receives the monitor's budgets over time: a list of (seconds, budget, resident bytes)."""
    from .runner import run_foreground

    if not supervised(env, model, budget):
        return run_foreground(argv, env)
    from .controller import monitor_for

    ctl = ControlFile.create()
    remote = RemoteRuntime(ctl)
    stopped: dict[str, str] = {}
    proc_box: dict[str, subprocess.Popen[Any]] = {}

    def on_floor(message: str) -> None:
        stopped["why"] = message
        proc = proc_box.get("proc")
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    box: dict[str, Any] = {}

    def on_change(_plan: Any) -> None:  # one line a re-plan, for the user's log (and the tests)
        m = box["monitor"]
        print(f"zipmoe: memory budget now {m.budget / 2**20:.0f} MiB (the memory available changed; the cache "
              f"holds {ctl.value(W_RESIDENT) / 2**20:.0f} MiB)", file=sys.stderr, flush=True)

    try:
        monitor = monitor_for(model, budget, split=split_shares(hot_share, sm_share), policy=policy,
                              loaded=int(env[BUDGET_ENV]), lib=remote, on_floor=on_floor, interval=interval,
                              on_change=on_change)
        box["monitor"] = monitor
    except ZipmoeError:
        ctl.close()
        raise
    done = threading.Event()

    def start_monitor(proc: subprocess.Popen[Any]) -> None:
        proc_box["proc"] = proc
        deadline = time.monotonic() + READY_SECONDS
        while not ctl.reporting:  # (before its first report, the program's cache would count as others' memory)
            if done.wait(0.05) or proc.poll() is not None or time.monotonic() > deadline:
                return
        monitor.start()
        if report is not None:
            t0 = time.monotonic()
            series = report.setdefault("series", [])
            while not done.wait(interval):
                series.append((time.monotonic() - t0, monitor.budget, ctl.value(W_RESIDENT)))

    watcher: list[threading.Thread] = []

    def on_start(proc: subprocess.Popen[Any]) -> None:
        t = threading.Thread(target=start_monitor, args=(proc,), name="zipmoe-supervisor", daemon=True)
        t.start()
        watcher.append(t)

    try:
        rc = run_foreground(argv, {**env, CONTROL_ENV: str(ctl.path)}, on_start=on_start)
    finally:
        done.set()
        for t in watcher:
            t.join(5)
        monitor.stop()
        if report is not None:
            report.update(replans=[b for b, _ in monitor.replans], signals=list(monitor.signals),
                          wakeups=monitor.wakeups, floor=monitor.floor)
        ctl.close()
    if "why" in stopped:
        raise OutOfMemoryError(stopped["why"])
    return rc


__all__ = ["ControlFile", "RemoteRuntime", "run_program", "supervised"]

if __name__ == "__main__":  # pragma: no cover
    print(__doc__, file=sys.stderr)
