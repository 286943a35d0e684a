"""Memory readings (psutil, cgroup v1 and v2 in fake trees), the `auto` budget, and budget strings that are wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyzipmoe import cgroup
from pyzipmoe.runtime import memory
from pyzipmoe.runtime.budget import parse_budget
from pyzipmoe.runtime.config import RuntimeConfig
from pyzipmoe.errors import ZipmoeError
from pyzipmoe.runtime.memory import MIN_MARGIN, MemoryReading, auto_budget, cgroup_memory, read_memory, safety_margin

GiB, MiB, MB = 1 << 30, 1 << 20, 1000 * 1000
V1_UNLIMITED = 9223372036854771712  # what cgroup v1 writes for "no limit" with 4 KiB pages


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture
def fake(tmp_path: Path):
    """(cgroup root, /proc/self) of a fake machine, filled by the test."""
    cg, proc = tmp_path / "cgroup", tmp_path / "proc"
    cg.mkdir()
    proc.mkdir()
    return cg, proc


def read(fake) -> memory.CgroupMemory | None:
    cg, proc = fake
    return cgroup_memory(cgroup_root=cg, proc_self=proc)


# ------------------------------------------------------------------------------------------ cgroup v1


def test_v1_limit_and_usage_of_own_cgroup(fake):
    cg, proc = fake
    write_tree(proc, {"cgroup": "5:cpu,cpuacct:/\n4:memory:/docker/abc\n1:name=systemd:/x\n0::/\n"})
    write_tree(cg, {"memory/memory.limit_in_bytes": f"{V1_UNLIMITED}\n",
                    "memory/docker/abc/memory.limit_in_bytes": f"{4 * GiB}\n",
                    "memory/docker/abc/memory.usage_in_bytes": f"{GiB}\n",
                    "memory/docker/abc/memory.stat": "cache 300\ninactive_file 100\ntotal_inactive_file 200\n"
                                                     "active_file 7\ntotal_active_file 50\n"})
    got = read(fake)
    assert (got.limit, got.usage, got.reclaimable) == (4 * GiB, GiB, 200)  # total_ (hierarchical) wins
    assert got.file_cache == 250
    assert got.path == cg / "memory/docker/abc"


def test_v1_no_limit_is_none(fake):
    cg, proc = fake
    write_tree(proc, {"cgroup": "4:memory:/user.slice\n"})
    write_tree(cg, {"memory/memory.limit_in_bytes": f"{V1_UNLIMITED}\n",
                    "memory/user.slice/memory.limit_in_bytes": f"{V1_UNLIMITED}\n",
                    "memory/user.slice/memory.usage_in_bytes": "12345\n"})
    assert read(fake) is None


def test_v1_container_without_cgroup_namespace_reads_mount_root(fake):
    """/proc/self/cgroup names the host's path, the container sees its own cgroup at the mount."""
    cg, proc = fake
    write_tree(proc, {"cgroup": "4:memory:/docker/0123abcd\n"})
    write_tree(cg, {"memory/memory.limit_in_bytes": f"{2 * GiB}\n", "memory/memory.usage_in_bytes": f"{GiB}\n"})
    got = read(fake)
    assert (got.limit, got.usage, got.reclaimable) == (2 * GiB, GiB, 0)  # no memory.stat: nothing reclaimable


def test_own_cgroup_dir_v1(fake):
    """Where benchmarks and tests make child cgroups: this process's own directory of the controller's hierarchy,
    a joint hierarchy (cpu,cpuacct) included."""
    cg, proc = fake
    write_tree(proc, {"cgroup": "7:blkio:/b\n5:cpu,cpuacct:/c\n4:memory:/docker/abc\n0::/\n"})
    write_tree(cg, {"memory/docker/abc/memory.limit_in_bytes": f"{GiB}\n", "blkio/b/blkio.weight": "100\n",
                    "cpu,cpuacct/c/cpu.shares": "1024\n"})
    own = lambda controller: memory.own_cgroup_dir(controller, cgroup_root=cg, proc_self=proc)  # noqa: E731
    assert own("memory") == cg / "memory/docker/abc"
    assert own("blkio") == cg / "blkio/b"
    assert own("cpuacct") == cg / "cpu,cpuacct/c"
    assert cgroup.v1_mount("memory", cg) == cg / "memory"


