"""Supervising a llama.cpp program (llama-cli for `zipmoe run`, llama-server for `zipmoe serve`) under a memory
budget, as pyzipmoe.Llama's memory monitor supervises a model in its own process.

The program's cache lives in another process, so the monitor (controller.MemoryMonitor, unchanged: the same
`auto` formula, hysteresis and floor) talks to it through a control file (ZIPMOE_CONTROL) instead of the native
library: `RemoteRuntime` stands in for the library, as far as the monitor uses it. A new budget is split here with
the library's zipmoe_budget_split_tiers (cache_control.apply_shares, as for pyzipmoe.Llama) and written to the file; the
program's glue (ggml_zipmoe/src/op/zipmoe-control.cpp) applies it with zipmoe_cache_apply_split where its next graph
begins (or within 20 ms, between graphs), and writes back what its runtime holds, which the monitor counts as the
model's. The file's layout is CONTROL_WORDS 64-bit words, described in zipmoe-control.cpp.

The file's pages are allocated before either side uses them, and this side reads and writes it with pread/pwrite
(ControlFile): where they cannot be allocated (a full /dev/shm), the program runs with its budget fixed and one
warning says so. A file a killed supervisor left behind is removed when the next one starts (remove_stale); the
program itself dies with the supervisor (lifetime.die_with_parent, which runner.run_foreground starts it with).

At the floor (even the model's minimum no longer fits), the program is stopped with SIGTERM and the command
fails with one line and exit status 3 (OutOfMemoryError), instead of the kernel's OOM killer killing it.
"""

from __future__ import annotations

import errno
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import OutOfMemoryError, ZipmoeError
from .budget import Budget
from .config import CONTROL_ENV, split_shares

CONTROL_WORDS = 16
CONTROL_BYTES = CONTROL_WORDS * 8
CONTROL_MAGIC = int.from_bytes(b"ZMCTL001", "little")
CONTROL_PREFIX = "zipmoe-control-"  # then the supervisor's pid, "-" and mkstemp's random letters
(W_MAGIC, W_SEQ, W_POLICY, W_HOT, W_WARM, W_SM, W_IN_FLIGHT, W_READS, W_TOKEN_HOT, W_APPLIED, W_RESIDENT,
 W_TRANSIENT, W_CALLS, W_PID, W_POLLS, W_PEAK_RESIDENT) = range(16)
READY_SECONDS = 600.0  # how long the supervisor waits for the program's first report (a large model's load)


class ControlFileError(ZipmoeError):
    """The control file could not be made (a full /dev/shm): the program then runs with a fixed budget."""


def control_folder() -> Path:
    """Where control files go: /dev/shm (memory, never written back to a disk), else the temporary directory."""
    return Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def remove_stale(folder: Path) -> list[Path]:
    """Removes the control files in `folder` that supervisors of this user left when they were killed (their pid,
    in the name, no longer runs); the files removed. Another user's files, and a live process's, are left."""
    removed = []
    try:
        names = [n for n in os.listdir(folder) if n.startswith(CONTROL_PREFIX)]
    except OSError:
        return removed
    for name in names:
        pid_text = name[len(CONTROL_PREFIX):].split("-", 1)[0]
        path = folder / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not pid_text.isdigit() or st.st_uid != os.getuid() or not (st.st_mode & 0o170000 == 0o100000):
            continue
        if int(pid_text) != os.getpid() and not _alive(int(pid_text)):
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed


