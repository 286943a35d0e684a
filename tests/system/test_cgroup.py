"""zipmoe inside a cgroup v1 memory limit smaller than the BF16 model: it completes, with the BF16 model's tokens.

The model is the "small" synthetic preset (61 MiB of BF16: 48 MiB of experts in 4 layers of 16, 13 MiB of other
weights). The limit is 85 % of the BF16 file (52 MiB) and ZIPMOE_MEMORY_BUDGET is the limit less MARGIN (the
program's own memory: heap, thread stacks, KV cache and compute buffers, a few MiB here), 40 MiB: room for the 13
MiB of other weights, one expert tensor's experts in flight (4 MiB) and 23 MiB of cache tiers, so the runtime must
evict. The limit is meaningful at this size: llama-simple's own memory besides the model is about 5 MiB (a run of
the BF16 model with its file already cached peaks at 4.6 MiB in its cgroup), while zipmoe with an unbounded cache
peaks at about 92 MiB, and a runtime that ignored the budget was OOM-killed in this limit (measured while writing
this test). The zipmoe file is evicted from the page cache before the run (fsync + POSIX_FADV_DONTNEED on that
file only; nothing system-wide), so that what the run reads from it is charged to its cgroup.

The cgroup code is tools/bench/bench_budget.py's (run_limited), so this also exercises the benchmark's plumbing.
Needs root, the cgroup v1 memory controller and zipmoe's llama.cpp build (llama-simple); skipped without them.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest
from helpers import load_tool, unavailable

PROMPT = "Once upon a time"
N_GEN = 8
LIMIT_SHARE = 0.85  # of the BF16 file
MARGIN = 12 << 20  # the program's own memory, outside ZIPMOE_MEMORY_BUDGET
TIMEOUT = 50  # seconds; a run that thrashes this long has lost already


def _bench_module() -> ModuleType:
    return load_tool("bench/bench_budget.py")


def _evict(path: Path) -> None:
    """Drops one file's pages from the page cache, so that reading it is charged to the reader's cgroup."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _run_tg(bench, argv: list[str], env: dict[str, str], cgroup_parent: Path, limit: int | None, stem: Path,
            completion: bool) -> dict:
    """bench_budget's tg run, parsed; once more where llama-completion exited 0 without its perf lines. Its log is
    written by a thread of its own, which on a loaded machine sometimes loses the lines it had queued at exit (seen
    for the BF16 model too, about 1 run in 20 beside two builds): that says nothing of the run, and the benchmark
    reports such a run as failed rather than guessing its speed."""
    for attempt in range(2):
        res = bench.run_limited(argv, env, cgroup_parent, limit, TIMEOUT, stem.with_name(f"{stem.name}-{attempt}"),
                                drop_cache=False)
        if res["status"] != "ok":
            return res
        bench.parse_tg(res, completion=completion)
        if res["status"] == "ok" or not completion:
            return res
    return res  # (parse_tg's "failed": the perf lines were lost twice)


