"""The kernel's memory signals, so that the memory monitor reads the memory when it is running out, not only every
half second: a neighbour that grows by 100 MB in half a second would otherwise eat through `auto`'s margin before
the next reading.

- cgroup v1: a threshold on memory.usage_in_bytes at the limit less the margin (the kernel signals an eventfd when
  usage crosses it, either way) and memory.pressure_level "medium" (reclaim is under way), both registered through
  cgroup.event_control;
- cgroup v2: a PSI trigger on memory.pressure (some 150 ms stalled in 2 s) and memory.events (the cgroup went over
  memory.high or hit memory.max), polled for POLLPRI;
- outside a cgroup, or where registering is refused (a read-only cgroup filesystem in a container): nothing, and
  the monitor polls (psutil and the cgroup files every interval).

Signals only make the monitor read sooner; what it does is decided by the reading, so a spurious or missed signal
costs at most an interval. The cgroup root and /proc/self are parameters for tests, as in memory.py.
"""

from __future__ import annotations

import os
import select
from pathlib import Path

from ..cgroup import CGROUP_ROOT, PROC_SELF, cgroup_dirs
from .memory import read_int, UNLIMITED_FROM

PSI_TRIGGER = b"some 150000 2000000"  # 150 ms of stalls in a 2 s window (unprivileged triggers need >= 2 s windows)
MIN_WAKE_GAP = 0.05  # seconds: signals closer together than this start one reading


class MemoryEvents:
    """File descriptors the kernel signals when memory runs short; `wait` sleeps until one fires or time is up."""

    def __init__(self) -> None:
        self.kinds: tuple[str, ...] = ()
        self._poll = select.poll()
        self._fds: dict[int, str] = {}  # fd -> how to drain it: "eventfd" or "kernfs"
        self._keep: list[int] = []  # fds that must stay open while their event is registered
        self._stop_r, self._stop_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll.register(self._stop_r, select.POLLIN)
        self._v1_dir: Path | None = None
        self._v1_threshold: tuple[int, int] | None = None  # (eventfd, usage fd) of the usage threshold
        self._v1_at = -1

    # ------------------------------------------------------------------------------------ opening

    @classmethod
    def open(cls, margin: int, *, cgroup_root: Path = CGROUP_ROOT, proc_self: Path = PROC_SELF) -> MemoryEvents:
        """The signals this process's memory cgroup offers (kinds: "v1-threshold", "v1-pressure", "v2-psi",
        "v2-events"); none outside a limited cgroup. Never raises for a missing or refused file."""
        ev = cls()
        version, dirs = cgroup_dirs("memory", cgroup_root=cgroup_root, proc_self=proc_self)
        limited = [d for d in dirs if _limit(d, version) is not None]
        kinds: list[str] = []
        if version == 1 and limited:
            ev._v1_dir = limited[0]
            if ev._v1_rearm(margin):
                kinds.append("v1-threshold")
            if ev._v1_pressure(limited[0]):
                kinds.append("v1-pressure")
        elif version == 2 and limited:
            if ev._v2_psi(limited[0]):
                kinds.append("v2-psi")
            if ev._v2_events(limited[0]):
                kinds.append("v2-events")
        ev.kinds = tuple(kinds)
        return ev

    def _add(self, fd: int, kind: str, mask: int) -> None:
        self._fds[fd] = kind
        self._poll.register(fd, mask)

    def _v1_register(self, d: Path, target: str, arg: str) -> int | None:
        """An eventfd the kernel signals for `target` (memory.usage_in_bytes, memory.pressure_level) with `arg`."""
        efd = tfd = -1
        try:
            efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            tfd = os.open(d / target, os.O_RDONLY | os.O_CLOEXEC)
            with open(d / "cgroup.event_control", "w") as f:
                f.write(f"{efd} {tfd} {arg}")
        except (OSError, AttributeError):
            for fd in (efd, tfd):
                if fd >= 0:
                    os.close(fd)
            return None
        self._add(efd, "eventfd", select.POLLIN)
        self._keep.append(tfd)
        return efd

    def _v1_rearm(self, margin: int) -> bool:
        d = self._v1_dir
        limit = _limit(d, 1) if d is not None else None
        if d is None or limit is None:
            return False
        at = max(0, limit - margin)
        if self._v1_threshold is not None and at == self._v1_at:
            return True
        old = self._v1_threshold
        efd = self._v1_register(d, "memory.usage_in_bytes", str(at))
        if efd is None:
            return False
        if old is not None:  # closing the eventfd unregisters the old threshold
            self._close(old[0])
            self._keep.remove(old[1])
            os.close(old[1])
        self._v1_threshold, self._v1_at = (efd, self._keep[-1]), at
        return True

    def _v1_pressure(self, d: Path) -> bool:
        return self._v1_register(d, "memory.pressure_level", "medium") is not None

    def _v2_psi(self, d: Path) -> bool:
        try:
            fd = os.open(d / "memory.pressure", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            os.write(fd, PSI_TRIGGER + b"\0")
        except OSError:
            os.close(fd)
            return False
        self._add(fd, "psi", select.POLLPRI)
        return True

    def _v2_events(self, d: Path) -> bool:
        try:
            fd = os.open(d / "memory.events", os.O_RDONLY | os.O_CLOEXEC)
            os.read(fd, 4096)  # kernfs signals changes after the file was read once
        except OSError:
            return False
        self._add(fd, "kernfs", select.POLLPRI | select.POLLERR)
        return True

    # ------------------------------------------------------------------------------------ use

    def rearm(self, margin: int) -> None:
        """Moves the v1 usage threshold to the limit less `margin` when either changed (cheap when neither did)."""
        if self._v1_threshold is not None:
            self._v1_rearm(margin)

    def wait(self, timeout: float) -> bool:
        """Sleeps until a signal fires (True), `timeout` seconds pass or `interrupt` is called (False)."""
        try:
            ready = self._poll.poll(max(0, int(timeout * 1000)))
        except InterruptedError:
            return False
        fired = False
        for fd, _mask in ready:
            if fd == self._stop_r:
                return False
            kind = self._fds.get(fd)
            if kind is None:
                continue
            fired = True
            try:
                if kind == "eventfd":
                    os.eventfd_read(fd)
                elif kind == "kernfs":
                    os.lseek(fd, 0, os.SEEK_SET)
                    os.read(fd, 4096)
            except OSError:
                pass
        if fired and self.kinds and "v2-psi" in self.kinds:
            # a PSI trigger stays readable for its window: do not spin on it
            import time

            time.sleep(MIN_WAKE_GAP)
        return fired

    def interrupt(self) -> None:
        try:
            os.write(self._stop_w, b"x")
        except OSError:
            pass

    def _close(self, fd: int) -> None:
        if fd in self._fds:
            self._poll.unregister(fd)
            del self._fds[fd]
        os.close(fd)

    def close(self) -> None:
        for fd in list(self._fds):
            self._close(fd)
        for fd in self._keep:
            try:
                os.close(fd)
            except OSError:
                pass
        self._keep = []
        os.close(self._stop_r)
        os.close(self._stop_w)


def _limit(d: Path, version: int) -> int | None:
    limit = read_int(d / ("memory.limit_in_bytes" if version == 1 else "memory.max"))
    return limit if limit is not None and limit < UNLIMITED_FROM else None
