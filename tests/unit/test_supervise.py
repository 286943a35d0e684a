"""The supervisor's half of the control channel (pyzipmoe.runtime.supervise): the memory monitor, unchanged,
driving a cache in another process through the control file. The native half (zipmoe-control.cpp) reads the same
words; tests/system/test_pressure.py runs both with llama-server."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pyzipmoe.runtime import cache_control, controller, memory, supervise
from pyzipmoe.runtime.config import DEFAULT_POLICY

MiB = 1 << 20


def test_a_new_budget_reaches_the_control_file_as_the_runtime_s_own_split(zipmoe_model: Path) -> None:
    from pyzipmoe._native import ffi, lib
    from pyzipmoe.runtime.budget import Budget, model_memory

    need = model_memory(zipmoe_model)
    ctl = supervise.ControlFile.create()
    try:
        words = np.frombuffer(Path(ctl.path).read_bytes(), dtype="<u8")
        assert words[supervise.W_MAGIC] == int.from_bytes(b"ZMCTL001", "little")
        remote = supervise.RemoteRuntime(ctl)
        # the program reports every expert decoded
        ctl.set(supervise.W_RESIDENT, need.expert_bytes)
        ctl.set(supervise.W_POLLS, 1)
        assert ctl.reporting
        room = {"bytes": need.whole + 64 * MiB}

        def read() -> memory.MemoryReading:  # a 1 GiB machine (margin: the floor)
            return memory.MemoryReading(total=1 << 30, available=room["bytes"] - need.expert_bytes, rss=0)

        mon = controller.monitor_for(zipmoe_model, Budget(need.whole, "auto"), read=read, lib=remote,
                                     split=(None, None, 0.0), interval=3600, events=False)
        assert not mon.step() and mon.budget == need.whole  # nothing changed
        room["bytes"] = need.minimum + need.expert_bytes // 2 + memory.MIN_MARGIN
        assert mon.step()
        target = need.minimum + need.expert_bytes // 2
        assert mon.budget == target
        seq = ctl.value(supervise.W_SEQ)
        assert seq > 0 and seq % 2 == 0  # complete
        # what the program will apply is zipmoe_budget_split_tiers' split of the new tiers
        sizes = cache_control.store_sizes(zipmoe_model)
        out = ffi.new("zipmoe_budget_split *")
        hot = cache_control.default_hot_share(target - need.minimum, sizes, cache_control.warm_decodes_fast(zipmoe_model))
        assert lib.zipmoe_budget_split_tiers(cache_control._store_sizes_struct(sizes), len(sizes),
                                             target - need.minimum, hot, 0.0, out) == 0
        got = [ctl.value(w) for w in (supervise.W_HOT, supervise.W_WARM, supervise.W_SM, supervise.W_IN_FLIGHT,
                                            supervise.W_READS, supervise.W_TOKEN_HOT)]
        assert got == [out.hot, out.warm, out.sm, out.in_flight, out.reads, out.token_hot]
        assert ctl.value(supervise.W_POLICY) == cache_control.policy_id(DEFAULT_POLICY)
        # the floor: less room than the minimum, twice
        room["bytes"] = need.minimum // 2
        mon.step()
        assert mon.floor is None
        mon.step()
        assert mon.floor is not None and "out of memory" in mon.floor and "\n" not in mon.floor
    finally:
        ctl.close()
    assert not Path(ctl.path).exists()


# ------------------------------------------------------------------------ the control file's own failures


def test_a_full_folder_refuses_the_control_file_instead_of_a_sparse_one(tmp_path: Path, monkeypatch) -> None:
    """Where the pages cannot be allocated (a full /dev/shm), create says so and leaves nothing; the old code made
    a sparse file with ftruncate, and its first store through the mapping killed the supervisor with SIGBUS (the
    real thing, a tiny tmpfs over /dev/shm: tests/system/test_pressure.py)."""
    import errno
    import os

    import pytest

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(supervise.ControlFileError, match="no room for the control file") as e:
        supervise.ControlFile.create(tmp_path)
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_a_truncated_control_file_costs_a_warning_not_a_signal(tmp_path: Path) -> None:
    """Someone truncates the file while the supervisor uses it: the supervisor reads zeros and says so once (the old
    code read it through a mapping: SIGBUS). In a child process, so that the old code's signal fails the test
    rather than killing pytest."""
    import subprocess
    import sys

    script = f"""
import os
from pathlib import Path
from pyzipmoe.runtime import supervise
ctl = supervise.ControlFile.create(Path({str(tmp_path)!r}))
ctl.set(supervise.W_POLLS, 7)
assert ctl.value(supervise.W_POLLS) == 7
os.truncate(ctl.path, 0)
print(ctl.value(supervise.W_POLLS), ctl.value(supervise.W_RESIDENT), ctl.reporting)
ctl.close()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "0", "False"]
    warnings = [ln for ln in done.stderr.splitlines() if "changed under the supervisor" in ln]
    assert len(warnings) == 1, done.stderr


def test_stale_control_files_of_dead_supervisors_are_removed_at_the_next_start(tmp_path: Path) -> None:
    import os
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs (reaped)
    stale = tmp_path / f"{supervise.CONTROL_PREFIX}{dead.pid}-abc123"
    live = tmp_path / f"{supervise.CONTROL_PREFIX}{os.getppid()}-def456"  # pytest's parent runs
    other = tmp_path / "zipmoe-control-notapid"
    for p in (stale, live, other):
        p.write_bytes(bytes(supervise.CONTROL_BYTES))
    ctl = supervise.ControlFile.create(tmp_path)
    try:
        assert not stale.exists()
        assert live.exists() and other.exists()
        assert ctl.path.parent == tmp_path and ctl.path.name.startswith(f"{supervise.CONTROL_PREFIX}{os.getpid()}-")
        assert ctl.path.stat().st_mode & 0o777 == 0o600
        assert ctl.path.stat().st_blocks > 0  # allocated, not sparse
    finally:
        ctl.close()


def test_a_program_dies_with_its_supervisor_even_by_sigkill(tmp_path: Path) -> None:
    """A supervisor that starts a program with die_with_parent and is then killed with SIGKILL (no handler runs)
    leaves no program behind: within a second the program is gone (the old code started it plainly, and it ran on)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child"
    script = f"""
import subprocess, sys
from pyzipmoe.runtime import lifetime
proc = subprocess.Popen(["sleep", "300"], preexec_fn=lifetime.die_with_parent())
open({str(pid_file)!r}, "w").write(str(proc.pid))
proc.wait()
"""
    parent = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.05)
    child = int(pid_file.read_text())
    try:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        time.sleep(1.0)
        assert not _running(child), "the program outlived its supervisor"
    finally:
        if _running(child):
            os.kill(child, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether pid runs (a zombie that nobody reaped yet does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False
