"""How much memory this process may use: the machine's (psutil) and its container's (cgroup v1 or v2).

`--memory-budget auto` turns a `MemoryReading` into a budget with `auto_budget`. Readings are advisory: a cgroup
file that is missing, unreadable or garbled counts as "no limit there", never as an error, so that zipmoe runs
the same on a laptop, in Docker (v1 or v2) and under systemd.

The cgroup root and /proc/self are parameters (defaults: the real ones) so that tests can point them at a fake
tree; which cgroup directories apply to the process is pyzipmoe.cgroup's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..cgroup import CGROUP_ROOT, PROC_SELF, cgroup_dirs

UNLIMITED_FROM = 1 << 60
"""Limits at or above this are "no limit": cgroup v1 writes an unlimited memory.limit_in_bytes as its largest page
count in bytes (9223372036854771712 with 4 KiB pages), not as a word."""

MIN_MARGIN = 32 << 20
MARGIN_SHARE = 0.03
"""`auto`'s margin: MARGIN_SHARE of the memory limit (the machine's or the container's), at least MIN_MARGIN. It is
room for what the budget does not count and that grows after a reading: llama.cpp's KV cache and compute buffers,
the reader's buffers, allocator slack, and a neighbour's growth until the next reading (or the kernel's signal,
pressure.py) makes the tiers give way. (It was max(10%, 512 MiB): a 600 MB container lost 512 MiB before anything
started.)"""


@dataclass(frozen=True)
class MemoryReading:
    """Bytes, read at one moment. cgroup_* are None outside a memory-limited cgroup."""

    total: int  # the machine's RAM (psutil)
    available: int  # what the kernel could hand out without swapping, page cache included (psutil)
    rss: int  # this process's resident set
    cgroup_limit: int | None = None  # the tightest memory limit of this process's cgroup and its ancestors
    cgroup_usage: int | None = None  # that cgroup's charged memory, page cache included
    cgroup_reclaimable: int | None = None  # its inactive file cache, dropped before the cgroup OOM-kills
    cgroup_file_cache: int | None = None  # all its file cache, active and inactive (not shmem)

    @property
    def limit(self) -> int:
        """The memory this process can ever have: the machine's, or its cgroup's if smaller."""
        return min(self.total, self.cgroup_limit) if self.cgroup_limit is not None else self.total

    @property
    def headroom(self) -> int:
        """What could be allocated now: psutil's available, or less if the cgroup has less left."""
        if self.cgroup_limit is None:
            return self.available
        in_use = (self.cgroup_usage or 0) - (self.cgroup_reclaimable or 0)
        return max(0, min(self.available, self.cgroup_limit - in_use))

    @property
    def headroom_with_file_cache(self) -> int:
        """What could be allocated if the kernel dropped every page of file cache, active ones too: psutil's
        available (which counts them already), or less if the cgroup has less. Unlike `headroom` it does not move
        when the kernel moves pages between its active and inactive lists, which it does all the time in a cgroup
        at its limit."""
        if self.cgroup_limit is None:
            return self.available
        file_cache = self.cgroup_file_cache if self.cgroup_file_cache is not None else self.cgroup_reclaimable or 0
        return max(0, min(self.available, self.cgroup_limit - ((self.cgroup_usage or 0) - file_cache)))


@dataclass(frozen=True)
class CgroupMemory:
    """The limit that binds, from the cgroup directory (`path`) with the least room left."""

    path: Path
    limit: int
    usage: int
    reclaimable: int
    file_cache: int = 0  # active and inactive file cache


# ----------------------------------------------------------------------------------------- cgroup files


def own_cgroup_dir(controller: str = "memory", *, cgroup_root: Path = CGROUP_ROOT,
                   proc_self: Path = PROC_SELF) -> Path | None:
    """This process's own cgroup directory in the v1 hierarchy of `controller` (memory, blkio, ...), where a
    benchmark or a test makes child cgroups; None when the controller has no v1 hierarchy here.

    In a container without a cgroup namespace it is the innermost directory that exists (see `_inward_out`)."""
    version, dirs = cgroup_dirs(controller, cgroup_root=cgroup_root, proc_self=proc_self)
    return dirs[0] if version == 1 and dirs else None


# argv prefix that moves its own shell into the cgroup whose cgroup.procs follows it, then becomes the command (the
# same pid: a parent's wait4 rusage is the command's): [*JOIN_AND_EXEC, procs_file, *argv]
JOIN_AND_EXEC = ("/bin/sh", "-c", 'echo $$ > "$0" || exit 125; exec "$@"')


def make_memory_cgroup(path: Path, limit: int | None) -> Path:
    """Makes the v1 memory cgroup `path` (its parent must be one) limited to `limit` bytes of memory and of
    memory+swap where the kernel counts swap (None: no limit). OSError if it cannot; nothing is left behind."""
    path.mkdir()
    try:
        if limit is not None:
            (path / "memory.limit_in_bytes").write_text(str(limit))
            memsw = path / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # no swap either (memsw >= limit, so after it)
                memsw.write_text(str(limit))
    except OSError:
        remove_cgroup(path)
        raise
    return path


def remove_cgroup(path: Path, tries: int = 50) -> bool:
    """Removes an empty cgroup directory, waiting up to tries x 0.1 s for its last task to leave; whether it is gone."""
    import time

    for _ in range(tries):
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.1)  # the last task may take a moment to leave
    return False


