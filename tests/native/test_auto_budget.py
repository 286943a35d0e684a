"""`--memory-budget auto` in the native library (ggml_zipmoe/src/common/memory.c), which bare llama.cpp programs use:
the same readings and the same formula as pyzipmoe.runtime.memory, on fake cgroup trees (v1, v2, hybrid, nested
limits, garbled files) and on this machine, and the budget texts the programs' argument check accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyzipmoe._native import ffi as _ffi
from pyzipmoe._native import lib as _lib
from pyzipmoe.runtime import memory
from pyzipmoe.runtime.memory import MemoryReading, auto_budget, cgroup_memory, safety_margin

GiB, MiB = 1 << 30, 1 << 20
NO_CAP = (1 << 64) - 1
V1_UNLIMITED = 9223372036854771712
MEMINFO = "MemTotal:       16384000 kB\nMemFree:         1000000 kB\nMemAvailable:   12000000 kB\nBuffers: 1 kB\n"

# cgroup trees as /proc/self/cgroup and the files under the cgroup root (the shapes of tests/unit/test_memory.py)
TREES = {
    "v1 own cgroup, total_ keys": ("5:cpu,cpuacct:/\n4:memory:/docker/abc\n0::/\n", {
        "memory/memory.limit_in_bytes": f"{V1_UNLIMITED}\n",
        "memory/docker/abc/memory.limit_in_bytes": f"{4 * GiB}\n",
        "memory/docker/abc/memory.usage_in_bytes": f"{GiB}\n",
        "memory/docker/abc/memory.stat": "cache 300\ninactive_file 100\ntotal_inactive_file 200\n"
                                         "active_file 7\ntotal_active_file 50\n"}),
    "v1 joint hierarchy": ("3:memory,cpu:/a\n", {
        "cpu,memory/a/memory.limit_in_bytes": f"{2 * GiB}\n",
        "cpu,memory/a/memory.usage_in_bytes": f"{GiB}\n"}),
    "v1 container without namespace": ("4:memory:/docker/xyz\n", {
        "memory/memory.limit_in_bytes": f"{GiB}\n", "memory/memory.usage_in_bytes": f"{100 * MiB}\n"}),
    "v1 recorded 600 MB": ("4:memory:/zipmoe\n", {
        "memory/memory.limit_in_bytes": f"{V1_UNLIMITED}\n",
        "memory/zipmoe/memory.limit_in_bytes": "599998464\n",
        "memory/zipmoe/memory.usage_in_bytes": "494080000\n",
        "memory/zipmoe/memory.stat": "cache 424726528\nshmem 424673280\ninactive_file 4096\nactive_file 49152\n"
                                     "total_inactive_file 4096\ntotal_active_file 49152\n"}),
    "v2 ancestor with less room": ("0::/pod/app\n", {
        "cgroup.controllers": "cpu memory\n",
        "pod/memory.max": f"{3 * GiB}\n", "pod/memory.current": f"{2 * GiB}\n",
        "pod/app/memory.max": f"{8 * GiB}\n", "pod/app/memory.current": f"{GiB}\n"}),
    "v2 service": ("0::/system.slice/zipmoe.service\n", {
        "cgroup.controllers": "cpu io memory pids\n",
        "system.slice/memory.max": "max\n",
        "system.slice/zipmoe.service/memory.max": "2400000000\n",
        "system.slice/zipmoe.service/memory.current": "2170011648\n",
        "system.slice/zipmoe.service/memory.stat": "anon 81920000\nfile 2088091648\ninactive_file 230686720\n"
                                                   "active_file 246792192\n"}),
    "v2 hybrid under unified": ("1:name=systemd:/a\n0::/a\n", {
        "unified/cgroup.controllers": "memory\n", "unified/a/memory.max": f"{GiB}\n",
        "unified/a/memory.current": f"{100 * MiB}\n"}),
    "v2 max is no limit": ("0::/a\n", {"cgroup.controllers": "memory\n", "a/memory.max": "max\n",
                                       "a/memory.current": "5\n"}),
    "garbled limit": ("0::/\n", {"cgroup.controllers": "memory\n", "memory.max": "lots\n"}),
    "unreadable usage": ("0::/\n", {"cgroup.controllers": "memory\n", "memory.max": f"{GiB}\n"}),
    "usage above the limit": ("0::/\n", {"cgroup.controllers": "memory\n", "memory.max": f"{GiB}\n",
                                         "memory.current": f"{3 * GiB}\n"}),
    "no cgroup file system": ("0::/\n", {}),
}


def write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def native(cg: Path, proc: Path, meminfo: Path) -> tuple[object, int]:
    out = _ffi.new("zipmoe_memory_reading *")
    rc = _lib.zipmoe_memory_read(str(cg).encode(), str(proc).encode(), str(meminfo).encode(), out)
    return out, rc


@pytest.mark.parametrize("case", TREES)
def test_native_reading_and_auto_are_python_s(case: str, tmp_path: Path) -> None:
    cgroup_line, files = TREES[case]
    cg, proc, meminfo = tmp_path / "cg", tmp_path / "proc", tmp_path / "meminfo"
    cg.mkdir()
    write_tree(proc, {"cgroup": cgroup_line})
    write_tree(cg, files)
    meminfo.write_text(MEMINFO)
    got, rc = native(cg, proc, meminfo)
    assert rc == 0
    c = cgroup_memory(cgroup_root=cg, proc_self=proc)
    py = MemoryReading(total=16384000 << 10, available=12000000 << 10, rss=0,
                       cgroup_limit=c.limit if c else None, cgroup_usage=c.usage if c else None,
                       cgroup_reclaimable=c.reclaimable if c else None, cgroup_file_cache=c.file_cache if c else None)
    assert (got.total, got.available) == (py.total, py.available)
    assert bool(got.has_cgroup) == (c is not None)
    if c is not None:
        assert (got.cgroup_limit, got.cgroup_usage, got.cgroup_reclaimable, got.cgroup_file_cache) == \
            (c.limit, c.usage, c.reclaimable, c.file_cache)
    assert _lib.zipmoe_memory_margin(got) == safety_margin(py)
    for model_bytes in (None, 100 * MiB, 64 * GiB):
        for held in (0, 424673280):
            assert _lib.zipmoe_auto_budget(got, NO_CAP if model_bytes is None else model_bytes, held) == \
                auto_budget(py, model_bytes, held), (model_bytes, held)


def test_without_meminfo_the_reading_fails(tmp_path: Path) -> None:
    _, rc = native(tmp_path, tmp_path, tmp_path / "missing")
    assert rc < 0


def test_this_machine_reads_as_python_reads_it() -> None:
    """The real files: the cgroup limit the same, the memory in the same range (it moves between two readings)."""
    out = _ffi.new("zipmoe_memory_reading *")
    assert _lib.zipmoe_memory_read(_ffi.NULL, _ffi.NULL, _ffi.NULL, out) == 0
    py = memory.read_memory()
    assert out.total == py.total
    assert bool(out.has_cgroup) == (py.cgroup_limit is not None)
    if py.cgroup_limit is not None:
        assert out.cgroup_limit == py.cgroup_limit
    assert abs(int(out.available) - py.available) < max(py.total // 20, 256 * MiB)


@pytest.mark.parametrize("text,valid", [("auto", True), (" AUTO ", True), ("Auto", True), ("6GiB", True),
                                        ("60%", True), ("0", True), ("100%", True), ("autox", False),
                                        ("au to", False), ("", False), ("abc", False), ("101%", False),
                                        ("-1", False), ("2EiB", False), ("1e3", False)])
def test_budget_texts(text: str, valid: bool) -> None:
    assert bool(_lib.zipmoe_budget_valid(text.encode())) == valid
    assert bool(_lib.zipmoe_budget_is_auto(text.encode())) == (text.strip().lower() == "auto")