@pytest.mark.parametrize("program,threads", [("llama-simple", None), ("llama-completion", 2)])
def test_zipmoe_completes_in_a_limit_below_the_bf16_model(llama_lib_dir: Path, cgroup_parent: Path,
                                                          small_models: tuple[Path, Path], tmp_path: Path,
                                                          program: str, threads: int | None) -> None:
    """bench_budget's tg, as llama-simple and as llama-completion (--tg-threads)."""
    from pyzipmoe.runtime import runner

    tool = llama_lib_dir / program
    if not tool.is_file():
        unavailable(f"{tool} was not built")
    bench = _bench_module()
    bf16, packed = small_models
    limit = int(bf16.stat().st_size * LIMIT_SHARE)
    assert limit < bf16.stat().st_size
    from pyzipmoe.runtime.config import RUNTIME_ENV

    base = runner.environment(base={k: v for k, v in os.environ.items() if k not in RUNTIME_ENV})

    # the reference: the BF16 model, no limit
    completion = threads is not None
    ref = _run_tg(bench, bench.tg_argv(tool, str(bf16), N_GEN, PROMPT, threads), base, cgroup_parent, None,
                  tmp_path / "bf16", completion)
    assert ref["status"] == "ok", f"the BF16 run failed: {ref.get('message')}\n{ref['stderr_tail']}"
    assert ref.get("tokens") == N_GEN, ref["stderr_tail"]

    _evict(packed)
    env = {**base, "ZIPMOE_MEMORY_BUDGET": str(limit - MARGIN)}
    got = _run_tg(bench, bench.tg_argv(tool, str(packed), N_GEN, PROMPT, threads), env, cgroup_parent, limit,
                  tmp_path / "zipmoe", completion)
    where = (f"limit {limit / 2**20:.1f} MiB, ZIPMOE_MEMORY_BUDGET {(limit - MARGIN) / 2**20:.1f} MiB, "
             f"peak {got.get('peak_bytes', 0) / 2**20:.1f} MiB, failcnt {got.get('failcnt')}")
    assert got["status"] != "oom", f"zipmoe was OOM-killed ({where})"
    assert got["status"] != "timeout", f"zipmoe took more than {TIMEOUT} s ({where}): thrashing?"
    assert got["status"] == "ok", f"zipmoe failed ({where}): {got.get('message')}\n{got['stderr_tail']}"
    assert got["limit_bytes"] == limit and got["peak_bytes"] <= limit
    assert got.get("tokens") == N_GEN, got["stderr_tail"]
    assert got["text"] == ref["text"], f"zipmoe generated other tokens than BF16 ({where})"


def test_a_read_throttle_slows_the_run_s_reads_to_its_rate(cgroup_parent: Path, tmp_path: Path) -> None:
    """bench_budget --read-rate: a run in the throttle reads a file no faster than the rate (direct reads, so that
    nothing comes from the page cache), and the cgroups it made are gone afterwards."""
    bench = _bench_module()
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(3 << 20))
    rate = 1 << 20
    try:
        throttle = bench.ReadThrottle(rate, data)
    except bench.BenchError as e:
        pytest.skip(str(e))
    argv = ["dd", f"if={data}", "of=/dev/null", "bs=1M", "iflag=direct"]
    got = bench.run_limited(argv, dict(os.environ), cgroup_parent, None, TIMEOUT, tmp_path / "dd", throttle=throttle)
    assert got["status"] == "ok", got.get("stderr_tail")
    assert got["wall_s"] >= 0.8 * (3 << 20) / rate, got["wall_s"]  # ~3 s at 1 MiB/s; unthrottled, milliseconds
    mine = f"zipmoe-bench-{os.getpid()}-*"  # (a killed benchmark may have left its own behind)
    assert not list(throttle.parent.glob(mine)) and not list(cgroup_parent.glob(mine))


@pytest.mark.parametrize("pp,worst", [({40: 0.99, 60: 1.2, 100: 0.88}, (100, 0.88)), ({40: 1.1, 60: 1.05}, (None, 1.05))])
def test_the_never_slower_target_names_the_budget_of_its_lowest_ratio(pp: dict[int, float], worst: tuple) -> None:
    """The report's 'lowest ratio at B%' must be one row's pair: it once named the first budget below 1x beside the
    lowest ratio of all (0.88x at 100% printed as 'lowest 0.88x at 40%', where 40% measured 0.99x)."""
    bench = _bench_module()
    rows = [{"budget_pct": b, "tg_ratio": 2.0, "pp_ratio": x, "zipmoe_keeps": None} for b, x in pp.items()]
    target = next(t for t in bench.check_targets(rows, list(pp)) if t["target"].startswith("never slower (pp"))
    assert (target["budget_pct"], target["ratio"], target["met"]) == (*worst, worst[0] is None)