class ControlFile:
    """The shared words, made by the supervisor. Its pages are allocated before anything uses them (posix_fallocate,
    then the whole file written): a full tmpfs fails here, with ControlFileError, instead of killing a process that
    maps the file with SIGBUS later. This side reads and writes it with pread and pwrite, never through a mapping,
    so a file truncated or replaced under it costs a warning, not a signal."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd
        self._broken = False

    @classmethod
    def create(cls, folder: Path | None = None) -> ControlFile:
        """A new control file in `folder` (default control_folder()), after removing stale ones."""
        folder = control_folder() if folder is None else folder
        remove_stale(folder)
        try:
            fd, name = tempfile.mkstemp(prefix=f"{CONTROL_PREFIX}{os.getpid()}-", dir=folder)
        except OSError as e:
            raise ControlFileError(f"cannot make a control file in {folder}: {e.strerror or e}") from None
        try:
            try:
                os.posix_fallocate(fd, 0, CONTROL_BYTES)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise  # (a filesystem without fallocate allocates the pages as they are written, next)
            words = [0] * CONTROL_WORDS
            words[W_MAGIC] = CONTROL_MAGIC
            if os.pwrite(fd, struct.pack(f"<{CONTROL_WORDS}Q", *words), 0) != CONTROL_BYTES:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            os.close(fd)
            Path(name).unlink(missing_ok=True)
            raise ControlFileError(f"no room for the control file in {folder} ({e.strerror or e})") from None
        return cls(Path(name), fd)

    def _read(self, w: int, n: int = 1) -> tuple[int, ...]:
        """Words w..w+n-1; read until two reads agree (a pread may copy a word while the program stores it)."""
        prev = None
        for _ in range(8):
            data = os.pread(self._fd, 8 * n, 8 * w)
            if len(data) < 8 * n:  # truncated under us: what is missing reads as 0
                self._warn_broken("it was truncated")
                data = data.ljust(8 * n, b"\0")
            if data == prev:
                break
            prev = data
        return struct.unpack(f"<{n}Q", prev)

    def _write(self, w: int, *values: int) -> None:
        data = struct.pack(f"<{len(values)}Q", *values)
        try:
            if os.pwrite(self._fd, data, 8 * w) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            raise ZipmoeError(f"cannot write the control file {self.path}: {e.strerror or e}") from None

    def _warn_broken(self, why: str) -> None:
        if not self._broken:
            self._broken = True
            print(f"zipmoe: warning: the control file {self.path} changed under the supervisor ({why}); the "
                  "program's budget may stay where it is", file=sys.stderr, flush=True)

    def publish(self, split: Any, policy: int) -> None:
        """A split (zipmoe_budget_split) for the program to apply; a seqlock keeps it whole."""
        seq = self.value(W_SEQ)
        odd = seq + 1 if seq % 2 == 0 else seq + 2  # odd: being written
        self._write(W_SEQ, odd)
        self._write(W_POLICY, int(policy), int(split.hot), int(split.warm), int(split.sm), int(split.in_flight),
                    int(split.reads), int(split.token_hot))
        self._write(W_SEQ, odd + 1)  # even: complete

    @property
    def reporting(self) -> bool:
        """Whether the program has written what its runtime holds at least once."""
        return self.value(W_POLLS) > 0

    def value(self, w: int) -> int:
        return self._read(w)[0]

    def set(self, w: int, value: int) -> None:
        """Writes one word (the program's side, for tests)."""
        self._write(w, value)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
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
        resident, transient, calls = self.ctl._read(W_RESIDENT, 3)
        s.hot_bytes, s.warm_bytes, s.sm_bytes, s.decoding_bytes = resident, 0, 0, 0
        s.pool_bytes, s.staging_transient_bytes = 0, transient
        s.materialize_calls = calls
        s.peak_resident_bytes = self.ctl.value(W_PEAK_RESIDENT)

    def zipmoe_cache_apply_split(self, split: Any, policy: int) -> int:
        self.ctl.publish(split, policy)
        self.applied.append((int(split.hot), int(split.token_hot)))
        return 0


def supervised(model: str, budget: Budget | None) -> bool:
    """Whether a program on `model` runs under the supervisor: a zipmoe model with a budget."""
    from .llama import is_zipmoe_file

    return budget is not None and bool(is_zipmoe_file(model))


def run_program(argv: Sequence[str], env: Mapping[str, str], *, model: str, budget: Budget | None,
                policy: str | None = None, hot_share: float | None = None, sm_share: float | None = None,
                interval: float = 0.5, report: dict[str, Any] | None = None) -> int:
    """Runs a llama.cpp program attached to this terminal (runner.run_foreground), its cache's budget following the
    memory available when `supervised`; its exit status. budget: the one the program's environment gives it
    (controller.runtime_settings). OutOfMemoryError at the floor. `report` (if given)
    receives the monitor's budgets over time: a list of (seconds, budget, resident bytes)."""
    from .runner import run_foreground

    if budget is None or not supervised(model, budget):
        return run_foreground(argv, env)
    from .controller import monitor_for

    try:
        ctl = ControlFile.create()
    except ControlFileError as e:
        print(f"zipmoe: warning: {e}: the memory budget stays fixed at {budget.nbytes / 2**20:.0f} MiB for "
              "this run, whatever the memory available does", file=sys.stderr, flush=True)
        return run_foreground(argv, env)
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
                              lib=remote, on_floor=on_floor, interval=interval,
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


__all__ = ["ControlFile", "ControlFileError", "RemoteRuntime", "remove_stale", "run_program",
           "supervised"]

if __name__ == "__main__":  # pragma: no cover
    print(__doc__, file=sys.stderr)