def test_own_cgroup_dir_container_without_namespace_is_mount_root(fake):
    cg, proc = fake
    write_tree(proc, {"cgroup": "4:memory:/docker/0123abcd\n"})
    write_tree(cg, {"memory/memory.limit_in_bytes": f"{2 * GiB}\n"})
    assert memory.own_cgroup_dir("memory", cgroup_root=cg, proc_self=proc) == cg / "memory"


def test_own_cgroup_dir_none_without_v1_hierarchy(fake):
    """v2 only, a controller not mounted, or no /proc/self/cgroup: there is no v1 directory to make cgroups in."""
    cg, proc = fake
    assert memory.own_cgroup_dir("memory", cgroup_root=cg, proc_self=proc) is None  # no /proc/self/cgroup
    write_tree(proc, {"cgroup": "0::/pod/app\n"})
    write_tree(cg, {"cgroup.controllers": "cpu memory\n", "pod/app/memory.max": "max\n"})
    assert memory.own_cgroup_dir("memory", cgroup_root=cg, proc_self=proc) is None
    write_tree(proc, {"cgroup": "4:memory:/x\n"})
    assert memory.own_cgroup_dir("blkio", cgroup_root=cg, proc_self=proc) is None


def test_ancestor_with_less_room_binds(fake):
    cg, proc = fake
    write_tree(proc, {"cgroup": "0::/pod/app\n"})
    write_tree(cg, {"cgroup.controllers": "cpu memory\n",
                    "pod/memory.max": f"{3 * GiB}\n", "pod/memory.current": f"{2 * GiB}\n",
                    "pod/app/memory.max": f"{8 * GiB}\n", "pod/app/memory.current": f"{GiB}\n"})
    got = read(fake)
    assert (got.limit, got.usage) == (3 * GiB, 2 * GiB) and got.path == cg / "pod"


# ------------------------------------------------------------------------------------------ cgroup v2


def test_v2_limit_usage_and_inactive_file(fake):
    cg, proc = fake
    write_tree(proc, {"cgroup": "0::/system.slice/zipmoe.service\n"})
    write_tree(cg, {"cgroup.controllers": "cpu io memory\n",
                    "system.slice/zipmoe.service/memory.max": f"{6 * GiB}\n",
                    "system.slice/zipmoe.service/memory.current": f"{2 * GiB}\n",
                    "system.slice/zipmoe.service/memory.stat": f"anon 5\nfile 9\ninactive_file {GiB}\nactive_file 3\n"})
    got = read(fake)
    assert (got.limit, got.usage, got.reclaimable) == (6 * GiB, 2 * GiB, GiB)
    assert got.file_cache == GiB + 3


def test_v2_max_is_no_limit(fake):
    cg, proc = fake
    write_tree(proc, {"cgroup": "0::/a\n"})
    write_tree(cg, {"cgroup.controllers": "memory\n", "a/memory.max": "max\n", "a/memory.current": "5\n"})
    assert read(fake) is None


def test_v2_hybrid_mode_under_unified(fake):
    """systemd's hybrid layout: v1 controllers at the root, v2 at unified/ (here without a v1 memory line)."""
    cg, proc = fake
    write_tree(proc, {"cgroup": "1:name=systemd:/a\n0::/a\n"})
    write_tree(cg, {"unified/cgroup.controllers": "memory\n", "unified/a/memory.max": f"{GiB}\n",
                    "unified/a/memory.current": f"{100 * MiB}\n"})
    got = read(fake)
    assert (got.limit, got.usage) == (GiB, 100 * MiB)


@pytest.mark.parametrize("files", [
    {},  # no cgroup filesystem at all
    {"cgroup.controllers": "memory\n"},  # v2 root: no memory.max there
    {"cgroup.controllers": "memory\n", "memory.max": "lots\n"},  # garbled
    {"cgroup.controllers": "memory\n", "memory.max": ""},  # empty
])
def test_missing_or_garbled_files_are_no_limit(fake, files):
    cg, proc = fake
    write_tree(proc, {"cgroup": "0::/\n"})
    write_tree(cg, files)
    assert read(fake) is None


