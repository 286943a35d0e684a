"""Memory pressure in a container (issue 38): `auto` in a cgroup smaller than the BF16 model, a neighbour that
grows in the same cgroup, and the kernel's signals that wake the memory monitor.

Each test makes a cgroup v1 memory cgroup (root, tests/helpers.py memory_cgroup_parent; skipped without it, with
the reason) and runs its processes in it. Assertions are about behaviour, never timing: nobody was OOM-killed
(memory.oom_control's oom_kill stays 0 and every process exits 0), the tokens are the unconstrained run's, the
cache's resident bytes went down while the neighbour held its memory and up again after it left.

The model is the "small" synthetic preset (61 MiB of BF16, 48 MiB of experts). A Python process with
llama-cpp-python holds ~100 MiB before it loads anything, so "a container smaller than the BF16 model" is one whose
room beside that process (measured in the cgroup, not assumed) is less than the BF16 file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import finish_worker, http_json, kill_group, unavailable, worker_env, write_atomic

TIMEOUT = 90  # seconds for a worker; a run that takes longer has lost already
PROMPT = "the expert model said hello to the world of water and time, and then the people"
N_CTX = 512


# ------------------------------------------------------------------------------------------ cgroups


class Cgroup:
    """A child memory cgroup (v1) of `parent`, removed on exit."""

    def __init__(self, parent: Path, name: str) -> None:
        self.path = parent / f"zipmoe-pressure-{os.getpid()}-{name}"
        self.path.mkdir()

    def __enter__(self) -> Cgroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)  # its processes may take a moment to leave

    def set_limit(self, nbytes: int) -> None:
        (self.path / "memory.limit_in_bytes").write_text(str(nbytes))

    def read(self, name: str) -> int:
        return int((self.path / name).read_text().split()[0])

    def stat(self) -> dict[str, int]:
        return {k: int(v) for k, v in (ln.split() for ln in (self.path / "memory.stat").read_text().splitlines())}

    def oom_kills(self) -> int:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def in_use(self) -> int:
        """Charged memory less all the file cache ("auto"'s reading)."""
        s = self.stat()
        return self.read("memory.usage_in_bytes") - s.get("total_inactive_file", 0) - s.get("total_active_file", 0)

    def prefix(self) -> tuple[str, ...]:
        """argv that puts the process in this cgroup, then runs the rest."""
        return ("/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"))