def read_int(path: Path) -> int | None:
    """A file holding one integer; None if missing, unreadable, "max" or garbled."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def read_stats(path: Path) -> dict[str, int]:
    """The "key value" lines of a memory.stat-like file whose value is an integer; empty if unreadable."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    stats = {}
    for line in lines:
        name, _, value = line.partition(" ")
        try:
            stats[name] = int(value)
        except ValueError:
            continue
    return stats


_FILES = {  # version -> (limit file, usage file, memory.stat keys of the inactive and of the active file cache,
    # first found wins); v1's usage covers the cgroup's descendants, and so do its total_ keys
    1: ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_inactive_file", "inactive_file"),
        ("total_active_file", "active_file")),
    2: ("memory.max", "memory.current", ("inactive_file",), ("active_file",)),
}


def cgroup_memory(*, cgroup_root: Path = CGROUP_ROOT, proc_self: Path = PROC_SELF) -> CgroupMemory | None:
    """The binding memory limit of this process's cgroup hierarchy, or None when nothing limits it.

    Each ancestor's limit applies too (a container's limit sits on a parent of the process's cgroup), so every
    directory from the process's up to the root is read and the one with the least room left wins."""
    version, dirs = cgroup_dirs("memory", cgroup_root=cgroup_root, proc_self=proc_self)
    if not version:
        return None
    limit_file, usage_file, inactive_keys, active_keys = _FILES[version]
    best: CgroupMemory | None = None
    for d in dirs:
        limit = read_int(d / limit_file)  # v2's "max" reads as None: no limit
        if limit is None or limit >= UNLIMITED_FROM:
            continue
        usage = read_int(d / usage_file) or 0
        stats = read_stats(d / "memory.stat")  # once: a monitor reads every directory twice a second
        reclaimable = min(next((stats[k] for k in inactive_keys if k in stats), 0), usage)
        active = next((stats[k] for k in active_keys if k in stats), 0)
        here = CgroupMemory(d, limit, usage, reclaimable, min(usage, reclaimable + active))
        if best is None or _room(here) < _room(best):
            best = here
    return best


def _room(c: CgroupMemory) -> int:
    return c.limit - (c.usage - c.reclaimable)


# ----------------------------------------------------------------------------------------- readings


def read_memory(*, cgroup_root: Path = CGROUP_ROOT, proc_self: Path = PROC_SELF) -> MemoryReading:
    """The machine's memory, this process's RSS and its cgroup's limit, now."""
    import psutil

    vm = psutil.virtual_memory()
    cg = cgroup_memory(cgroup_root=cgroup_root, proc_self=proc_self)
    return MemoryReading(
        total=int(vm.total), available=int(vm.available), rss=int(psutil.Process().memory_info().rss),
        cgroup_limit=cg.limit if cg else None, cgroup_usage=cg.usage if cg else None,
        cgroup_reclaimable=cg.reclaimable if cg else None, cgroup_file_cache=cg.file_cache if cg else None,
    )


def safety_margin(reading: MemoryReading) -> int:
    """What `auto_budget` leaves free: MARGIN_SHARE (3%) of the memory limit, at least MIN_MARGIN (32 MiB)."""
    return max(int(reading.limit * MARGIN_SHARE), MIN_MARGIN)


def model_room(reading: MemoryReading, held: int = 0) -> int:
    """What this model could hold now: what could be allocated if the kernel dropped the file cache
    (`headroom_with_file_cache`) plus what the runtime already holds (`held`: pyzipmoe.runtime.controller's
    resident_bytes, its tiers, experts in flight, kept pages and read buffers, all anonymous or memfd memory,
    charged as used). The model's weights that are not experts are mapped file pages: counted in the file cache,
    so not added again."""
    return max(0, held) + reading.headroom_with_file_cache


def auto_budget(reading: MemoryReading, model_bytes: int | None = None, held: int = 0) -> int:
    """The budget of `--memory-budget auto`, what this model may use: never negative,

        auto = min(model_bytes, available + held - margin)
        available = min(psutil's available, cgroup limit - (cgroup usage - its file cache))   (tightest ancestor)
        margin = max(3% of the limit, 32 MiB)          limit: the machine's RAM, or the cgroup's limit if smaller

    computed the same way at load (held: what the runtime holds already, 0 for a process's first model) and at
    every reading of the memory monitor (held: the runtime's resident bytes then), so that a reading after the
    load does not count the model's own cache as memory others took. The cgroup's usage counts page cache; its
    file cache, active and inactive, is dropped before the cgroup OOM-kills (the model's mapped weights among it,
    which the budget holds), so it is room; it does not move when the kernel moves pages between its lists.
    Memory of the process that is not the runtime's (Python, llama.cpp's buffers) stays counted as used.

    The margin (safety_margin) is for what the budget does not count and that grows after this reading. A caller
    that knows of other memory it will need (say the KV cache of a long context) subtracts it itself.

    model_bytes: the model's whole budget (every expert decoded); the budget never exceeds it.
    """
    budget = max(0, model_room(reading, held) - safety_margin(reading))
    if model_bytes is not None:
        budget = min(budget, max(0, model_bytes))
    return budget