def test_no_proc_self_cgroup(fake):
    assert read(fake) is None  # not Linux, or no /proc: nothing limits what we know of


def test_unreadable_usage_counts_as_zero(fake):
    cg, proc = fake
    write_tree(proc, {"cgroup": "0::/\n"})
    write_tree(cg, {"cgroup.controllers": "memory\n", "memory.max": f"{GiB}\n"})
    got = read(fake)
    assert (got.limit, got.usage) == (GiB, 0)


def test_read_memory_combines_psutil_and_cgroup(fake):
    cg, proc = fake
    write_tree(proc, {"cgroup": "0::/\n"})
    write_tree(cg, {"cgroup.controllers": "memory\n", "memory.max": f"{GiB}\n", "memory.current": f"{MiB}\n"})
    r = read_memory(cgroup_root=cg, proc_self=proc)
    assert r.total > 0 and 0 < r.available <= r.total and r.rss > 0
    assert (r.cgroup_limit, r.cgroup_usage, r.cgroup_reclaimable) == (GiB, MiB, 0)


def test_read_memory_of_this_machine():
    r = read_memory()
    assert r.total > 0 and r.available > 0 and r.rss > 0
    assert (r.cgroup_limit is None) == (r.cgroup_usage is None)


# ------------------------------------------------------------------------------------------ auto budget


def reading(**kw) -> MemoryReading:
    values = {"total": 16 * GiB, "available": 10 * GiB, "rss": 200 * MiB}
    return MemoryReading(**{**values, **kw})


def test_auto_budget_without_cgroup_is_available_less_margin():
    r = reading()
    assert safety_margin(r) == int(0.03 * 16 * GiB)  # 3% of 16 GiB
    assert auto_budget(r) == 10 * GiB - int(0.03 * 16 * GiB)


