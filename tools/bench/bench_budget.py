#!/usr/bin/env python3
"""zipmoe against stock llama.cpp inside the same memory limit: tokens/s when the model does not fit in RAM.

What it measures. A BF16 MoE GGUF that is larger than the memory a process may use runs, in stock llama.cpp,
from its mmap: the kernel keeps what fits of the file in the page cache and reads the rest again whenever a
token needs it (thrashing, at disk speed). zipmoe runs the converted GGUF (experts ~2/3 of BF16, bit-exact)
with a tiered expert cache sized to a budget. This benchmark puts both, one run at a time, in a cgroup v1
memory limit of a fraction of the BF16 file's size (--budgets, default 40,60,80,93,100,150 %), plus one run
without a limit, for a model with uniform and one with skewed routing, and measures

  tg  `llama-simple -m MODEL -n GEN PROMPT`: greedy generation from a fixed prompt, its own "decoded N tokens
      in X s, speed: Y t/s" line (the issue's reference numbers: stock llama.cpp, mmap, llama-simple, 32
      tokens, cold page cache; its timer covers the prompt's batch and GEN - 1 single-token steps). The
      generated text must be the same for zipmoe and stock: MATCH / DIFF.
      With --tg-threads N: `llama-completion -m MODEL -n GEN -p PROMPT -no-cnv --no-display-prompt --temp 0
      --no-warmup -t N -c C -b C -ub C` (C = GEN + 64; tg_argv) instead, the same greedy generation with a thread
      count of choice; tokens/s counted as llama-simple counts them, GEN tokens over the prompt's batch and GEN - 1
      steps (its perf lines).
  pp  `llama-bench -m MODEL -p PP -n 0 -r REPS -t THREADS -o json -v`: prompt processing, tokens/s, the mean
      of REPS timed passes (--pp-reps, default 5 as llama-bench's own) after its untimed warm-up pass (-v: so
      that its stderr says why a model did not load). One pass of 512 tokens is ~2 s here, and stock's passes
      under a limit that thrashes a little vary by up to 1.7x within one process: one pass a run measured that
      spread, not the engines.

Stock is llama.cpp built from the same sdist without zipmoe's patches (--stock-bin, default build/llama-stock/bin
from tools/dev/build_stock.sh), its programs loading its own libraries; zipmoe runs this build's. Without a stock
build, stock runs on zipmoe's build with no budget (the tests show it gives stock's logits, and bench_stock its
speed), and the report says which it was.

and, for every run, the cgroup's peak usage (memory.max_usage_in_bytes: anonymous memory and page cache
charged to it) and the bytes read from disk (the child's rusage ru_inblock x 512), shown per generated token.
Every run starts cold: `sync; echo 1 > /proc/sys/vm/drop_caches` before it, in a fresh cgroup, so the file
pages it reads are charged to its own limit. A run killed by the kernel's OOM killer is reported as OOM, one
that exceeds --timeout as timeout; the benchmark goes on.

zipmoe is told its budget with ZIPMOE_MEMORY_BUDGET = limit - --overhead (default 256 MiB: KV cache, compute
buffers, the program, allocator slack; printed with the results). --overhead auto measures it before the
runs instead: zipmoe refuses a 1 MiB budget with its minimum M, then runs cold without a limit at a budget of M + 16
MiB, with tg's program and with pp's; the overhead is the larger of the two runs' peak resident set less that
budget, + 8 MiB (not the cgroup's peak, which without a limit keeps the page cache of every read). A limit that leaves
zipmoe less than M after the overhead is named in a warning (the model is too small for it: --synth). The budget means everything the model keeps
resident (non-expert weights, expert cache tiers, one expert tensor's working set); a budget the runtime refuses as too
small is reported as such. --zipmoe-env passes more variables (policy, tier shares, a plan) to zipmoe runs.
Stock runs get no ZIPMOE_* variables.

--variant-env KEY=VAL and --variant-lib DIR add a second zipmoe, measured in the same alternation (stock,
zipmoe, stock, variant at each limit and repetition) and reported against the first: an option or an older
libggml-zipmoe.so (--variant-lib: a directory put first on LD_LIBRARY_PATH) compared where the machine's drift
and the host's disk cache cannot take sides. A change's A/B belongs here, not in separate benchmark runs.

Plain GGUFs of another type (--type Q4_K_M, Q8_0, F16, ...: llama-quantize's copy of the synthetic BF16 model):
both engines run that file, zipmoe serving its experts as stored under the budget; with --convert zipmoe runs its
`pyzipmoe convert` instead (--codec auto by default: the converter's choice per type, e.g. zstd for F16) and the
targets are a converted model's. Limits are then % of that type's file. Stock llama.cpp repacks Q4_K and Q8_0
weights at load into anonymous CPU_REPACK buffers (its log's "CPU_REPACK model buffer size"), which a limit cannot
page out as it can the mmap: below about the file's size it is OOM-killed. --stock-no-repack also runs stock with
llama.cpp's own --no-repack (llama-bench --repack 0) in the same alternation, column stock-nr; ratios are against the
faster stock that ran. A limit where no stock ran (OOM) and zipmoe did is reported as such ("stock OOM", the target
met: zipmoe runs where stock cannot); where the stocks that were not OOM-killed ran past --timeout, the ratio is
bounded by whole runs, > timeout / zipmoe's wall time. --synth FIELD=N changes the preset's shape (make_synth.py's
overrides, e.g. n_layer=16 n_vocab=4096: experts a larger share of the file, so that 40 % of a quantized file still
leaves zipmoe its minimum); the models' names carry the overrides.

--read-rate BYTES/S throttles every run's reads from the models' disk (a cgroup v1 blkio throttle, stock's and
zipmoe's alike, direct and buffered reads): an edge device's eMMC, UFS or SD card instead of this machine's disk,
where a miss costs more than the cores' decode and compressed tiers pay (try --variant-env ZIPMOE_HOT_SHARE=0).
The targets are set for the machine's own disk.

The models are synthetic (random weights, made by tools/dev/make_synth.py --preset PRESET [--routing skewed] and
converted with `python -m pyzipmoe convert --codec CODEC`), kept in --workdir and reused while they exist. --codec
defaults to esc where this CPU decodes it with SIMD (AVX-512 VBMI2: its warm hits cost a quarter of huff's, and the
runtime's default split keeps every expert compressed where they nearly all fit), else huff, the converter's own
default (2-3% smaller). The output labels
them synthetic. llama-simple has no thread option: it computes with llama.cpp's default of 4 threads, twice the
cores of a 2-core machine, which costs zipmoe more than stock (a thread that waits for a read gives its core to a
thread that then waits at ggml's barrier). --tg-threads N (e.g. the core count, as llama-cli's default) measures
both with N threads instead. llama-bench uses --threads (default 2, the issue's reference setting).

Needs root (cgroups, drop_caches) and the cgroup v1 memory controller (/sys/fs/cgroup/memory). The cgroups
are made under this process's own memory cgroup (--cgroup-parent to choose another), named
zipmoe-bench-<pid>-<n>, and removed after each run.

The issue's targets (tg, zipmoe / stock at the same limit): >= 5x at ~75 %, >= 4x at ~60 %, >= 2x at ~40 %,
>= 1.5x at ~93 %, within 3 % at 150 % (at least 0.97x), never slower (>= 1x below 150 %; pp shown too); a
converted model of another type (--convert) has the same. A plain GGUF's, at % of its own file: >= 4x at ~40 %,
>= 2.5x at ~60 %, >= 1.5x at ~75 %, >= 1x at ~100 %, within 3 % at 150 %, never slower. Each is checked at the
measured budget nearest to it (within 7 points) and printed as met / NOT met; with --stock-no-repack against the
faster stock, and again against stock as it is (whose logits zipmoe's equal).

Examples:
  sudo .venv/bin/python tools/bench/bench_budget.py                        # 2.8g preset, both routings, about an hour
  sudo .venv/bin/python tools/bench/bench_budget.py --budgets 40,60,75,80,93,100,150 --json budget.json --plot budget.png
  sudo .venv/bin/python tools/bench/bench_budget.py --routings skewed --tests tg --zipmoe-env ZIPMOE_CACHE_POLICY=lru
  sudo .venv/bin/python tools/bench/bench_budget.py --budgets 75 --tests tg --repeat 3 --variant-env ZIPMOE_PREDICT=1
      # an option against the default, in the same alternation
  sudo .venv/bin/python tools/bench/bench_budget.py --budgets 60,75 --tests tg --read-rate 400MiB \
      --variant-env ZIPMOE_HOT_SHARE=0                                 # slow storage: decoded-only against warm-only
  sudo .venv/bin/python tools/bench/bench_budget.py --preset small --overhead 16MiB --gen 16 --pp 64   # smoke, ~1 min
  sudo .venv/bin/python tools/bench/bench_budget.py --preset 1g --synth n_layer=16 --synth n_vocab=4096 \
      --type Q4_K_M --routings uniform --budgets 40,60,75,100,150 --tg-threads 2 --stock-no-repack --overhead auto
      # a plain Q4_K_M GGUF, stock with and without repacking
  sudo .venv/bin/python tools/bench/bench_budget.py --preset 1g --synth n_layer=16 --synth n_vocab=4096 \
      --type F16 --convert --routings uniform --tg-threads 2 --overhead auto     # F16, converted
  .venv/bin/python tools/bench/bench_budget.py --report budget.json --plot budget.png   # the tables again, no runs
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from itertools import product
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results.py and failures.py, beside this script
import results as result_files  # noqa: E402
from failures import one_line_errors  # noqa: E402
from pyzipmoe.paths import stock_bin_dir  # noqa: E402

DEFAULT_WORKDIR = REPO / "build" / "bench-budget"
DEFAULT_BUDGETS = "40,60,80,93,100,150"
DEFAULT_PROMPT = "Once upon a time"
MIB = 1 << 20
# (budget % of the BF16 file, least tg speed-up of zipmoe over stock)
SPEEDUP_TARGETS = ((75, 5.0), (60, 4.0), (40, 2.0), (93, 1.5))
# a plain GGUF of another type (--type), served as stored, no conversion: (budget % of its file, least tg speed-up)
PLAIN_TARGETS = ((40, 4.0), (60, 2.5), (75, 1.5), (100, 1.0))
STOCK_ENGINES = ("stock", "stock-nr")  # stock llama.cpp as it is, and with --no-repack (--stock-no-repack)
PARITY_BUDGET, PARITY_TOLERANCE = 150, 0.03  # "within 3 % at 150 %": at least 0.97x
TARGET_SLACK = 7  # a target at ~P % is checked at the measured budget nearest to P, if within this many points
KEEP_BUDGET, KEEP_SHARE = 75, 0.5  # "at ~75 % it should keep at least half of the unconstrained tokens/s"
TG_LINE = re.compile(r"decoded (\d+) tokens in ([0-9.]+) s, speed: ([0-9.]+) t/s")
PERF_LINE = re.compile(r"(prompt eval|eval) time =\s*([0-9.]+) ms /\s*(\d+) (?:tokens|runs)")
OVERHEAD_MARGIN = 8 * MIB  # --overhead auto: on top of the measured peak, for run-to-run variation of the allocator
CALIBRATION_SLACK = 16 * MIB  # --overhead auto measures at zipmoe's minimum budget + this (the message rounds it)
MIN_SIZE = re.compile(r"(?:min(?:imum)?|at least|needs?|requires?)\D{0,24}?(\d+(?:\.\d+)?)\s*([KMGT]i?B|bytes|B)?",
                      re.IGNORECASE)


class BenchError(Exception):
    pass


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    from pyzipmoe.runtime.budget import parse_budget

    if text.strip().endswith("%") or text.strip().lower() == "auto":
        raise BenchError(f"{text!r}: give a size (e.g. 256MiB)")
    return parse_budget(text)


# --------------------------------------------------------------------------------------- cgroup v1 memory


def memory_mount() -> Path:
    """Where the cgroup v1 memory hierarchy is; BenchError if there is none."""
    from pyzipmoe.cgroup import v1_mount

    mount = v1_mount("memory")
    if mount is not None:
        return mount
    raise BenchError("the cgroup v1 memory controller is not mounted (no /sys/fs/cgroup/memory; on a cgroup "
                     "v2-only system, boot with systemd.unified_cgroup_hierarchy=0 or mount it: "
                     "mount -t cgroup -o memory none /sys/fs/cgroup/memory)")


def own_cgroup_dir(controller: str) -> Path:
    """This process's cgroup in the v1 hierarchy of `controller` (pyzipmoe.runtime.memory's); BenchError if none."""
    from pyzipmoe.runtime.memory import own_cgroup_dir as own

    parent = own(controller)
    if parent is None:
        raise BenchError(f"this process has no cgroup v1 {controller} hierarchy (/proc/self/cgroup names none under "
                         "/sys/fs/cgroup)")
    return parent


class ReadThrottle:
    """A cgroup v1 blkio throttle on the disk that holds the models (--read-rate): slower storage than this
    machine's, an eMMC or SD card's, for stock and zipmoe alike. Direct and buffered reads are both throttled (the
    reads of a page fault or a pread are the reader's own, charged to its cgroup)."""

    def __init__(self, rate: int, model: Path) -> None:
        try:
            self.parent = own_cgroup_dir("blkio")
        except BenchError as e:
            raise BenchError(f"--read-rate needs the cgroup v1 blkio controller: {e}") from None
        if not (self.parent / "blkio.throttle.read_bps_device").exists():
            raise BenchError(f"{self.parent} has no blkio.throttle.read_bps_device: the kernel lacks block throttling")
        dev = os.stat(model).st_dev
        block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
        if (block / "partition").exists():  # throttles apply to whole disks
            block = block.resolve().parent
        try:
            self.device = (block / "dev").read_text().strip()
        except OSError as e:
            raise BenchError(f"{model} is not on a block device this can throttle ({block}: {e.strerror or e})") from e
        self.rate = rate

    def make(self, name: str) -> Path:
        path = self.parent / name
        path.mkdir()
        try:
            (path / "blkio.throttle.read_bps_device").write_text(f"{self.device} {self.rate}")
        except OSError:
            path.rmdir()
            raise
        return path


def check_environment(parent_arg: str | None) -> Path:
    """The directory the benchmark's cgroups are made in; BenchError when it cannot work here."""
    if os.geteuid() != 0:
        raise BenchError("must run as root: it makes cgroups and drops the page cache "
                         "(sudo .venv/bin/python tools/bench/bench_budget.py ...)")
    mount = memory_mount()
    if parent_arg is None:
        parent = own_cgroup_dir("memory")
    else:
        p = Path(parent_arg)
        parent = p if str(p).startswith(str(mount)) else mount / str(p).lstrip("/")
    for name in ("memory.limit_in_bytes", "memory.max_usage_in_bytes", "cgroup.procs"):
        if not (parent / name).exists():
            raise BenchError(f"{parent} is not a cgroup v1 memory cgroup (no {name})")
    if not os.access(parent, os.W_OK):
        raise BenchError(f"cannot make cgroups in {parent}")
    try:
        with open("/proc/sys/vm/drop_caches", "w"):
            pass
    except OSError as e:
        raise BenchError(f"cannot drop the page cache (/proc/sys/vm/drop_caches: {e.strerror or e})") from e
    return parent


def ancestor_limit(parent: Path, mount: Path) -> int:
    """The smallest memory limit on the way from parent up to the hierarchy's root."""
    least = 1 << 62
    d = parent
    while True:
        try:
            least = min(least, int((d / "memory.limit_in_bytes").read_text()))
        except (OSError, ValueError):
            pass
        if d == mount or d == d.parent:
            return least
        d = d.parent


def swap_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("SwapTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


class Cgroup:
    """One fresh memory cgroup: made with its limit, the child attached by writing its pid to cgroup.procs,
    removed afterwards."""

    count = 0

    def __init__(self, parent: Path, limit: int | None, throttle: ReadThrottle | None = None) -> None:
        Cgroup.count += 1
        name = f"zipmoe-bench-{os.getpid()}-{Cgroup.count}"
        from pyzipmoe.runtime.memory import make_memory_cgroup

        self.path = make_memory_cgroup(parent / name, limit)
        self.io: Path | None = None
        try:
            if throttle is not None:
                self.io = throttle.make(name)
        except OSError:
            self.remove()
            raise
        self.procs = [str(self.path / "cgroup.procs")] + ([str(self.io / "cgroup.procs")] if self.io else [])

    def read(self, name: str) -> str:
        try:
            return (self.path / name).read_text()
        except OSError:
            return ""

    def stats(self) -> dict[str, int]:
        out = {}
        for key, name in (("peak_bytes", "memory.max_usage_in_bytes"), ("failcnt", "memory.failcnt"),
                          ("cgroup_limit_bytes", "memory.limit_in_bytes")):
            try:
                out[key] = int(self.read(name).strip())
            except ValueError:
                pass
        for line in self.read("memory.oom_control").splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill" and v.strip().isdigit():
                out["oom_kill"] = int(v)
        return out

    def remove(self) -> None:
        from pyzipmoe.runtime.memory import remove_cgroup

        for path in (self.path, self.io):
            if path and not remove_cgroup(path):
                say(f"warning: could not remove {path}")


def run_limited(argv: list[str], env: dict[str, str], parent: Path, limit: int | None, timeout: float,
                log_stem: Path, drop_cache: bool = True, throttle: ReadThrottle | None = None) -> dict[str, Any]:
    """Runs argv in a fresh cgroup with the given memory limit (None: no limit), cold unless drop_cache is
    false, and returns what happened: status ok / oom / timeout / failed / too-small, exit code or signal, wall
    time, the cgroup's peak usage and failcnt, the rusage, zipmoe's budget line, and stdout and stderr (also
    kept in log_stem.out / .err)."""
    # (not with_suffix: a stem like 2.8g-uniform-40-... has a "suffix", and every run's logs were 2.out and 2.err)
    out_path, err_path = log_stem.with_name(log_stem.name + ".out"), log_stem.with_name(log_stem.name + ".err")
    cg = Cgroup(parent, limit, throttle)
    pid = None
    try:
        if drop_cache:
            drop_page_cache()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            t0 = time.monotonic()
            # the shell puts itself in the cgroups, then becomes argv (same pid: wait4's rusage is argv's)
            proc = subprocess.Popen(["/bin/sh", "-c", 'for f in $0; do echo $$ > "$f" || exit 125; done; exec "$@"',
                                     " ".join(cg.procs), *argv], env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
            pid = proc.pid
            timed_out = False
            while True:
                wpid, status, ru = os.wait4(pid, os.WNOHANG)
                if wpid == pid:
                    break
                if time.monotonic() - t0 > timeout:
                    timed_out = True
                    os.killpg(pid, signal.SIGKILL)
                    _, status, ru = os.wait4(pid, 0)
                    break
                time.sleep(0.05)
            wall = time.monotonic() - t0
            proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
            pid = None
        stats = cg.stats()
    finally:
        if pid is not None:  # interrupted: leave nothing behind
            try:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass
        cg.remove()
    stdout = out_path.read_text(errors="replace")
    stderr = err_path.read_text(errors="replace")
    res: dict[str, Any] = {
        "argv": argv, "limit_bytes": limit, "wall_s": wall, "timeout_s": timeout,
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "disk_read_bytes": ru.ru_inblock * 512, "major_faults": ru.ru_majflt, "maxrss_bytes": ru.ru_maxrss * 1024,
        "user_s": ru.ru_utime, "sys_s": ru.ru_stime, **stats, "log": str(log_stem),
    }
    plan = [ln.strip() for ln in stderr.splitlines() if "zipmoe: memory budget" in ln]
    if plan:
        res["zipmoe_budget_line"] = plan[0]
    too_small = [ln.strip() for ln in stderr.splitlines()
                 if ("too small" in ln.lower() or "below the minimum" in ln) and "destination buffer" not in ln.lower()]
    if timed_out:
        res["status"] = "timeout"
    elif stats.get("oom_kill", 0) > 0 and res["exit_code"] != 0:
        res["status"] = "oom"
    elif res["exit_code"] == 0:
        res["status"] = "ok"
    elif too_small:
        res["status"] = "too-small"
        res["message"] = too_small[0]
        m = MIN_SIZE.search(too_small[0])
        if m:
            res["min_budget"] = m.group(1) + (m.group(2) or "")
    else:
        res["status"] = "failed"
        lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower()]
        res["message"] = (errors or lines or [f"exit {res['exit_code']}, signal {res['signal']}"])[-1]
    res["stdout"], res["stderr_tail"] = stdout, stderr[-4000:]
    return res


# ------------------------------------------------------------------------------------------ the models


def default_bench_codec() -> str:
    """esc where this CPU runs its SIMD decoder, else huff (the converter's default)."""
    from pyzipmoe.file import codec

    return "esc" if codec.esc_simd_level() > 0 else "huff"


def model_tag(preset: str, synth: list[tuple[str, int]] | None = None) -> str:
    """The models' name stem for a preset with make_synth overrides: 1g+n_layer16+n_vocab4096."""
    return preset + "".join(f"+{k}{v}" for k, v in sorted(synth or []))


def ensure_plain(workdir: Path, bf16: Path, qtype: str, regenerate: bool) -> Path:
    """llama-quantize's `qtype` copy of the synthetic model `bf16` (PRESET-ROUTING.QTYPE.gguf), made when missing,
    older than it, or asked to: the plain GGUF that both engines run under --type, zipmoe without converting it."""
    from pyzipmoe import synth

    plain = workdir / f"{bf16.stem}.{qtype}.gguf"
    if regenerate or not plain.is_file() or plain.stat().st_mtime < bf16.stat().st_mtime:
        say(f"quantizing it to {plain} ({qtype}, llama-quantize) ...")
        try:
            synth.quantize(bf16, plain, qtype)
        except (OSError, RuntimeError) as e:
            raise BenchError(str(e)) from None
    return plain


def ensure_models_bf16(workdir: Path, preset: str, routing: str, regenerate: bool,
                       synth: list[tuple[str, int]] | None = None) -> Path:
    """workdir/TAG-ROUTING.gguf, the synthetic BF16 model (TAG: model_tag, the preset and make_synth's overrides),
    made when missing (or asked to), reused otherwise."""
    workdir.mkdir(parents=True, exist_ok=True)
    tag = model_tag(preset, synth)
    bf16 = workdir / f"{tag}-{routing}.gguf"
    if regenerate or not bf16.is_file():
        part = workdir / f"{tag}-{routing}.part.gguf"
        say(f"generating {bf16} (synthetic, preset {tag}, {routing} routing) ...")
        t = time.monotonic()
        overrides = [a for k, v in sorted(synth or []) for a in (f"--{k.replace('_', '-')}", str(v))]
        _tool([sys.executable, str(REPO / "tools" / "dev" / "make_synth.py"), "--preset", preset, *overrides,
               "--routing", routing, "--quiet", str(part)])
        part.replace(bf16)
        say(f"  {bf16.stat().st_size / 2**30:.2f} GiB in {time.monotonic() - t:.0f} s")
    return bf16


def ensure_models(workdir: Path, preset: str, routing: str, threads: int, regenerate: bool,
                  codec: str = "huff", synth: list[tuple[str, int]] | None = None) -> tuple[Path, Path]:
    """workdir/TAG-ROUTING.gguf and its zipmoe GGUF in `codec` (TAG-ROUTING.zipmoe.gguf for huff, the name
    of earlier runs, else TAG-ROUTING.CODEC.zipmoe.gguf), made when missing (or asked to), reused otherwise."""
    bf16 = ensure_models_bf16(workdir, preset, routing, regenerate, synth)
    return bf16, ensure_converted(bf16, threads, regenerate, codec)


def ensure_converted(src: Path, threads: int, regenerate: bool, codec: str) -> Path:
    """`pyzipmoe convert --codec CODEC` of src beside it (STEM.zipmoe.gguf for huff, else STEM.CODEC.zipmoe.gguf),
    made when missing, older than src, or asked to."""
    bf16 = src
    packed = src.with_name(f"{src.stem}.zipmoe.gguf" if codec == "huff" else f"{src.stem}.{codec}.zipmoe.gguf")
    if regenerate or not packed.is_file() or packed.stat().st_mtime < bf16.stat().st_mtime:
        part = packed.with_name(packed.name.replace(".zipmoe.gguf", ".zipmoe.part.gguf"))
        say(f"converting it to {packed} ({codec}) ...")
        t = time.monotonic()
        _tool([sys.executable, "-m", "pyzipmoe", "convert", "--quiet", "--threads", str(threads), "--codec", codec,
               str(bf16), str(part)])
        part.replace(packed)
        say(f"  {packed.stat().st_size / 2**30:.2f} GiB in {time.monotonic() - t:.0f} s")
    return packed


def _tool(argv: list[str]) -> None:
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
        raise BenchError(f"{' '.join(argv[1:3])} failed: {lines[-1] if lines else done.returncode}")


# -------------------------------------------------------------------------------------- measurements


def parse_tg(res: dict[str, Any], completion: bool = False) -> None:
    """llama-simple's speed line (llama-completion's perf lines with completion), the perf counters and the generated
    text, into res."""
    stderr = res.pop("stderr_tail")
    res["stderr_tail"] = stderr[-1500:]
    for kind, ms, n in PERF_LINE.findall(stderr):
        key = "prompt_eval" if kind == "prompt eval" else "eval"
        res[f"{key}_ms"], res[f"{key}_n"] = float(ms), int(n)
    m = None if completion else TG_LINE.search(stderr)
    if m:
        res["tokens"], res["decode_s"], res["tps"] = int(m.group(1)), float(m.group(2)), float(m.group(3))
    elif res["status"] == "ok" and not (completion and completion_speed(res)):
        res["status"], res["message"] = "failed", (
            "no 'prompt eval time' and 'eval time' lines in llama-completion's output" if completion else
            "no 'decoded N tokens' line in llama-simple's output")
    res["text"] = res.pop("stdout").rstrip("\n")


def completion_speed(res: dict[str, Any]) -> bool:
    """llama-completion's tokens/s, counted as llama-simple counts: the prompt's batch gives the first token, each of
    the eval runs one more, over the time of both."""
    if "prompt_eval_ms" not in res or "eval_ms" not in res:
        return False
    res["tokens"] = res["eval_n"] + 1
    res["decode_s"] = (res["prompt_eval_ms"] + res["eval_ms"]) / 1000
    res["tps"] = res["tokens"] / res["decode_s"] if res["decode_s"] > 0 else None
    return res["tps"] is not None


def parse_pp(res: dict[str, Any], n_prompt: int) -> None:
    stdout = res.pop("stdout")
    res["stderr_tail"] = res["stderr_tail"][-1500:]
    if res["status"] != "ok":
        return
    try:
        rows = json.loads(stdout[stdout.index("["):])
        row = next(r for r in rows if r.get("n_prompt") == n_prompt and r.get("n_gen") == 0)
        res["tps"] = float(row["avg_ts"])
        res["tokens"] = n_prompt
        res["pp_samples"] = [float(v) for v in row.get("samples_ts") or []]
    except (ValueError, StopIteration, KeyError, TypeError):
        res["status"], res["message"] = "failed", "no pp result in llama-bench's JSON output"


def cell(res: dict[str, Any] | None, value: str) -> str:
    """A table cell: the value of a run that worked, else what went wrong."""
    if res is None:
        return "-"
    status = res["status"]
    if status == "ok":
        return value
    if status == "too-small":
        return f"too small (min {res['min_budget']})" if res.get("min_budget") else "too small"
    if status == "skipped":
        return res.get("short", "skipped")
    return {"oom": "OOM", "timeout": "timeout", "failed": "failed"}.get(status, status)


def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    """zipmoe / stock tokens/s when both ran."""
    if a and b and a["status"] == "ok" and b["status"] == "ok" and b.get("tps"):
        return a["tps"] / b["tps"]
    return None


def tg_argv(program: Path, model: str, gen: int, prompt: str, threads: int | None) -> list[str]:
    """The tg command: llama-simple (threads None: it has no option, llama.cpp's default of 4), or llama-completion
    with as many threads, the same greedy generation: no warm-up run (for an MoE it touches every expert, and each
    run must start cold) and a context of about llama-simple's size, so that both keep alike KV and compute buffers."""
    if threads is None:
        return [str(program), "-m", model, "-n", str(gen), prompt]
    ctx = str(gen + 64)
    return [str(program), "-m", model, "-n", str(gen), "-p", prompt, "-no-cnv", "--no-display-prompt", "--temp", "0",
            "--no-warmup", "-t", str(threads), "-c", ctx, "-b", ctx, "-ub", ctx]


def pp_argv(program: Path, model: str, pp: int, reps: int, threads: int, repack: bool = True) -> list[str]:
    """llama-bench's pp test; repack False: --repack 0, stock's weights kept in its mmap (stock-nr)."""
    return [str(program), "-m", model, "-p", str(pp), "-n", "0", "-r", str(reps), "-t", str(threads), "-o", "json",
            "-v", *([] if repack else ["--repack", "0"])]


def overhead_for(res: dict[str, Any], test: str) -> int:
    """The overhead of one test's runs: --overhead's size, or what measure_overhead found for that test."""
    o = res["overhead_bytes"]
    return o[test] if isinstance(o, dict) else o


def measure_overhead(argv: list[str], env: dict[str, str], parent: Path, timeout: float, log_stem: Path,
                     margin: int = OVERHEAD_MARGIN) -> dict[str, Any]:
    """What one zipmoe process needs besides its budget, measured: a run with a 1 MiB budget, which the runtime
    refuses with its minimum M, then a cold run without a limit and a budget of M + CALIBRATION_SLACK, which the
    cache fills; overhead = its peak resident set (anonymous memory and the mapped weights) - that budget + margin.
    Not the cgroup's peak: without a limit it keeps every page the process read through the page cache, which a
    limit reclaims (a plain Q8_0 GGUF's pp measured 378 MiB of cgroup peak against 126 MiB resident). BenchError if
    either run does not go as planned."""
    probe = run_limited(argv, {**env, "ZIPMOE_MEMORY_BUDGET": str(MIB)}, parent, None, timeout,
                        log_stem.with_name(log_stem.name + "-min"), drop_cache=False)
    if probe["status"] != "too-small" or not probe.get("min_budget"):
        raise BenchError(f"--overhead auto: a 1 MiB budget was not refused with a minimum ({probe['status']}: "
                         f"{probe.get('message', '')}; log {probe['log']}.err)")
    minimum = parse_size(probe["min_budget"])
    budget = minimum + CALIBRATION_SLACK
    one = run_limited(argv, {**env, "ZIPMOE_MEMORY_BUDGET": str(budget)}, parent, None, timeout,
                      log_stem.with_name(log_stem.name + "-peak"))
    if one["status"] != "ok" or not one.get("maxrss_bytes"):
        raise BenchError(f"--overhead auto: the run at zipmoe's minimum budget did not complete ({one['status']}: "
                         f"{one.get('message', '')}; log {one['log']}.err)")
    return {"min_budget_bytes": minimum, "budget_bytes": budget, "maxrss_bytes": one["maxrss_bytes"],
            "peak_bytes": one.get("peak_bytes"), "margin_bytes": margin,
            "overhead_bytes": max(0, one["maxrss_bytes"] - budget) + margin}


def overhead_of(measured: dict[str, dict[str, Any]]) -> int:
    """The one overhead of every run, from measure_overhead's per program: the largest. A tg run leaves rooms of the
    budget (a prompt's reads, a tensor in flight) partly unfilled at the minimum, so its own figure understates
    what the process needs beyond a budget it fills: a plain Q8_0 GGUF's tg measured 20 MiB, pp 91, and with 20
    zipmoe thrashed its mapped weights at 40 and 60 % (7-8 GB read for 16 tokens)."""
    return max(g["overhead_bytes"] for g in measured.values())


def engines_of(no_repack: bool, variant: bool) -> tuple[str, ...]:
    """The engines of one limit, in the order they alternate."""
    return ("stock", "zipmoe", *(("stock-nr",) if no_repack else ()), *(("stock", "variant") if variant else ()))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pyzipmoe.runtime import runner
    from pyzipmoe.runtime.config import RUNTIME_ENV

    parent = check_environment(args.cgroup_parent)
    mount = memory_mount()
    simple, bench = runner.program("llama-simple"), runner.program("llama-bench")
    completion = runner.program("llama-completion") if args.tg_threads else None
    base = {k: v for k, v in os.environ.items() if k not in RUNTIME_ENV}
    zipmoe_base = runner.environment(base=base)  # zipmoe's libraries first
    stock_env = dict(zipmoe_base)
    stock_bin = stock_programs(args.stock_bin)
    if stock_bin:  # stock's own libraries first: its programs load stock's libllama and ggml, not zipmoe's
        stock_env["LD_LIBRARY_PATH"] = runner.library_path(stock_bin, stock_env)
    else:
        say(f"warning: no stock build in {args.stock_bin} (tools/dev/build_stock.sh): stock runs on zipmoe's build "
            "without a budget, which the tests show gives stock's logits and speed")
    zipmoe_extra = dict(args.zipmoe_env)
    variant = bool(args.variant_env or args.variant_lib)
    variant_extra = dict(zipmoe_extra, **dict(args.variant_env))
    if args.variant_lib:
        variant_extra["LD_LIBRARY_PATH"] = runner.library_path(args.variant_lib.resolve(), os.environ)
    engines = engines_of(args.stock_no_repack, variant)
    tag = model_tag(args.preset, args.synth)
    # the logs' names: one grid's logs must not overwrite another type's or another read rate's
    run_tag = tag + ("" if args.type == "BF16" else f"-{args.type}{'-conv' if args.convert else ''}") \
        + (f"-read{args.read_rate // MIB}M" if args.read_rate else "")
    logdir = args.workdir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    if swap_total() and not (parent / "memory.memsw.limit_in_bytes").exists():
        say("warning: this machine has swap and no memory.memsw (swap accounting off): a limited run may swap "
            "instead of thrashing or being OOM-killed")

    models: dict[str, dict[str, Any]] = {}
    for routing in args.routings:
        if args.type != "BF16":  # a GGUF of that type for stock; zipmoe serves its experts as stored, or converted
            bf16 = ensure_models_bf16(args.workdir, args.preset, routing, args.regenerate, args.synth)
            plain = ensure_plain(args.workdir, bf16, args.type, args.regenerate)
            packed = ensure_converted(plain, args.threads, args.regenerate, args.codec) if args.convert else plain
            models[routing] = {"bf16": str(plain), "bf16_bytes": plain.stat().st_size, "zipmoe": str(packed),
                               "zipmoe_bytes": packed.stat().st_size}
            continue
        bf16, packed = ensure_models(args.workdir, args.preset, routing, args.threads, args.regenerate, args.codec,
                                     args.synth)
        models[routing] = {"bf16": str(bf16), "bf16_bytes": bf16.stat().st_size, "zipmoe": str(packed),
                           "zipmoe_bytes": packed.stat().st_size}
    largest = max(int(m["bf16_bytes"] * max(args.budgets) / 100) for m in models.values())
    above = ancestor_limit(parent, mount)
    if above < largest:
        say(f"warning: a cgroup above {parent} limits memory to {above / MIB:.0f} MiB, less than the largest "
            f"limit here ({largest / MIB:.0f} MiB): those runs are limited by it")

    def argv_of(engine: str, test: str, model: str) -> list[str]:
        def program(path: Path) -> Path:
            return stock_bin / path.name if stock_bin and engine.startswith("stock") else path

        if test == "tg":
            argv = tg_argv(program(completion or simple), model, args.gen, args.prompt, args.tg_threads)
            return argv + (["--no-repack"] if engine == "stock-nr" else [])
        return pp_argv(program(bench), model, args.pp, args.pp_reps, args.threads, repack=engine != "stock-nr")

    throttle = ReadThrottle(args.read_rate, Path(next(iter(models.values()))["bf16"])) if args.read_rate else None
    runs: list[dict[str, Any]] = []
    res = {"synthetic": True, "command": result_files.command_line(result_files.script_argv(__file__, args.argv)),
           "notes": list(args.note), "preset": tag, "synth_overrides": dict(args.synth), "codec": args.codec,
           "type": args.type, "converted": args.type == "BF16" or args.convert, "models": models,
           "budgets_pct": args.budgets, "read_rate_bytes": args.read_rate,
           "overhead_bytes": args.overhead, "gen_tokens": args.gen, "pp_tokens": args.pp, "pp_reps": args.pp_reps,
           "prompt": args.prompt,
           "threads_llama_bench": args.threads, "tg_threads": args.tg_threads,
           "timeout_s": args.timeout, "zipmoe_env": zipmoe_extra, "tests": args.tests, "repeat": args.repeat,
           "engines": list(dict.fromkeys(engines)),
           "variant": {"env": dict(args.variant_env), "lib": str(args.variant_lib or "")} if variant else None,
           "cgroup_parent": str(parent), "swap_bytes": swap_total(), "cpus": os.cpu_count(),
           "bin_dir": str(runner.bin_dir()), "stock_bin_dir": str(stock_bin or runner.bin_dir()),
           "stock_build": "stock" if stock_bin else "same", "runs": runs}
    if args.overhead is None:  # --overhead auto: on the first routing's model (the same shape for all)
        m = next(iter(models.values()))
        res["overhead_measured"] = {}
        for test in ("tg", "pp"):  # both, whatever --tests: the overhead is their largest (overhead_of)
            say(f"measuring zipmoe's overhead with {test}'s program (at its minimum budget, no limit) ...")
            got = measure_overhead(argv_of("zipmoe", test, m["zipmoe"]), {**zipmoe_base, **zipmoe_extra}, parent,
                                   args.timeout, logdir / f"{run_tag}-overhead-{test}")
            res["overhead_measured"][test] = got
            say(f"  minimum budget {got['min_budget_bytes'] / MIB:.0f} MiB; resident {got['maxrss_bytes'] / MIB:.0f} "
                f"MiB with a budget of {got['budget_bytes'] / MIB:.0f} MiB: {got['overhead_bytes'] / MIB:.0f} MiB "
                f"(with {got['margin_bytes'] / MIB:.0f} MiB of margin)")
        res["overhead_bytes"] = overhead_of(res["overhead_measured"])
        minimum = max(g["min_budget_bytes"] for g in res["overhead_measured"].values())
        for routing, m in models.items():
            short = [b for b in args.budgets if m["bf16_bytes"] * b / 100 - res["overhead_bytes"] < minimum]
            if short:
                say(f"warning: {routing}: the limits at {', '.join(f'{b:g}%' for b in short)} leave zipmoe less than "
                    f"its minimum budget ({minimum / MIB:.0f} MiB) after the overhead: a larger model (--synth) or "
                    f"higher limits")

    def checkpoint() -> None:
        """--json FILE holds the runs so far (a long benchmark stopped half-way keeps them)."""
        if args.json:
            args.json.write_text(json.dumps({**res, "partial": True}, indent=2) + "\n")

    n_total = len(args.routings) * (len(args.budgets) + 1) * len(engines) * len(args.tests) * args.repeat
    for routing in args.routings:
        m = models[routing]
        for budget in [None, *args.budgets]:
            limit = None if budget is None else int(m["bf16_bytes"] * budget / 100)
            # stock and zipmoe alternate, also across repetitions: this machine's virtual disk is cached by its host,
            # and a run right after a run of the same file reads it from the host's memory
            for test, rep, (slot, engine) in product(args.tests, range(args.repeat), enumerate(engines)):
                model = m["bf16"] if engine.startswith("stock") else m["zipmoe"]
                label = "unconstrained" if budget is None else f"{budget:g}%"
                rec: dict[str, Any] = {"routing": routing, "budget_pct": budget, "engine": engine, "test": test,
                                       "rep": rep}
                env = dict(stock_env if engine.startswith("stock") else zipmoe_base)
                if not engine.startswith("stock"):
                    env.update(variant_extra if engine == "variant" else zipmoe_extra)
                    if limit is not None:
                        overhead = overhead_for(res, test)
                        zbudget = limit - overhead
                        rec["zipmoe_budget_bytes"] = zbudget
                        if zbudget <= 0:
                            rec.update(status="skipped", short="limit < overhead",
                                       message=f"the limit ({limit / MIB:.0f} MiB) is not above the overhead "
                                               f"({overhead / MIB:.0f} MiB)", limit_bytes=limit)
                            runs.append(rec)
                            checkpoint()
                            say(f"[{len(runs)}/{n_total}] {routing} {label} {engine} {test}: skipped, "
                                f"{rec['message']}")
                            continue
                        env["ZIPMOE_MEMORY_BUDGET"] = str(zbudget)
                argv = argv_of(engine, test, model)
                stem = logdir / f"{run_tag}-{routing}-{label.rstrip('%')}-{engine}-{test}-{rep}-{slot}"
                lost = False
                for attempt in range(2):
                    one = run_limited(argv, env, parent, limit, args.timeout,
                                      stem if attempt == 0 else stem.with_name(stem.name + "-again"), throttle=throttle)
                    if test == "tg":
                        parse_tg(one, completion=completion is not None)
                    else:
                        parse_pp(one, args.pp)
                    # llama-completion's log thread sometimes loses its last lines at exit on a loaded machine
                    # (exit 0, no perf lines): that says nothing of the run, which is made once more
                    if not (one["status"] == "failed" and one.get("exit_code") == 0) or attempt:
                        break
                    lost = True
                rec.update(one, **({"lost_output_once": True} if lost else {}))
                rec["env"] = {k: v for k, v in env.items() if k.startswith("ZIPMOE_") or k == "LD_LIBRARY_PATH"}
                runs.append(rec)
                checkpoint()
                what = (f"{rec['tps']:.2f} t/s" if rec["status"] == "ok" else
                        f"{rec['status']}{': ' + rec['message'] if rec.get('message') else ''}")
                say(f"[{len(runs)}/{n_total}] {routing} {label} {engine} {test}: {what}, "
                    f"peak {rec.get('peak_bytes', 0) / MIB:.0f} MiB, read {rec['disk_read_bytes'] / MIB:.0f} MiB, "
                    f"{rec['wall_s']:.1f} s")
    return res


# ------------------------------------------------------------------------------------------ the limit model

RECORD_CHILD = """
import json, sys
import numpy as np
from pyzipmoe import Llama
from pyzipmoe.runtime.llama import last_logits
job = json.loads(sys.argv[1])
ctx = job["gen"] + 64
llm = Llama(job["model"], n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, n_threads=job["threads"], verbose=False,
            record_routing=True)
prompt = llm.tokenize(job["prompt"].encode())
llm.eval(prompt)
timed_from = llm.recorded_routing().n_steps
for _ in range(job["gen"] - 1):  # greedy; the prompt's step gave the first token
    llm.eval([int(np.argmax(last_logits(llm)))])
llm.save_routing(job["out"])
print(json.dumps({"timed_from": timed_from}))
"""


def record_env() -> dict[str, str]:
    """The recording child's environment: zipmoe's build, the runtime's defaults (no budget from outside)."""
    from pyzipmoe.runtime import runner
    from pyzipmoe.runtime.config import RUNTIME_ENV

    env = runner.environment(base={k: v for k, v in os.environ.items() if k not in RUNTIME_ENV})
    env["LLAMA_CPP_LIB_PATH"] = str(runner.bin_dir())
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def record_limit_inputs(res: dict[str, Any], threads: int) -> None:
    """For the limit model of every row (pyzipmoe/plan/limit.py; summarize computes it): each routing's zipmoe model
    run unlimited by pyzipmoe.Llama on tg's prompt, greedy, its routing recorded (routing does not depend on the
    budget), and this machine's calibration of the model's reads and decodes (zipmoe calibrate, through the stores).
    Kept in res["limit_inputs"]; a failure is noted there, not fatal."""
    from pyzipmoe.plan.limit import from_calibration
    from pyzipmoe.runtime.budget import model_memory
    from pyzipmoe.runtime.measure import calibrate

    out: dict[str, Any] = {}
    for routing, m in res["models"].items():
        path = Path(m["zipmoe"]).with_suffix(".routing.npz")
        job = {"model": m["zipmoe"], "gen": res["gen_tokens"], "prompt": res["prompt"], "threads": threads,
               "out": str(path)}
        try:
            done = subprocess.run([sys.executable, "-c", RECORD_CHILD, json.dumps(job)],
                                  env=record_env(), capture_output=True,
                                  text=True, timeout=res["timeout_s"], check=False)
            if done.returncode != 0:
                raise BenchError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed")
            rates, sizes = from_calibration(calibrate(m["zipmoe"], engine=False), compute_seconds_per_token=1.0,
                                            cores=threads)
            out[routing] = {"routing_file": str(path), "timed_from": json.loads(done.stdout.splitlines()[-1])[
                "timed_from"], "rates": vars(rates), "sizes": vars(sizes),
                "other_bytes": model_memory(m["zipmoe"]).other_bytes}
        except Exception as e:  # noqa: BLE001 (the limit is a report's extra: the runs stand without it)
            out[routing] = {"error": f"{type(e).__name__}: {e}"}
            say(f"warning: no limit model for {routing}: {out[routing]['error']}")
    res["limit_inputs"] = out


def row_limit(res: dict[str, Any], routing: str, z: dict[str, Any] | None,
              free: dict[str, Any] | None) -> dict[str, Any] | None:
    """The limit model for zipmoe's tg run z under its budget: the compute per token is zipmoe's own unconstrained
    tg's (free), the cache the budget less the weights that are not experts. llama-simple's speed counts the
    prompt's time too (its generated tokens over prompt and generation), so its limit does; llama-completion's
    eval speed is the generation's alone."""
    from pyzipmoe.plan import trace
    from pyzipmoe.plan.limit import ExpertSizes, Rates, limit

    got = (res.get("limit_inputs") or {}).get(routing)
    if not got or "error" in got or not z or not free or not z.get("tps") or not free.get("tps") \
            or not z.get("zipmoe_budget_bytes"):
        return None
    rates = Rates(**{**got["rates"], "compute_seconds_per_token": 1 / free["tps"]})
    recorded = trace.load(got["routing_file"])
    with_prompt = not res.get("tg_threads")
    try:
        lim = limit(recorded, rates, ExpertSizes(**got["sizes"]), z["zipmoe_budget_bytes"] - got["other_bytes"],
                    timed_from=0 if with_prompt else got["timed_from"])
    except ValueError as e:
        return {"error": str(e)}
    generated = int(recorded.tokens[got["timed_from"]:].sum()) + 1  # (the prompt's step gives the first token)
    tps = generated / lim.seconds if with_prompt else lim.tokens_per_second
    return {"tps": tps, "share": z["tps"] / tps, "hits": lim.hits / max(1, lim.routed), "layout": lim.layout}


# ------------------------------------------------------------------------------------------ the report


def _find(runs: list[dict[str, Any]], routing: str, budget: float | None, engine: str,
          test: str) -> dict[str, Any] | None:
    """The run of (routing, budget, engine, test); with --repeat, the repetition with the median tokens/s (the lower
    of the two middle ones), carrying the highest peak of them all and every repetition's tokens/s (tps_all). A
    failed repetition makes the whole a failure: it is the one returned."""
    found = [r for r in runs if (r["routing"], r["budget_pct"], r["engine"], r["test"]) == (routing, budget, engine, test)]
    if len(found) <= 1:
        return found[0] if found else None
    bad = [r for r in found if r["status"] != "ok" or r.get("tps") is None]
    if bad:
        return bad[0]
    ordered = sorted(found, key=lambda r: r["tps"])
    median = dict(ordered[(len(ordered) - 1) // 2])
    median["peak_bytes"] = max(r.get("peak_bytes", 0) for r in found)
    median["tps_all"] = [r["tps"] for r in found]
    if any(r.get("text") != median.get("text") for r in found):
        median["text"] = None  # repetitions disagree: no match with anything
    return median


def summarize(res: dict[str, Any]) -> None:
    """Adds the per-routing rows (ratios, matches) and the targets to res."""
    runs = res["runs"]
    res["rows"], res["targets"] = {}, {}
    for routing in res["models"]:
        rows = []
        for budget in [None, *res["budgets_pct"]]:
            def get(engine: str, test: str, b: float | None = budget, rt: str = routing) -> dict[str, Any] | None:
                return _find(runs, rt, b, engine, test)

            row: dict[str, Any] = {"budget_pct": budget}
            for test in ("tg", "pp"):
                zt = get("zipmoe", test)
                stocks = [r for r in (get(e, test) for e in STOCK_ENGINES) if r]
                best, row[f"{test}_stock_oom"], bound = against(zt, stocks, res["timeout_s"])
                row[f"{test}_ratio"] = ratio(zt, best)
                if bound is not None:
                    row[f"{test}_timeout_bound"] = bound
                if best is not None and len(stocks) > 1:
                    row[f"{test}_stock_best"] = best["engine"]
                alone = [r for r in (get("stock", test),) if r]  # stock as it is, without stock-nr
                _, row[f"{test}_stock_oom_alone"], row[f"{test}_timeout_bound_alone"] = \
                    against(zt, alone, res["timeout_s"])
                row[f"{test}_ratio_stock"] = ratio(zt, alone[0] if alone else None)
            z = get("zipmoe", "tg")
            # compared with stock as it is: --no-repack computes the repacked types with other kernels, other logits
            refs = [r for r in (get("stock", "tg"), get("stock", "tg", None)) if r and r["status"] == "ok"]
            nr, s_free = get("stock-nr", "tg"), get("stock", "tg", None)
            if nr and s_free and nr["status"] == s_free["status"] == "ok":
                row["stock_nr_same_text"] = nr["text"] == s_free["text"]
            if z is None or z["status"] != "ok" or not refs:
                row["match"] = None
            else:
                row["match"] = all(z["text"] == r["text"] for r in refs)
            s_at, s_free = get("stock", "tg"), get("stock", "tg", None)
            if s_at and s_free and s_at["status"] == s_free["status"] == "ok" and s_at["text"] != s_free["text"]:
                row["stock_differs_from_unconstrained"] = True
            free = get("zipmoe", "tg", None)
            if budget is not None and z and free and z.get("tps") and free.get("tps"):
                row["zipmoe_keeps"] = z["tps"] / free["tps"]  # of zipmoe's own unconstrained tg
            if budget is not None:
                row["limit"] = row_limit(res, routing, z, free)
            if res.get("variant"):
                for test in ("tg", "pp"):
                    row[f"variant_{test}_ratio"] = ratio(get("variant", test), get("zipmoe", test))
                v = get("variant", "tg")
                row["variant_match"] = None if not (v and z and v["status"] == z["status"] == "ok") else \
                    v["text"] == z["text"]
            rows.append(row)
        res["rows"][routing] = rows
        res["targets"][routing] = check_targets(rows, res["budgets_pct"], not converted(res))
        if "stock-nr" in (res.get("engines") or ()):  # the same against stock as it is (zipmoe's logits are its)
            alone = [{**r, **{f"{t}_ratio": r.get(f"{t}_ratio_stock") for t in ("tg", "pp")},
                      **{f"{t}_stock_oom": bool(r.get(f"{t}_stock_oom_alone")) for t in ("tg", "pp")},
                      **{f"{t}_timeout_bound": r.get(f"{t}_timeout_bound_alone") for t in ("tg", "pp")}}
                     for r in rows]
            res.setdefault("targets_stock", {})[routing] = check_targets(alone, res["budgets_pct"], not converted(res))


def against(z: dict[str, Any] | None, stocks: list[dict[str, Any]],
            timeout: float) -> tuple[dict[str, Any] | None, bool, float | None]:
    """zipmoe's run against the stock runs of one limit and test: the fastest stock that ran; whether zipmoe ran and
    every stock was OOM-killed (no ratio, and no stock speed to fall short of); and where the stocks that were not
    OOM-killed ran past the timeout, the bound on the ratio from whole runs: stock's took longer than the timeout,
    zipmoe's (load, prompt, generation) its wall time."""
    best = max((r for r in stocks if r["status"] == "ok" and r.get("tps")), key=lambda r: r["tps"], default=None)
    z_ok = bool(stocks and z and z["status"] == "ok")
    oom = z_ok and all(r["status"] == "oom" for r in stocks)
    bound = None
    if z_ok and best is None and z.get("wall_s") and any(r["status"] == "timeout" for r in stocks) \
            and all(r["status"] in ("oom", "timeout") for r in stocks):
        bound = timeout / z["wall_s"]
    return best, oom, bound


def converted(res: dict[str, Any]) -> bool:
    """Whether zipmoe ran a converted model (BF16 always; another type with --convert) or the plain GGUF."""
    return res.get("converted", res.get("type", "BF16") == "BF16")


def check_targets(rows: list[dict[str, Any]], budgets: list[float], plain: bool = False) -> list[dict[str, Any]]:
    """The issue's targets for the rows of one model: a converted BF16 model's, or a plain GGUF's (plain)."""
    by_budget = {r["budget_pct"]: r for r in rows}

    def nearest(pct: float) -> float | None:
        near = sorted(budgets, key=lambda b: abs(b - pct))
        return near[0] if near and abs(near[0] - pct) <= TARGET_SLACK else None

    out = []
    def verdict(b: float | None, least: float) -> dict[str, Any]:
        """ratio and met at budget b; where every stock run was OOM-killed and zipmoe ran: met, stock_oom."""
        row = {} if b is None else by_budget[b]
        r = row.get("tg_ratio")
        if r is None and row.get("tg_stock_oom"):
            return {"ratio": None, "met": True, "stock_oom": True}
        if r is None and row.get("tg_timeout_bound") is not None:
            bound = row["tg_timeout_bound"]
            return {"ratio": bound, "met": bound >= least, "timeout_bound": True}
        return {"ratio": r, "met": None if r is None else r >= least}

    for pct, least in PLAIN_TARGETS if plain else SPEEDUP_TARGETS:
        b = nearest(pct)
        out.append({"target": f">= {least:g}x at ~{pct}%", "budget_pct": b, **verdict(b, least)})
    b = None if plain else nearest(KEEP_BUDGET)
    r = None if b is None else by_budget[b].get("zipmoe_keeps")
    out.append({"target": f"zipmoe keeps >= {KEEP_SHARE:.0%} of its unconstrained tg at ~{KEEP_BUDGET}%",
                "budget_pct": b, "ratio": r, "met": None if r is None else r >= KEEP_SHARE})
    b = nearest(PARITY_BUDGET)
    out.append({"target": f"within {PARITY_TOLERANCE:.0%} at ~{PARITY_BUDGET}%", "budget_pct": b,
                **verdict(b, 1 - PARITY_TOLERANCE)})
    for test in ("tg", "pp"):
        measured = [(row["budget_pct"], row[f"{test}_ratio"] if row[f"{test}_ratio"] is not None
                     else row[f"{test}_timeout_bound"]) for row in rows
                    if row["budget_pct"] is not None and row["budget_pct"] < PARITY_BUDGET - TARGET_SLACK
                    and (row[f"{test}_ratio"] is not None or row.get(f"{test}_timeout_bound") is not None)]
        at, lowest = min(measured, key=lambda bx: bx[1], default=(None, None))  # one row's budget and ratio
        met = None if lowest is None else lowest >= 1
        bounded = at is not None and by_budget[at][f"{test}_ratio"] is None  # the lowest is a timeout's bound
        out.append({"target": f"never slower ({test}, below ~{PARITY_BUDGET}%)",
                    "budget_pct": at if met is False else None, "ratio": lowest, "met": met, "bounded": bounded})
    return out


def _fmt_tps(r: dict[str, Any] | None) -> str:
    return cell(r, f"{r['tps']:.2f}" if r and r.get("tps") is not None else "")


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _mib(r: dict[str, Any] | None, key: str) -> str:
    return "-" if not r or r.get(key) is None else f"{r[key] / MIB:.0f}"


def _wall(r: dict[str, Any] | None) -> str:
    return "-" if not r or r["status"] != "ok" or r.get("wall_s") is None else f"{r['wall_s']:.1f}"


def _per_token(r: dict[str, Any] | None) -> str:
    if not r or r["status"] != "ok" or not r.get("tokens"):
        return "-"
    return f"{r['disk_read_bytes'] / MIB / r['tokens']:.1f}"


def tg_program(res: dict[str, Any]) -> str:
    threads = res.get("tg_threads")
    return f"llama-completion -t {threads}" if threads else "llama-simple (4 threads, llama.cpp's default)"


def stock_programs(directory: Path | None) -> Path | None:
    """directory if it holds a stock llama.cpp build's programs (tools/dev/build_stock.sh), else None."""
    names = ("llama-simple", "llama-bench", "llama-completion")
    if directory and all(os.access(directory / n, os.X_OK) for n in names):
        return directory.resolve()
    return None


def builds(res: dict[str, Any]) -> str:
    """Which llama.cpp each side ran, for the report's first line."""
    if res.get("stock_build") == "stock":
        return "stock: llama.cpp built from the same sdist without zipmoe's patches"
    return "same build (stock: zipmoe's without a budget)"


def print_report(res: dict[str, Any]) -> None:
    runs = res["runs"]
    qtype = res.get("type", "BF16")
    nr = "stock-nr" in (res.get("engines") or ())
    if qtype != "BF16" and converted(res):
        print(f"SYNTHETIC models (random weights, preset {res['preset']}, {qtype} by llama-quantize): stock llama.cpp "
              f"({qtype} GGUF, mmap) vs zipmoe (that GGUF converted, codec {res.get('codec', 'auto')}), {builds(res)}, "
              f"same cgroup v1 memory limit, cold page cache; limits are % of the {qtype} file")
    elif qtype != "BF16":
        print(f"SYNTHETIC models (random weights, preset {res['preset']}, quantized by llama-quantize): stock llama.cpp "
              f"vs zipmoe on the same plain {qtype} GGUF (no conversion: its experts served as stored under the "
              f"budget), {builds(res)}, same cgroup v1 memory limit, cold page cache; limits are % of the {qtype} file")
    else:
        print(f"SYNTHETIC models (random weights, preset {res['preset']}): stock llama.cpp (BF16 GGUF, mmap) vs zipmoe "
              f"(converted GGUF, codec {res.get('codec', 'huff')}), {builds(res)}, same cgroup v1 memory limit, cold page "
              f"cache")
    print(f"tg: {tg_program(res)} -n {res['gen_tokens']} {res['prompt']!r}; "
          f"pp: llama-bench -p {res['pp_tokens']} -n 0 -r {res.get('pp_reps', 1)} -t {res['threads_llama_bench']} "
          f"(the mean of its timed passes); "
          f"timeout {res['timeout_s']:g} s per run"
          + (f"; tokens/s: medians of {res['repeat']} runs, stock and zipmoe alternating (--json has each run)"
             if res.get("repeat", 1) > 1 else ""))
    if res.get("read_rate_bytes"):
        print(f"reads throttled to {res['read_rate_bytes'] / MIB:.0f} MiB/s (cgroup v1 blkio, stock and zipmoe alike): "
              f"slower storage than this machine's disk")
    measured = res.get("overhead_measured")
    if measured:
        def one(t: str, g: dict[str, Any]) -> str:
            seen = (f"resident {g['maxrss_bytes'] / MIB:.0f} MiB" if g.get("maxrss_bytes") else
                    f"cgroup peak {g['peak_bytes'] / MIB:.0f} MiB")
            return (f"{t} {g['overhead_bytes'] / MIB:.0f} MiB ({seen} at a budget of {g['budget_bytes'] / MIB:.0f} "
                    f"MiB, zipmoe's minimum {g['min_budget_bytes'] / MIB:.0f} MiB + "
                    f"{(g['budget_bytes'] - g['min_budget_bytes']) / MIB:.0f}, no limit; + "
                    f"{g['margin_bytes'] / MIB:.0f} MiB margin)")

        how = ", ".join(one(t, g) for t, g in measured.items())
        overhead = (f"overhead {res['overhead_bytes'] / MIB:.0f} MiB, measured before the runs, the larger of: {how}"
                    if isinstance(res["overhead_bytes"], int) else f"overhead measured before the runs, per test: {how}")
    elif isinstance(res["overhead_bytes"], dict):
        overhead = "overhead " + ", ".join(f"{t} {o / MIB:.0f} MiB" for t, o in res["overhead_bytes"].items())
    else:
        overhead = f"overhead = {res['overhead_bytes'] / MIB:.0f} MiB"
    print(f"zipmoe: ZIPMOE_MEMORY_BUDGET = limit - overhead, {overhead}"
          + (f"; also {' '.join(f'{k}={v}' for k, v in res['zipmoe_env'].items())}" if res["zipmoe_env"] else ""))
    if nr:
        print("stock-nr: stock llama.cpp with --no-repack (llama-bench --repack 0): its weights stay in the mmap instead "
              "of anonymous CPU_REPACK buffers; ratios are zipmoe / the faster stock that ran at that limit (* marks "
              "stock-nr)")
    if res.get("partial"):
        print("PARTIAL: the benchmark stopped before every run was made")
    for routing, model in res["models"].items():
        print()
        if qtype != "BF16" and converted(res):
            print(f"== {routing} routing (synthetic): {qtype} {model['bf16_bytes'] / MIB:.0f} MiB, zipmoe "
                  f"{model['zipmoe_bytes'] / MIB:.0f} MiB ({model['zipmoe_bytes'] / model['bf16_bytes']:.1%})")
        elif qtype != "BF16":
            print(f"== {routing} routing (synthetic): plain {qtype} GGUF {model['bf16_bytes'] / MIB:.0f} MiB")
        else:
            print(f"== {routing} routing (synthetic): BF16 {model['bf16_bytes'] / MIB:.0f} MiB, zipmoe "
                  f"{model['zipmoe_bytes'] / MIB:.0f} MiB ({model['zipmoe_bytes'] / model['bf16_bytes']:.1%})")
        header = ("budget", "limit MiB", "zipmoe budget", "stock tg", *(("stock-nr tg",) if nr else ()), "zipmoe tg",
                  "tg ratio", "stock pp", *(("stock-nr pp",) if nr else ()), "zipmoe pp", "pp ratio", "wall stock",
                  "wall zipmoe", "peak stock", *(("peak stock-nr",) if nr else ()), "peak zipmoe", "disk/tok stock",
                  "disk/tok zipmoe", "match")
        lines = []
        for row in res["rows"][routing]:
            b = row["budget_pct"]

            def get(engine: str, test: str, b: float | None = b, rt: str = routing) -> dict[str, Any] | None:
                return _find(runs, rt, b, engine, test)

            peaks = {e: [r.get("peak_bytes") for r in (get(e, "tg"), get(e, "pp")) if r and r.get("peak_bytes")]
                     for e in ("stock", "stock-nr", "zipmoe")}
            zbs = list(dict.fromkeys(r.get("zipmoe_budget_bytes") for r in (get("zipmoe", "tg"), get("zipmoe", "pp"))
                                     if r and r.get("zipmoe_budget_bytes") is not None))

            def peak(e: str) -> str:
                return f"{max(peaks[e]) / MIB:.0f}" if peaks[e] else "-"

            def rat(test: str) -> str:
                if row.get(f"{test}_stock_oom"):
                    return "stock OOM"
                if row.get(f"{test}_timeout_bound") is not None:
                    return f">{row[f'{test}_timeout_bound']:.2f}x (t/o)"
                star = "*" if row.get(f"{test}_stock_best") == "stock-nr" else ""
                return _fmt_ratio(row[f"{test}_ratio"]) + star
            match = {None: "-", True: "MATCH", False: "DIFF"}[row["match"]]
            if row.get("stock_differs_from_unconstrained"):
                match += " (stock differs from unconstrained!)"
            lines.append((
                "unconstrained" if b is None else f"{b:g}%",
                "-" if b is None else f"{int(model['bf16_bytes'] * b / 100) / MIB:.0f}",
                "unbounded" if b is None else ("-" if not zbs or min(zbs) <= 0 else
                                               "/".join(f"{zb / MIB:.0f}" for zb in zbs)),
                _fmt_tps(get("stock", "tg")), *((_fmt_tps(get("stock-nr", "tg")),) if nr else ()),
                _fmt_tps(get("zipmoe", "tg")), rat("tg"),
                _fmt_tps(get("stock", "pp")), *((_fmt_tps(get("stock-nr", "pp")),) if nr else ()),
                _fmt_tps(get("zipmoe", "pp")), rat("pp"),
                _wall(get("stock", "tg")), _wall(get("zipmoe", "tg")),
                peak("stock"), *((peak("stock-nr"),) if nr else ()), peak("zipmoe"),
                _per_token(get("stock", "tg")), _per_token(get("zipmoe", "tg")), match))
        widths = [max(len(x[i]) for x in [header, *lines]) for i in range(len(header))]
        for line in [header, *lines]:
            print("  ".join([f"{line[0]:<{widths[0]}}", *(f"{c:>{w}}" for c, w in zip(line[1:-1], widths[1:-1])),
                             line[-1]]))
        print("tg, pp: tokens/s; ratio: zipmoe / stock (stock OOM: zipmoe ran, no stock could; >Nx (t/o): no stock "
              "finished within the timeout, N = timeout / zipmoe's whole run, a bound on whole-run time); zipmoe budget: "
              "tg's/pp's where their overheads differ; wall: seconds of the whole tg process (load, which for "
              "zipmoe includes filling its cache, prompt and generation); peak: the cgroup's max usage (anonymous + "
              "page cache) over the tg and pp runs, MiB; disk/tok: MiB read from disk per generated token (load and prompt "
              "included); match: zipmoe's generated text against stock's at that limit and without a limit")
        if res.get("variant"):
            what = " ".join([*(f"{k}={v}" for k, v in res["variant"]["env"].items()),
                             *([f"libraries from {res['variant']['lib']}"] if res["variant"]["lib"] else [])])
            print(f"variant ({what}), measured in the same alternation, against zipmoe:")
            for row in res["rows"][routing]:
                b = row["budget_pct"]
                parts = [f"{test} {_fmt_tps(_find(runs, routing, b, 'variant', test))} against "
                         f"{_fmt_tps(_find(runs, routing, b, 'zipmoe', test))} "
                         f"({_fmt_ratio(row.get(f'variant_{test}_ratio'))})"
                         for test in res["tests"]]
                same = {None: "-", True: "same text", False: "DIFFERENT TEXT"}[row.get("variant_match")]
                print(f"  {'unconstrained' if b is None else f'{b:g}%':<13} {'; '.join(parts)}; {same}")
        limits = [row for row in res["rows"][routing] if row.get("limit")]
        if limits:
            print("zipmoe tg against the limit model (the best a cache of its budget could reach on this prompt's "
                  "routing: Belady's hits, reads overlapped with compute, decoding on every core; compute per token "
                  "from zipmoe's unconstrained tg; pyzipmoe/plan/limit.py):")
            for row in limits:
                lim, z = row["limit"], _find(runs, routing, row["budget_pct"], "zipmoe", "tg")
                print(f"  {row['budget_pct']:g}%{'':<8} " + (f"no limit: {lim['error']}" if "error" in lim else
                      f"{_fmt_tps(z)} = {lim['share']:.0%} of {lim['tps']:.2f} t/s (Belady's hits {lim['hits']:.0%}, "
                      f"experts kept {lim['layout']})"))
        elif (res.get("limit_inputs") or {}).get(routing, {}).get("error"):
            print(f"no limit model: {res['limit_inputs'][routing]['error']}")
        nr_differs = [row["budget_pct"] for row in res["rows"][routing] if row.get("stock_nr_same_text") is False]
        if nr_differs:
            print("stock-nr generated other text than stock (--no-repack computes the repacked types with other "
                  "kernels: other logits); match compares zipmoe with stock as it is")
        print("targets (zipmoe / stock, tg unless stated"
              + (", against the faster of stock and stock-nr" if nr else "") + ")"
              + (": set for this machine's own disk, not for throttled reads" if res.get("read_rate_bytes") else "")
              + ":")
        print_targets(res["targets"][routing])
        if res.get("targets_stock"):
            print("the same against stock as it is (llama.cpp's defaults, repacking: the logits zipmoe's must equal):")
            print_targets(res["targets_stock"][routing])
    problems = [r for r in runs if r["status"] != "ok"]
    if problems:
        print()
        print("runs that did not complete (the messages below):")
        messages: dict[str, int] = {}
        for r in problems:
            b = "unconstrained" if r["budget_pct"] is None else f"{r['budget_pct']:g}%"
            note = ""
            if r.get("message"):
                note = f" [{messages.setdefault(r['message'], len(messages) + 1)}]"
            log = f", log {r['log']}.err" if r.get("log") else ""
            print(f"  {r['routing']} {b} {r['engine']} {r['test']}: {cell(r, '')}{note}{log}")
        for text, n in messages.items():
            print(f"  [{n}] {text}")


def print_targets(targets: list[dict[str, Any]]) -> None:
    for t in targets:
        verdict = {None: "not measured", True: "met", False: "NOT met"}[t["met"]]
        at = "" if t["budget_pct"] is None else f" at {t['budget_pct']:g}%"
        if t["target"].startswith("zipmoe keeps"):
            value = "" if t["ratio"] is None else f": {t['ratio']:.0%}"
            print(f"  {t['target']:<32} {verdict}{value}{at}")
        elif t["target"].startswith("never slower"):
            worst = "" if t["ratio"] is None else f" (lowest {t['ratio']:.2f}x{at if t['met'] is False else ''}" \
                + (", where stock timed out: a bound" if t.get("bounded") else "") + ")"
            print(f"  {t['target']:<32} {verdict}{worst}")
        elif t.get("stock_oom"):
            print(f"  {t['target']:<32} {verdict}: zipmoe ran, stock was OOM-killed{at}")
        elif t.get("timeout_bound"):
            print(f"  {t['target']:<32} {verdict}: > {t['ratio']:.2f}x{at} (stock did not finish within the "
                  f"timeout: whole-run bound)")
        else:
            value = "" if t["ratio"] is None else f": {t['ratio']:.2f}x"
            print(f"  {t['target']:<32} {verdict}{value}{at}")


def plot(res: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say(f"--plot needs matplotlib, which is not installed: .venv/bin/pip install matplotlib "
            f"(the plot {path} was not drawn; --json keeps the numbers)")
        return False
    tests = [t for t in ("tg", "pp") if t in res["tests"]]
    fig, axes = plt.subplots(1, len(tests), figsize=(6.5 * len(tests), 4.5), squeeze=False)
    for ax, test in zip(axes[0], tests):
        for i, routing in enumerate(res["models"]):
            for engine, style in (("stock", "--"), ("stock-nr", "-."), ("zipmoe", "-")):
                medians = [_find(res["runs"], routing, b, engine, test) for b in res["budgets_pct"]]
                pts = sorted((r["budget_pct"], r["tps"]) for r in medians if r and r["status"] == "ok")
                color = f"C{i}"
                if pts:
                    ax.plot(*zip(*pts), style, marker="o" if engine == "zipmoe" else "s", color=color,
                            label=f"{engine}, {routing}")
                free = _find(res["runs"], routing, None, engine, test)
                if free and free["status"] == "ok":
                    ax.axhline(free["tps"], linestyle=":", color=color, alpha=0.9 if engine == "zipmoe" else 0.5,
                               linewidth=1)
        ax.set_xlabel(f"memory limit, % of the {res.get('type', 'BF16')} model file")
        ax.set_ylabel("tokens/s")
        ax.set_yscale("log")
        ax.set_title(f"{test}: {tg_program(res) if test == 'tg' else 'llama-bench pp' + str(res['pp_tokens'])}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    rate = f"; reads throttled to {res['read_rate_bytes'] / MIB:.0f} MiB/s" if res.get("read_rate_bytes") else ""
    fig.suptitle(f"zipmoe vs stock llama.cpp under a cgroup memory limit — SYNTHETIC model ({res['preset']}){rate}; "
                 f"dotted: no limit", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    say(f"wrote {path}")
    return True


# --------------------------------------------------------------------------------------------- main


def _budgets(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of percentages") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("budgets are positive percentages of the BF16 file size, e.g. 40,60,80")
    return sorted(set(values))


def _choices(allowed: tuple[str, ...]) -> Any:
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)} (comma-separated)")
        return list(dict.fromkeys(items))
    return parse


def _size(text: str) -> int:
    from pyzipmoe.errors import ZipmoeError

    try:
        return parse_size(text)
    except (BenchError, ZipmoeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _overhead(text: str) -> int | None:
    """--overhead: a size, or auto (None: measured before the runs)."""
    return None if text.strip().lower() == "auto" else _size(text)


def _synth_pair(text: str) -> tuple[str, int]:
    """--synth FIELD=N: one of make_synth.py's integer overrides."""
    from pyzipmoe.synth import SynthConfig

    key, eq, value = text.partition("=")
    key = key.strip().replace("-", "_")
    fields = {f for f, t in SynthConfig.__annotations__.items() if t in (int, "int")}
    if not eq or key not in fields:
        raise argparse.ArgumentTypeError(f"{text!r}: give FIELD=N with FIELD one of {', '.join(sorted(fields))}")
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not an integer") from None
    if n < 1 and key != "seed":
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return key, n


def _env_pair(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    if key == "ZIPMOE_MEMORY_BUDGET":
        raise argparse.ArgumentTypeError("ZIPMOE_MEMORY_BUDGET is set by the benchmark (limit - --overhead)")
    return key, value


def write_result_file(args: argparse.Namespace, res: dict[str, Any], json_path: Path | None,
                      argv: list[str] | None) -> None:
    """The dated result file of the run (or of the runs --report prints), under --results."""
    synthetic = res.get("synthetic", True)
    weights = (f"{result_files.SYNTHETIC} (tools/dev/make_synth.py, preset {res.get('preset')})" if synthetic
               else "as in the JSON")
    notes, day = [*res.get("notes", []), *(n for n in args.note if n not in res.get("notes", []))], None
    if args.report:  # the numbers were taken when the JSON was last written
        notes.append(f"the tables of {json_path}, printed by --report"
                     + (f"; measured by `{res['command']}`" if res.get("command") else ""))
        day = datetime.date.fromtimestamp(args.report.stat().st_mtime)
    result_files.write(args, "budget", result_files.printed(print_report, res), weights=weights,
                       json_path=json_path, notes=notes, day=day, argv=result_files.script_argv(__file__, argv))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    from pyzipmoe.synth import PRESETS, QUANT_TYPES

    p.add_argument("--preset", choices=sorted(PRESETS), default="2.8g",
                   help="synthetic model size (default: %(default)s; small (~64 MB) for a smoke test)")
    p.add_argument("--budgets", type=_budgets, default=_budgets(DEFAULT_BUDGETS), metavar="P,P,...",
                   help=f"memory limits in %% of the BF16 file size (default: {DEFAULT_BUDGETS})")
    p.add_argument("--routings", type=_choices(("uniform", "skewed")), default=["uniform", "skewed"],
                   metavar="R,R", help="uniform, skewed or both (default: both)")
    p.add_argument("--tests", type=_choices(("tg", "pp")), default=["tg", "pp"], metavar="T,T",
                   help="tg, pp or both (default: both)")
    p.add_argument("--overhead", type=_overhead, default=256 * MIB, metavar="SIZE|auto",
                   help="what the process needs besides the model (KV cache, compute buffers, program, slack): "
                        "zipmoe's budget is the limit minus this (default: 256MiB); auto: measured before "
                        "the runs, zipmoe's peak resident set at its minimum budget less that budget (the larger of tg's and "
                        "pp's), + 8 MiB")
    p.add_argument("--synth", type=_synth_pair, action="append", default=[], metavar="FIELD=N",
                   help="override a field of the preset (make_synth.py's, e.g. n_layer=16, n_vocab=4096; "
                        "repeatable): a model whose experts outweigh the rest more, so that a 40%% limit leaves "
                        "zipmoe its minimum; the models' names carry the overrides")
    p.add_argument("--stock-bin", type=Path, default=stock_bin_dir(), metavar="DIR",
                   help="stock llama.cpp's programs: the same sdist built without zipmoe's patches (default "
                        "build/llama-stock/bin, made by tools/dev/build_stock.sh); where it has none, stock runs on "
                        "zipmoe's build without a budget")
    p.add_argument("--stock-no-repack", action="store_true",
                   help="also run stock with llama.cpp's own --no-repack (llama-bench --repack 0), in the same "
                        "alternation: stock repacks Q4_K/Q8_0 weights into anonymous CPU_REPACK buffers that a limit "
                        "cannot page out, and without them its mmap can shrink. The ratios are against the faster "
                        "stock that ran (needs --tg-threads: llama-simple has no such option)")
    p.add_argument("--convert", action="store_true",
                   help="with --type other than BF16: zipmoe runs `pyzipmoe convert` of that GGUF (e.g. F16's own "
                        "lossless split), stock the GGUF; the targets are a converted model's (as BF16's)")
    p.add_argument("--zipmoe-env", type=_env_pair, action="append", default=[], metavar="KEY=VAL",
                   help="an environment variable for zipmoe runs, e.g. ZIPMOE_CACHE_POLICY=lru (repeatable)")
    p.add_argument("--variant-env", type=_env_pair, action="append", default=[], metavar="KEY=VAL",
                   help="also run a second zipmoe with this variable (repeatable; on top of --zipmoe-env), in the "
                        "same alternation, and report it against the first, e.g. ZIPMOE_PREDICT=1")
    p.add_argument("--variant-lib", type=Path, metavar="DIR",
                   help="the second zipmoe loads its libraries from DIR first (LD_LIBRARY_PATH), e.g. a copy of an "
                        "earlier build's libggml-zipmoe.so: the old library against the new, side by side")
    p.add_argument("--read-rate", type=_size, metavar="BYTES/S",
                   help="throttle every run's reads from the models' disk to this rate (cgroup v1 blkio), e.g. 400MiB "
                        "for an eMMC or SD card's: storage slower than this machine's (default: none)")
    p.add_argument("--gen", type=int, default=32, help="tokens tg generates (default: %(default)s)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="tg's prompt (default: %(default)r)")
    p.add_argument("--pp", type=int, default=512, help="prompt tokens of llama-bench's pp test (default: %(default)s)")
    p.add_argument("--pp-reps", type=int, default=5, metavar="N",
                   help="timed passes of llama-bench's pp test in each run, averaged (llama-bench -r; default: "
                        "%(default)s, llama-bench's own)")
    p.add_argument("--threads", type=int, default=2, help="llama-bench threads (default: %(default)s)")
    p.add_argument("--tg-threads", type=int, metavar="N",
                   help="run tg with llama-completion and N threads instead of llama-simple's fixed 4 (e.g. the "
                        "number of cores)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="runs of each engine at each limit, stock and zipmoe alternating; the report shows the median "
                        "(default: %(default)s; this machine's single runs vary by up to 1.5x)")
    p.add_argument("--timeout", type=float, default=600, metavar="S",
                   help="seconds one run may take before it is killed and reported as timeout (default: %(default)g)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR,
                   help="where the models and the runs' logs are kept (default: %(default)s)")
    p.add_argument("--regenerate", action="store_true", help="generate and convert the models again")
    p.add_argument("--type", choices=("BF16", *QUANT_TYPES), default="BF16",
                   help="BF16 (default): stock runs the BF16 GGUF, zipmoe its conversion; another type: both run "
                        "llama-quantize's copy of it, a plain GGUF, zipmoe without converting it (its experts served "
                        "as stored), limits in %% of that file")
    p.add_argument("--codec", choices=("auto", "huff", "esc", "zstd"), default=None,
                   help="the zipmoe model's exponent codec (default: esc where this CPU decodes it with SIMD, else "
                        "huff; the file is kept per codec)")
    p.add_argument("--cgroup-parent", metavar="PATH",
                   help="the memory cgroup to make the runs' cgroups in (default: this process's own)")
    p.add_argument("--json", type=Path, metavar="FILE",
                   help="write every run's raw results to FILE (rewritten after each run, so a stopped benchmark "
                        "keeps what it measured; --report prints it)")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="draw tokens/s against the limit (needs matplotlib)")
    p.add_argument("--report", type=Path, metavar="FILE",
                   help="run nothing: print the tables (and --plot) from a FILE written by --json")
    p.add_argument("--note", action="append", default=[], metavar="TEXT",
                   help="a line for the result file (repeatable), e.g. what else ran on the machine; kept in the JSON")
    result_files.add_arguments(p)
    args = p.parse_args(argv)
    args.argv = argv
    if args.codec is None and not args.report:
        # another type converted: the converter's own choice (zstd for F16, whose code bytes esc does not fit)
        args.codec = "auto" if args.type != "BF16" else default_bench_codec()
    if args.convert and args.type == "BF16":
        p.error("--convert is for --type other than BF16 (a BF16 model is always converted)")
    if args.stock_no_repack and not args.tg_threads and "tg" in args.tests:
        p.error("--stock-no-repack needs --tg-threads N (llama-simple has no --no-repack)")
    if args.variant_lib and not args.variant_lib.is_dir():
        p.error(f"--variant-lib {args.variant_lib}: not a directory (give the one that holds the libraries)")
    if args.report:
        try:
            res = json.loads(args.report.read_text())
        except (OSError, ValueError) as e:
            print(f"bench_budget: error: cannot read {args.report}: {e}", file=sys.stderr)
            return 1
        summarize(res)
        if args.plot:
            plot(res, args.plot)
        print_report(res)
        write_result_file(args, res, args.report, argv)
        return 0
    for name in ("gen", "pp", "pp_reps", "threads", "tg_threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.timeout <= 0:
        p.error("--timeout must be positive")
    args.workdir = args.workdir.resolve()
    try:
        with one_line_errors("bench_budget", BenchError):
            res = run(args)
    except KeyboardInterrupt:
        print("bench_budget: interrupted", file=sys.stderr)
        return 130
    if "tg" in args.tests and converted(res):
        say("recording the routing and calibrating for the limit model ...")
        record_limit_inputs(res, args.tg_threads or 4)  # (llama-simple: llama.cpp's default of 4 threads)
    summarize(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
        say(f"wrote {args.json}")
    if args.plot:
        plot(res, args.plot)
    print()
    print_report(res)
    write_result_file(args, res, args.json, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