def start(argv: list[str], env: dict[str, str], cg: Cgroup | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([*(cg.prefix() if cg else ()), *argv], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)




def wait_file(path: Path, proc: subprocess.Popen[str], what: str, seconds: float = TIMEOUT) -> str:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise AssertionError(f"{what} ended (exit status {proc.returncode}) before {path.name}:\n{err[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {path.name} from {what} after {seconds} s")
        time.sleep(0.02)
    return path.read_text()


# ------------------------------------------------------------------------------------------ the worker

WORKER = r"""
import json, os, sys, time
job = json.loads(sys.argv[1])
from pyzipmoe.runtime import memory
from pyzipmoe.runtime.llama import Llama, zipmoe_stats

def wait_for(path, seconds=120):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"no {path} after {seconds} s")
        time.sleep(0.02)

def put(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.rename(path + ".tmp", path)

def resident():
    s = zipmoe_stats()
    return int(s["hot_bytes"] + s["warm_bytes"] + s["sm_bytes"])

res = {}
if job.get("baseline"):
    # llama-cpp-python, the native library and the model's index loaded: the test measures what this process
    # holds, then sets the limit
    from pyzipmoe import _native
    from pyzipmoe.file.reader import open_zipmoe
    from pyzipmoe.runtime.budget import model_memory
    _native.lib.zipmoe_stats_reset
    model_memory(open_zipmoe(job["model"]))
    put(job["baseline"], {})
    wait_for(job["limited"])
kw = {"memory_budget": job["budget"]} if job.get("budget") else {}
llm = Llama(job["model"], n_ctx=job["n_ctx"], n_threads=2, n_threads_batch=2, n_batch=64, n_ubatch=64, seed=0,
            verbose=False, **kw)
mon = llm.zipmoe_monitor
res["budget"] = mon.budget if mon else None
tokens = llm.tokenize(job["prompt"].encode())
llm.eval(tokens)
gen, series = [], []
phase = "before"
t0 = time.monotonic()
for i in range(job["n_gen"]):
    nxt = llm._ctx.get_logits_ith(-1)
    import numpy as np
    logits = np.ctypeslib.as_array(nxt, shape=(llm.n_vocab(),))
    tok = int(np.argmax(logits))
    gen.append(tok)
    llm.eval([tok])
    if mon is not None:
        series.append((round(time.monotonic() - t0, 3), mon.budget, resident()))
    if job.get("ready") and phase == "before" and i + 1 >= job["before"]:
        res["before"] = {"resident": resident(), "budget": mon.budget}
        put(job["ready"], res["before"])
        phase = "neighbour"
    if phase == "neighbour":
        time.sleep(job.get("pace", 0))
        if resident() < res["before"]["resident"] // 2 and not os.path.exists(job["shrunk"]):
            put(job["shrunk"], {"resident": resident()})
        if os.path.exists(job["gone"]):
            phase = "after"
    elif phase == "after":
        time.sleep(job.get("pace", 0))
        if resident() >= res["before"]["resident"] * 0.9 or time.monotonic() - t0 > job.get("regrow_s", 60):
            phase = "done"  # (the tokens still go on to n_gen: the same count as the reference's)
res.update(generated=gen, series=series, replans=[b for b, _ in mon.replans] if mon else [],
           wakeups=mon.wakeups if mon else 0, floor=mon.floor if mon else None,
           signals=list(mon.signals) if mon else [])
llm.close()
print(json.dumps(res))
"""

NEIGHBOUR = r"""
import json, os, sys, time
job = json.loads(sys.argv[1])
chunks = []
while sum(len(c) for c in chunks) < job["target"]:
    chunks.append(bytearray(job["step"]))  # zero-filled: every page touched, charged at once
    time.sleep(job["every"])
with open(job["peak"], "w") as f:
    f.write(str(sum(len(c) for c in chunks)))
deadline = time.monotonic() + job["hold_s"]
while time.monotonic() < deadline and not os.path.exists(job["release"]):
    time.sleep(0.05)
print(json.dumps({"held": sum(len(c) for c in chunks)}))
"""


def worker(job: dict[str, Any], lib_dir: Path, cg: Cgroup | None = None) -> subprocess.Popen[str]:
    return start([sys.executable, "-c", WORKER, json.dumps(job)], worker_env(lib_dir), cg)


# ------------------------------------------------------------------------------------------ tests


def test_the_kernel_signals_a_cgroup_near_its_limit(cgroup_parent: Path, tmp_path: Path) -> None:
    """pressure.MemoryEvents on a real cgroup v1: registering the usage threshold works here, and a process that
    allocates past the limit less the margin wakes a waiter (which then reads, as the monitor does)."""
    from pyzipmoe.cgroup import v1_mount
    from pyzipmoe.runtime.pressure import MemoryEvents

    limit, margin = 256 << 20, 64 << 20
    with Cgroup(cgroup_parent, "signal") as cg:
        cg.set_limit(limit)
        proc_self = tmp_path / "proc"
        proc_self.mkdir()
        (proc_self / "cgroup").write_text(f"4:memory:/{cg.path.relative_to(v1_mount('memory'))}\n")
        events = MemoryEvents.open(margin, proc_self=proc_self)
        try:
            assert "v1-threshold" in events.kinds, events.kinds
            assert not events.wait(0)  # nothing in the cgroup: nothing crossed
            hog = start([sys.executable, "-c", "import sys, time; b = bytearray(220 << 20); sys.stdin.read()"],
                        dict(os.environ), cg)
            try:
                assert events.wait(60), "no signal after a process charged 220 MiB in a 256 MiB cgroup"
                assert cg.read("memory.usage_in_bytes") > limit - margin
            finally:
                kill_group(hog)
        finally:
            events.close()
        assert cg.oom_kills() == 0


def _reference(lib_dir: Path, bf16: Path, n_gen: int, tmp_path: Path) -> list[int]:
    got = finish_worker(worker({"model": str(bf16), "prompt": PROMPT, "n_ctx": N_CTX, "n_gen": n_gen}, lib_dir),
                        "the BF16 reference", TIMEOUT)
    return got["generated"]


def _baseline(cg: Cgroup, proc: subprocess.Popen[str], tmp_path: Path) -> int:
    wait_file(tmp_path / "baseline.json", proc, "the worker")
    time.sleep(0.2)  # (its imports are done; what it holds settles)
    return cg.in_use()


def test_auto_loads_in_a_container_smaller_than_the_bf16_model(llama_lib_dir: Path, cgroup_parent: Path,
                                                               small_models: tuple[Path, Path],
                                                               tmp_path: Path) -> None:
    """The issue's first case, scaled: `auto` in a cgroup whose room beside the process is 95% of the BF16 file
    loads (it once refused: 'memory budget 56 MiB is too small'), chooses a budget between the model's minimum and
    its whole size, and generates the BF16 model's tokens without an OOM kill."""
    from pyzipmoe.runtime.budget import model_memory

    bf16, packed = small_models
    n_gen = 24
    ref = _reference(llama_lib_dir, bf16, n_gen, tmp_path)
    need = model_memory(packed)
    with Cgroup(cgroup_parent, "auto") as cg:
        job = {"model": str(packed), "prompt": PROMPT, "n_ctx": N_CTX, "n_gen": n_gen, "budget": "auto",
               "baseline": str(tmp_path / "baseline.json"), "limited": str(tmp_path / "limited")}
        proc = worker(job, llama_lib_dir, cg)
        try:
            base = _baseline(cg, proc, tmp_path)
            room = int(bf16.stat().st_size * 0.95)
            cg.set_limit(base + room)
            write_atomic(Path(job["limited"]), str(base + room))
            got = finish_worker(proc, "zipmoe with auto", TIMEOUT)
        finally:
            kill_group(proc)
        oom = cg.oom_kills()
    where = (f"baseline {base / 2**20:.1f} MiB + room {room / 2**20:.1f} MiB (BF16 file "
             f"{bf16.stat().st_size / 2**20:.1f} MiB); auto chose {got['budget'] / 2**20:.1f} MiB "
             f"(minimum {need.minimum / 2**20:.1f}, whole {need.whole / 2**20:.1f})")
    print(where)
    assert oom == 0, where
    assert need.minimum <= got["budget"] < need.whole, where  # it had to keep fewer experts than all
    assert got["generated"] == ref, where


def _neighbour_run(llama_lib_dir: Path, cgroup_parent: Path, small_models: tuple[Path, Path], tmp_path: Path,
                   step_share: float) -> tuple[dict[str, Any], list[int], dict[str, Any], int]:
    from pyzipmoe.runtime.budget import model_memory

    bf16, packed = small_models
    n_gen = 400
    ref = _reference(llama_lib_dir, bf16, n_gen, tmp_path)
    need = model_memory(packed)
    with Cgroup(cgroup_parent, "neighbour") as cg:
        job = {"model": str(packed), "prompt": PROMPT, "n_ctx": N_CTX, "n_gen": n_gen, "budget": "auto",
               "baseline": str(tmp_path / "baseline.json"), "limited": str(tmp_path / "limited"),
               "ready": str(tmp_path / "ready.json"), "gone": str(tmp_path / "gone"),
               "shrunk": str(tmp_path / "shrunk.json"), "before": 8, "pace": 0.03,
               "regrow_s": 60}
        proc = worker(job, llama_lib_dir, cg)
        neighbour = None
        try:
            base = _baseline(cg, proc, tmp_path)
            # room for every expert decoded and the margin: auto starts with the whole model
            limit = base + need.whole + (32 << 20) + (24 << 20)
            cg.set_limit(limit)
            write_atomic(Path(job["limited"]), str(limit))
            before = json.loads(wait_file(Path(job["ready"]), proc, "the worker"))
            target = limit // 3
            nb = {"target": target, "step": max(1 << 20, int(target * step_share)), "every": 0.5,
                  "peak": str(tmp_path / "peak"), "release": str(tmp_path / "release"), "hold_s": 30}
            neighbour = start([sys.executable, "-c", NEIGHBOUR, json.dumps(nb)], dict(os.environ), cg)
            wait_file(Path(nb["peak"]), neighbour, "the neighbour")
            # it holds its third until the worker's cache has shrunk to half (or 30 s), then leaves
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and proc.poll() is None and not Path(job["shrunk"]).exists():
                time.sleep(0.1)
            time.sleep(0.5)
            write_atomic(Path(nb["release"]), "1")
            held = finish_worker(neighbour, "the neighbour", TIMEOUT)
            neighbour = None
            write_atomic(Path(job["gone"]), "1")
            got = finish_worker(proc, "zipmoe with auto and a neighbour", TIMEOUT)
        finally:
            if neighbour is not None:
                kill_group(neighbour)
            kill_group(proc)
        oom = cg.oom_kills()
    return got, ref, {"before": before, "limit": limit, "target": target, "held": held, "need": need}, oom


@pytest.mark.parametrize("step_share", [1 / 6])
def test_a_growing_neighbour_shrinks_the_cache_and_it_grows_back(llama_lib_dir: Path, cgroup_parent: Path,
                                                                 small_models: tuple[Path, Path], tmp_path: Path,
                                                                 step_share: float) -> None:
    """A neighbour in the same cgroup grows by a sixth of its share every 0.5 s to a third of the container, holds
    it, then leaves: the zipmoe process (pyzipmoe.Llama, auto) is not OOM-killed (nor is the neighbour), its
    tokens are the BF16 model's, its cache's resident bytes went down and then back up."""
    got, ref, info, oom = _neighbour_run(llama_lib_dir, cgroup_parent, small_models, tmp_path, step_share)
    series = got["series"]
    before = info["before"]["resident"]
    low_at = min(range(len(series)), key=lambda i: series[i][2])
    low = series[low_at][2]
    after = max(s[2] for s in series[low_at:])
    where = (f"limit {info['limit'] / 2**20:.1f} MiB, neighbour {info['target'] / 2**20:.1f} MiB; resident before "
             f"{before / 2**20:.1f} MiB, lowest {low / 2**20:.1f}, after {after / 2**20:.1f}; budgets "
             f"{[round(b / 2**20, 1) for b in got['replans']]} MiB; signals {got['signals']}, "
             f"woken {got['wakeups']} times")
    print(where)
    assert oom == 0, where
    assert got["floor"] is None, where
    assert got["generated"] == ref, where
    assert low < before * 0.75, f"the cache did not shrink: {where}"
    assert after > low + (before - low) // 2, f"the cache did not grow back: {where}"


# ------------------------------------------------------------------------------------------ zipmoe serve




class Server:
    """`zipmoe serve MODEL` on loopback (in `cg` if given), its stderr in a file; killed on exit."""

    def __init__(self, lib_dir: Path, model: Path, log: Path, cg: Cgroup | None = None, budget: str | None = None):
        import socket

        if not (lib_dir / "llama-server").is_file():
            unavailable(f"{lib_dir / 'llama-server'} was not built")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.log = log
        argv = [sys.executable, "-m", "pyzipmoe", "serve", str(model), "--port", str(port), "-t", "2"]
        if budget:
            argv += ["--memory-budget", budget]
        argv += ["--", "-c", "1024", "-np", "1"]
        with open(log, "wb") as err:
            self.proc = subprocess.Popen([*(cg.prefix() if cg else ()), *argv], env=worker_env(lib_dir),
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                         start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"zipmoe serve exited with {self.proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if http_json(self.url + "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError("llama-server was not ready in time")

    def complete(self, n: int) -> dict[str, Any]:
        status, body = http_json(self.url + "/completion", {"prompt": PROMPT, "n_predict": n, "temperature": 0,
                                                            "seed": 0, "cache_prompt": False}, TIMEOUT)
        assert status == 200, (status, body)
        return {"content": body["content"], "tokens": body.get("tokens")}

    def budgets(self) -> list[tuple[float, float]]:
        """(budget MiB, cache MiB) of each 'memory budget now' line the supervisor printed."""
        import re

        return [(float(m.group(1)), float(m.group(2))) for m in
                re.finditer(r"memory budget now (\d+) MiB .*?cache holds (\d+) MiB", self.log.read_text())]

    def close(self) -> None:
        from pyzipmoe.runtime.runner import stop_group

        stop_group(self.proc, grace=15)


def test_serve_gives_way_to_a_growing_neighbour_with_a_request_in_flight(llama_lib_dir: Path, cgroup_parent: Path,
                                                                          small_models: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    """`zipmoe serve --memory-budget auto`: the supervisor shrinks llama-server's cache while a neighbour grows to a
    third of the container with requests in flight (back to back), and grows it back after the neighbour left;
    llama-server is never OOM-killed and every request returns the BF16 model's text. (An idle server gives way
    only at its next request, docs/cache-and-planner.md "Known limits": with one short request, done before the
    neighbour grew, llama-server was OOM-killed in a full-suite run.)"""
    import threading

    from pyzipmoe.runtime.budget import model_memory

    bf16, packed = small_models
    whole = model_memory(packed).whole / 2**20
    n = 300
    ref = Server(llama_lib_dir, bf16, tmp_path / "bf16.log")
    try:
        expected = ref.complete(n)
    finally:
        ref.close()
    with Cgroup(cgroup_parent, "serve") as cg:
        cg.set_limit(1 << 30)  # generous while it loads: auto starts with the whole model
        srv = Server(llama_lib_dir, packed, tmp_path / "zipmoe.log", cg, "auto")
        neighbour = None
        try:
            srv.complete(8)  # the cache in use, its pages charged
            time.sleep(1.0)  # (the supervisor's first readings)
            limit = cg.in_use() + (32 << 20) + (24 << 20)
            cg.set_limit(limit)
            target = limit // 3
            got: dict[str, Any] = {"during": []}
            stop = threading.Event()

            def requests() -> None:  # requests back to back: one is in flight whenever the neighbour moves
                while not stop.is_set():
                    got["during"].append(srv.complete(n))

            first = threading.Thread(target=requests)
            first.start()
            nb = {"target": target, "step": max(1 << 20, target // 6), "every": 0.5,
                  "peak": str(tmp_path / "peak"), "release": str(tmp_path / "release"), "hold_s": 30}
            neighbour = start([sys.executable, "-c", NEIGHBOUR, json.dumps(nb)], dict(os.environ), cg)
            wait_file(Path(nb["peak"]), neighbour, "the neighbour")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not srv.budgets():  # (the first re-plan is a shrink)
                time.sleep(0.1)
            write_atomic(Path(nb["release"]), "1")
            finish_worker(neighbour, "the neighbour", TIMEOUT)
            neighbour = None
            time.sleep(1.5)  # (a reading or two: the room is back)
            stop.set()
            first.join(TIMEOUT)
            got["second"] = srv.complete(n)
            assert srv.proc.poll() is None, srv.log.read_text()[-3000:]
            budgets = srv.budgets()
        finally:
            if neighbour is not None:
                kill_group(neighbour)
            srv.close()
        oom = cg.oom_kills()
    where = f"limit {limit / 2**20:.1f} MiB, neighbour {target / 2**20:.1f} MiB; budgets (MiB, cache MiB) {budgets}"
    print(where)
    assert oom == 0, where
    assert got["during"] and all(r["content"] == expected["content"] for r in got["during"]), where
    assert got["second"]["content"] == expected["content"], where
    assert budgets, f"the supervisor never re-planned: {where}"
    low = min(range(len(budgets)), key=lambda i: budgets[i][0])
    assert budgets[low][0] < whole * 0.75, f"no shrink: {where}"
    assert any(b > budgets[low][0] * 1.5 for b, _ in budgets[low + 1:]), f"no regrowth: {where}"


FLOOR = r"""
import json, sys
from pyzipmoe.errors import OutOfMemoryError
from pyzipmoe.runtime import memory
from pyzipmoe.runtime.llama import Llama
llm = Llama(sys.argv[1], n_ctx=256, n_threads=1, memory_budget="auto", verbose=False)
mon = llm.zipmoe_monitor
mon.stop()  # stepped by hand below
llm.eval(llm.tokenize(b"hello"))
# the machine now has nothing left: what the model could hold is what it holds. It shrinks to its minimum first
# (its tiers could make room), and once the stores have evicted, what it holds is below its minimum
mon._read = lambda: memory.MemoryReading(total=1 << 30, available=0, rss=0)
assert mon.step() and mon.budget == mon.planned.need.minimum and mon.floor is None
llm.eval([1])
mon.step()
first = mon.floor
mon.step()
try:
    llm.eval([1])
    print(json.dumps({"raised": None, "first": first, "floor": mon.floor}))
except OutOfMemoryError as e:
    print(json.dumps({"raised": str(e), "first": first, "floor": mon.floor, "exit_code": e.exit_code}))
"""


def test_the_floor_stops_the_next_decode_with_one_line(llama_lib_dir: Path, small_models: tuple[Path, Path]) -> None:
    """When even the minimum no longer fits at two readings in a row, pyzipmoe.Llama's next decode raises
    OutOfMemoryError with one line (the CLI's exit status 3), rather than running on into the OOM killer."""
    _, packed = small_models
    got = finish_worker(start([sys.executable, "-c", FLOOR, str(packed)], worker_env(llama_lib_dir)), "the floor worker",
                        TIMEOUT)
    assert got["first"] is None, got  # one reading is not enough
    assert got["raised"] and got["raised"] == got["floor"] and "\n" not in got["raised"], got
    assert "out of memory" in got["raised"] and got["exit_code"] == 3, got


def test_a_bare_program_says_its_budget_does_not_adapt(llama_lib_dir: Path, small_models: tuple[Path, Path]) -> None:
    """llama-simple with ZIPMOE_MEMORY_BUDGET and no supervisor says in its load message that the budget is fixed;
    with a supervisor's control file, that it follows the memory available."""
    from pyzipmoe.runtime import runner, supervise

    tool = llama_lib_dir / "llama-simple"
    if not tool.is_file():
        unavailable(f"{tool} was not built")
    _, packed = small_models
    env = runner.environment(base=worker_env(llama_lib_dir), memory_budget=str(40 << 20))
    argv = [str(tool), "-m", str(packed), "-n", "2", "hello"]
    bare = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert bare.returncode == 0, bare.stderr[-3000:]
    assert "the budget is fixed for this run: it does not adapt to the memory available" in bare.stderr
    ctl = supervise.ControlFile.create()
    try:
        led = subprocess.run(argv, env={**env, "ZIPMOE_CONTROL": str(ctl.path)}, capture_output=True, text=True,
                             timeout=TIMEOUT)
        assert led.returncode == 0, led.stderr[-3000:]
        assert "the budget follows the memory available" in led.stderr, led.stderr[-3000:]
        # it told the supervisor what it held (the peak: what it holds now is 0 once the model is freed)
        assert ctl.reporting and ctl.value(supervise.W_PEAK_RESIDENT) > 0 and ctl.value(supervise.W_CALLS) > 0
    finally:
        ctl.close()


# ------------------------------------------------------------------------------ the supervisor's own resources


class FullShm:
    """argv prefix: the rest runs in a private mount namespace whose /dev/shm is a tmpfs of one page, full (what any
    local user can do to the machine's /dev/shm). Skipped, with the reason, where unshare is not allowed."""

    def __init__(self) -> None:
        import shutil

        if shutil.which("unshare") is None:
            pytest.skip("unshare (util-linux) is not installed")
        probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=4k zipmoe-test /dev/shm"],
                               capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            pytest.skip(f"a private mount namespace with its own /dev/shm is not allowed here: "
                        f"{probe.stderr.strip() or probe.returncode}")

    def prefix(self) -> tuple[str, ...]:
        return ("unshare", "-m", "/bin/sh", "-c", 'mount -t tmpfs -o size=4k zipmoe-test /dev/shm && '
                '{ cat /dev/zero > /dev/shm/fill; } 2>/dev/null; exec "$@"', "sh")


def test_serve_keeps_serving_with_a_fixed_budget_when_dev_shm_is_full(llama_lib_dir: Path,
                                                                        small_models: tuple[Path, Path],
                                                                        tmp_path: Path) -> None:
    """A full /dev/shm: the control file cannot be allocated, and `zipmoe serve --memory-budget` says so in one
    warning and serves with its budget fixed (the old code sized the file sparse with ftruncate and died of SIGBUS
    at its first store, before llama-server started)."""
    _, packed = small_models
    log = tmp_path / "serve.log"
    server = Server(llama_lib_dir, packed, log, cg=FullShm(), budget="auto")  # type: ignore[arg-type]
    try:
        assert server.complete(4)["content"] is not None
        assert server.proc.poll() is None
        text = log.read_text()
        warnings = [ln for ln in text.splitlines() if ln.startswith("zipmoe: warning:")]
        assert len(warnings) == 1, text[-3000:]
        assert "no room for the control file in /dev/shm" in warnings[0], warnings
        assert "the memory budget stays fixed at" in warnings[0], warnings
        assert "Traceback" not in text
        child, = _children(server.proc.pid)  # llama-server: the budget, and no control file to follow
        environ = dict(v.split("=", 1) for v in Path(f"/proc/{child}/environ").read_text().split("\0") if "=" in v)
        assert "ZIPMOE_MEMORY_BUDGET" in environ and "ZIPMOE_CONTROL" not in environ
    finally:
        server.close()


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _running(pid: int) -> bool:
    """Whether pid runs (a zombie nobody has reaped yet does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.parametrize("budget", [None, "auto"], ids=["unsupervised", "supervised"])
def test_kill_9_of_serve_leaves_no_llama_server(llama_lib_dir: Path, small_models: tuple[Path, Path],
                                                tmp_path: Path, budget: str | None) -> None:
    """`kill -9` of `zipmoe serve` (no handler of its runs): within a second no llama-server of that run is left
    (the old code's kept listening, unsupervised, its budget no longer followed); a control file the supervisor
    left is removed when the next one starts."""
    import signal

    from pyzipmoe.runtime import supervise

    _, packed = small_models
    server = Server(llama_lib_dir, packed, tmp_path / "serve.log", budget=budget)
    try:
        zipmoe = server.proc.pid
        children = _children(zipmoe)
        assert len(children) == 1 and Path(f"/proc/{children[0]}/exe").resolve().name == "llama-server", children
        child = children[0]
        left = sorted(supervise.control_folder().glob(f"{supervise.CONTROL_PREFIX}{zipmoe}-*"))
        assert len(left) == (1 if budget else 0), left
        os.kill(zipmoe, signal.SIGKILL)
        server.proc.wait(10)
        deadline = time.monotonic() + 1.0
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _running(child), "llama-server outlived zipmoe serve by more than a second"
        assert all(p.exists() for p in left)  # nobody ran to remove it ...
        supervise.ControlFile.create().close()  # ... until the next supervisor starts
        assert not any(p.exists() for p in left)
    finally:
        server.close()