def test_margin_is_a_few_percent_with_a_small_floor():
    r = reading(total=GiB, available=GiB // 2)
    assert safety_margin(r) == MIN_MARGIN == 32 * MiB  # 3% of 1 GiB is less
    assert auto_budget(r) == GiB // 2 - MIN_MARGIN
    assert safety_margin(reading(total=64 * GiB)) == int(0.03 * 64 * GiB)


def test_cgroup_with_less_room_than_machine_binds():
    r = reading(cgroup_limit=4 * GiB, cgroup_usage=3 * GiB, cgroup_reclaimable=GiB)
    # room in the cgroup: 4 - (3 - 1) = 2 GiB (no active file cache read: the inactive is all of it); margin 3% of
    # the 4 GiB limit, at least 32 MiB: 122.88 MiB
    assert auto_budget(r) == 2 * GiB - int(0.03 * 4 * GiB)


def test_machine_with_less_room_than_cgroup_binds():
    r = reading(available=3 * GiB, cgroup_limit=12 * GiB, cgroup_usage=0)
    assert auto_budget(r) == 3 * GiB - int(0.03 * 12 * GiB)  # margin: of the 12 GiB limit, not of the 16 GiB RAM


def test_auto_budget_never_negative_and_capped_by_model():
    assert auto_budget(reading(available=50 * MiB)) == 0
    assert auto_budget(reading(cgroup_limit=GiB, cgroup_usage=2 * GiB)) == 0  # over its limit already
    assert auto_budget(reading(), model_bytes=3 * GiB) == 3 * GiB
    assert auto_budget(reading(), model_bytes=100 * GiB) == auto_budget(reading())


def test_auto_budget_counts_what_the_runtime_holds_as_the_model_s():
    """A reading after the load: the tiers the runtime filled are charged as used, and come back as `held`. The
    same memory gives the same budget before and after the load (it once shrank to what was left besides the
    model's own cache, and the monitor refused to start: 'memory budget 56 MiB is too small')."""
    before = reading(cgroup_limit=600 * MB, cgroup_usage=90 * MB, cgroup_reclaimable=0, cgroup_file_cache=0)
    # the load: 60 MB of weights that are not experts mapped (file cache), 400 MB of tiers decoded (memfd: used)
    after = reading(cgroup_limit=600 * MB, cgroup_usage=550 * MB, cgroup_reclaimable=20 * MB,
                    cgroup_file_cache=60 * MB)
    assert auto_budget(after, held=400 * MB) == auto_budget(before) == 510 * MB - MIN_MARGIN
    assert auto_budget(after) == 110 * MB - MIN_MARGIN  # without held: the old mistake


# Recorded in a 600,000,000-byte cgroup v1 container (this machine, 2026-12-03), memory.stat trimmed to the lines
# that matter: pyzipmoe.Llama(memory_budget="auto") on a 702 MB BF16 synthetic model (502 MB zipmoe, whole budget
# 719379456), just before the load and after it with its first tokens, when the runtime held 424673280 bytes (its
# tiers, memfd slots: shmem). auto chose 532680704 at load and reads 497090560 after it: the same memory less
# what llama.cpp's own buffers took (KV cache, compute buffers). Without `held` it would read 72417280.
V1_600MB_AT_LOAD = {
    "memory/memory.limit_in_bytes": f"{V1_UNLIMITED}\n",
    "memory/zipmoe/memory.limit_in_bytes": "599998464\n",
    "memory/zipmoe/memory.usage_in_bytes": "33775616\n",
    "memory/zipmoe/memory.stat": ("cache 12288\nrss 33202176\nshmem 0\nmapped_file 0\ninactive_file 4096\n"
                                  "active_file 8192\ntotal_cache 12288\ntotal_rss 33202176\ntotal_shmem 0\n"
                                  "total_inactive_file 4096\ntotal_active_file 8192\n"),
}
V1_600MB_AFTER_LOAD = {
    "memory/memory.limit_in_bytes": f"{V1_UNLIMITED}\n",
    "memory/zipmoe/memory.limit_in_bytes": "599998464\n",
    "memory/zipmoe/memory.usage_in_bytes": "494080000\n",
    "memory/zipmoe/memory.stat": ("cache 424726528\nrss 66568192\nshmem 424673280\nmapped_file 424689664\n"
                                  "inactive_file 4096\nactive_file 49152\ntotal_cache 424726528\n"
                                  "total_rss 66568192\ntotal_shmem 424673280\ntotal_inactive_file 4096\n"
                                  "total_active_file 49152\n"),
}
# Not recorded (this machine has cgroup v1): a reading in v2's layout, a systemd service with MemoryMax=2400M.
V2_2400MB = {  # a systemd service with MemoryMax=2400M, the model loaded, 1.5 GiB of tiers
    "cgroup.controllers": "cpu io memory pids\n",
    "system.slice/memory.max": "max\n",
    "system.slice/zipmoe.service/memory.max": "2400000000\n",
    "system.slice/zipmoe.service/memory.current": "2170011648\n",
    "system.slice/zipmoe.service/memory.stat": ("anon 81920000\nfile 2088091648\nshmem 1610612736\n"
                                                "file_mapped 313458688\ninactive_anon 0\nactive_anon 81920000\n"
                                                "inactive_file 230686720\nactive_file 246792192\n"),
}


def recorded(fake, files: dict[str, str], cgroup_line: str) -> MemoryReading:
    cg, proc = fake
    write_tree(proc, {"cgroup": cgroup_line})
    write_tree(cg, files)
    c = cgroup_memory(cgroup_root=cg, proc_self=proc)
    return MemoryReading(total=16 * GiB, available=12 * GiB, rss=0, cgroup_limit=c.limit, cgroup_usage=c.usage,
                         cgroup_reclaimable=c.reclaimable, cgroup_file_cache=c.file_cache)


def test_recorded_v1_container_of_600_mb_at_load_and_after(tmp_path):
    whole = 719379456  # the model's whole budget: more than the container
    at_load = recorded((tmp_path / "a" / "cg", tmp_path / "a" / "proc"), V1_600MB_AT_LOAD, "4:memory:/zipmoe\n")
    after = recorded((tmp_path / "b" / "cg", tmp_path / "b" / "proc"), V1_600MB_AFTER_LOAD, "4:memory:/zipmoe\n")
    assert safety_margin(at_load) == MIN_MARGIN  # 3% of 600 MB is 18 MB: the floor (32 MiB) binds
    assert auto_budget(at_load, whole) == 599998464 - (33775616 - 12288) - MIN_MARGIN == 532680704
    held = 424673280
    assert auto_budget(after, whole, held) == 497090560
    assert auto_budget(after, whole) == 72417280  # the old mistake: the model's cache counted as others' memory


def test_v2_service_of_2400_mb(tmp_path):
    r = recorded((tmp_path / "cg", tmp_path / "proc"), V2_2400MB, "0::/system.slice/zipmoe.service\n")
    assert (r.cgroup_limit, r.cgroup_file_cache) == (2400000000, 230686720 + 246792192)
    held = 1610612736
    margin = int(0.03 * 2400000000)  # 72 MB: above the floor
    assert safety_margin(r) == margin
    expect = 2400000000 - (2170011648 - 230686720 - 246792192) + held - margin
    assert auto_budget(r, None, held) == expect
    assert auto_budget(r, 1000 * MiB, held) == 1000 * MiB


def test_parse_budget_auto(monkeypatch):
    monkeypatch.setattr(memory, "read_memory", lambda **kw: reading())
    expect = 10 * GiB - int(0.03 * 16 * GiB)
    assert parse_budget("auto") == expect
    assert parse_budget(" AUTO ") == expect
    assert parse_budget("auto", model_bytes=GiB) == GiB
    assert RuntimeConfig("auto").to_env() == {"ZIPMOE_MEMORY_BUDGET": str(expect)}


def test_parse_budget_auto_on_this_machine():
    assert parse_budget("auto") >= 0


# ------------------------------------------------------------------------------------------ bad budgets


@pytest.mark.parametrize("text,says", [
    ("-1", "'-1' is not a size (it is negative): write e.g. 6GiB, 512MiB, 60% or auto"),
    ("abc", "'abc' is not a size: write e.g. 6GiB, 512MiB, 60% or auto"),
    ("1.5.2GiB", "'1.5.2GiB' is not a size: write e.g."),
    ("", "'' is not a size (it is empty): write e.g."),
    ("   ", "is not a size (it is empty)"),
    ("200%", "'200%' is more than all of the memory: write at most 100%, or auto"),
    ("6 parsecs", "unknown unit 'parsecs': use B, KiB, MiB, GiB, TiB or %, or write auto"),
    ("autox", "'autox' is not a size: write e.g."),
    (-5, "memory budget -5 is negative: write e.g."),
])
def test_bad_budgets_say_what_to_write(text, says):
    with pytest.raises(ZipmoeError) as e:
        parse_budget(text, total=1000)
    message = str(e.value)
    assert says in message and "\n" not in message


def test_zero_is_a_budget():
    """Not an error: the runtime then keeps no expert and decodes on every use (test_llama runs it)."""
    assert parse_budget("0") == 0 and parse_budget(0) == 0 and parse_budget("0%", total=1000) == 0


def test_headroom_with_file_cache_counts_the_active_list_too():
    """The kernel moves pages between its active and inactive lists all the time; what could be had if it dropped
    every page of file cache does not move with them (the memory monitor's reading for a fixed budget)."""
    before = MemoryReading(total=16 * GiB, available=8 * GiB, rss=0, cgroup_limit=2 * GiB, cgroup_usage=2 * GiB,
                           cgroup_reclaimable=300 * MiB, cgroup_file_cache=500 * MiB)
    after = MemoryReading(total=16 * GiB, available=8 * GiB, rss=0, cgroup_limit=2 * GiB, cgroup_usage=2 * GiB,
                          cgroup_reclaimable=100 * MiB, cgroup_file_cache=500 * MiB)
    assert (before.headroom, after.headroom) == (300 * MiB, 100 * MiB)
    assert before.headroom_with_file_cache == after.headroom_with_file_cache == 500 * MiB
    machine = MemoryReading(total=16 * GiB, available=3 * GiB, rss=0)  # psutil's available counts the cache
    assert machine.headroom_with_file_cache == machine.headroom == 3 * GiB
