"""Where this process's cgroups are: its membership (/proc/self/cgroup), the v1 hierarchy of a controller or the v2
one, and the directories whose limits apply to it. What they limit is read by its users: memory
(pyzipmoe.runtime.memory, pyzipmoe.runtime.pressure) and CPU (pyzipmoe.plan.calibration), which is why this sits
below both.

The cgroup root and /proc/self are parameters (defaults: the real ones) so that tests can point them at a fake
tree.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF = Path("/proc/self")


def cgroup_membership(proc_self: Path = PROC_SELF) -> dict[str, str]:
    """controller -> path from /proc/self/cgroup ("4:memory:/a/b" gives {"memory": "/a/b"}); the v2 line
    ("0::/a/b") is under "". Empty when the file is missing (not Linux, or no /proc)."""
    try:
        text = (proc_self / "cgroup").read_text()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for name in controllers.split(",") if controllers else [""]:
            out[name] = path
    return out


def v1_mount(controller: str, cgroup_root: Path = CGROUP_ROOT) -> Path | None:
    """The v1 hierarchy of `controller`: /sys/fs/cgroup/memory, or a joint one such as cpu,cpuacct."""
    if (cgroup_root / controller).is_dir():
        return cgroup_root / controller
    try:
        joint = [d for d in cgroup_root.iterdir() if d.is_dir() and controller in d.name.split(",")]
    except OSError:
        return None
    return joint[0] if joint else None


def _v2_mount(cgroup_root: Path) -> Path | None:
    """The v2 hierarchy: the cgroup root itself (unified mode) or its `unified` directory (hybrid mode)."""
    for d in (cgroup_root, cgroup_root / "unified"):
        if (d / "cgroup.controllers").is_file():
            return d
    return None


def _inward_out(mount: Path, path: str) -> Iterator[Path]:
    """The directories of cgroup `path` under `mount` and of its ancestors, innermost first, the mount last.

    Directories that do not exist are skipped: in a container without a cgroup namespace, /proc/self/cgroup names
    the host's path (/docker/<id>) while the container sees its own cgroup mounted at the root."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    for n in range(len(parts), -1, -1):
        d = mount.joinpath(*parts[:n])
        if d.is_dir():
            yield d


def cgroup_dirs(controller: str, *, cgroup_root: Path = CGROUP_ROOT,
                proc_self: Path = PROC_SELF) -> tuple[int, list[Path]]:
    """(cgroup version, the directories whose limits apply to this process for `controller`, innermost first).

    A v1 hierarchy of the controller wins over v2 (in hybrid mode the controllers live on v1); (0, []) when
    neither is there."""
    member = cgroup_membership(proc_self)
    if controller in member and (mount := v1_mount(controller, cgroup_root)) is not None:
        return 1, list(_inward_out(mount, member[controller]))
    if "" in member and (mount := _v2_mount(cgroup_root)) is not None:
        return 2, list(_inward_out(mount, member[""]))
    return 0, []
