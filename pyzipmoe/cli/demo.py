"""`zipmoe demo`: zipmoe's main job on a SYNTHETIC model, in a minute or two: a MoE model run under a memory budget
well below its size, next to stock llama.cpp on its BF16 file in the same memory limit, with the same tokens.

Both runs are llama-simple from zipmoe's build (greedy, so its tokens are a function of the weights). On the BF16
file without a budget that program runs exactly as stock llama.cpp does: zipmoe's code runs only for compressed
tensors. The memory limit is a fresh cgroup v1 memory cgroup per run where this process may make one (root, the
memory controller mounted); elsewhere the budget alone bounds the zipmoe run and the table says so. Each run starts
with its model file out of the page cache, so that what it reads is charged to its own cgroup.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import ZipmoeError
from ..progress import Progress, for_terminal
from ..runtime.memory import JOIN_AND_EXEC, make_memory_cgroup, remove_cgroup
from .formatting import EXIT_OK, add_report_flags, command, human_size, positive, print_json, render_table

PROMPT = "Once upon a time"
BUDGET_SHARE = 0.5  # of the BF16 file: "well below its size"
MARGIN = 16 << 20  # the program's own memory beside the budget: heap, stacks, KV cache, compute buffers
TIMEOUT = 300  # seconds for one run; a run that thrashes longer than this has lost already
SPEED = re.compile(r"decoded (\d+) tokens in ([0-9.]+) s, speed: ([0-9.]+) t/s")  # llama-simple's last line


@dataclass(frozen=True)
class Run:
    """One generation: its text, speed and peak memory (the cgroup's, else the process's largest RSS)."""

    text: str
    tokens_per_second: float
    peak_bytes: int
    peak_source: str  # "cgroup" or "rss"


def _evict(path: Path) -> None:
    """Drops one file's pages from the page cache (this file only), so that a run's reads of it are its own."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages (a file just written) are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cgroup_parent() -> Path | None:
    """Where this process may make a memory cgroup v1 child; None where it cannot (not root, no controller)."""
    from ..runtime.memory import own_cgroup_dir

    if os.geteuid() != 0:
        return None
    parent = own_cgroup_dir("memory")
    if parent is None or not (parent / "memory.limit_in_bytes").is_file() or not os.access(parent, os.W_OK):
        return None
    return parent


def run_limited(argv: list[str], env: dict[str, str], parent: Path | None, limit: int) -> tuple[str, str, int, str]:
    """(stdout, stderr, peak bytes, where the peak was read) of argv, run in a fresh memory cgroup limited to
    `limit` when parent is given. ZipmoeError when it fails or runs past TIMEOUT."""
    group, name = None, Path(argv[0]).name
    if parent is not None:
        group = make_memory_cgroup(parent / f"zipmoe-demo-{os.getpid()}-{time.monotonic_ns()}", limit)
        argv = [*JOIN_AND_EXEC, str(group / "cgroup.procs"), *argv]
    proc = None
    try:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
            start = time.monotonic()
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid == proc.pid:
                    break
                if time.monotonic() - start > TIMEOUT:
                    raise ZipmoeError(f"{name}: ran past {TIMEOUT} s")
                time.sleep(0.05)
            proc.returncode = os.waitstatus_to_exitcode(status)
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        if proc.returncode != 0:
            lines = [ln for ln in stderr.splitlines() if ln.strip()]
            killed = group is not None and "oom_kill 1" in (group / "memory.oom_control").read_text()
            raise ZipmoeError(f"{name} failed (exit {proc.returncode}"
                              f"{', killed for memory' if killed else ''}): {lines[-1] if lines else 'no message'}")
        if group is not None:
            return stdout, stderr, int((group / "memory.max_usage_in_bytes").read_text()), "cgroup"
        return stdout, stderr, usage.ru_maxrss * 1024, "rss"
    finally:
        if proc is not None and proc.returncode is None:  # timed out or interrupted: leave nothing behind
            try:
                os.killpg(proc.pid, signal.SIGKILL)
                os.wait4(proc.pid, 0)
            except OSError:
                pass
        if group is not None:
            remove_cgroup(group)


def generate(model: Path, n_predict: int, budget: int | None, parent: Path | None, limit: int) -> Run:
    """llama-simple on `model` (greedy), under `budget` if given, in `limit` where a cgroup can hold it."""
    from ..runtime import runner

    argv = [str(runner.program("llama-simple")), "-m", str(model), "-n", str(n_predict), PROMPT]
    env = runner.environment(memory_budget=None if budget is None else str(budget))
    if budget is None:
        env.pop("ZIPMOE_MEMORY_BUDGET", None)
    _evict(model)
    stdout, stderr, peak, source = run_limited(argv, env, parent, limit)
    m = SPEED.search(stderr)
    if m is None:
        raise ZipmoeError(f"llama-simple printed no speed line for {model.name}")
    return Run(stdout.strip(), float(m.group(3)), peak, source)


def cmd_demo(args: argparse.Namespace) -> int:
    from .. import synth
    from ..file import convert
    from ..runtime.budget import model_memory

    progress = for_terminal(args.quiet)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="zipmoe-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model, packed = (workdir / f"{args.preset}-{args.arch}{s}.gguf" for s in ("-bf16", ".zipmoe"))
    say: Callable[[str], None] = (lambda s: None) if args.quiet or args.json else print
    try:
        config = synth.for_arch(synth.PRESETS[args.preset], args.arch)
        progress.start("generate", synth.tensor_data_bytes(config))
        made = synth.write_config(model, config, progress=_synth_progress(progress))
        progress.close()
        say(f"1. made a SYNTHETIC {args.arch} MoE model with random BF16 weights: {model} "
            f"({human_size(made.file_size)})")
        report = convert.convert(model, packed, threads=args.threads, progress=progress)
        progress.close()
        say(f"2. converted it losslessly to {packed} ({human_size(report.output_size)}) in {report.seconds:.1f} s")
        need = model_memory(packed)
        budget = max(int(BUDGET_SHARE * made.file_size), need.minimum + need.in_flight_bytes)
        limit = budget + MARGIN
        parent = None if args.no_cgroup else cgroup_parent()
        where = (f"each in a memory cgroup limited to {human_size(limit)}" if parent is not None else
                 "no memory cgroup here (it needs root and cgroup v1's memory controller): the budget alone bounds "
                 "the zipmoe run, the BF16 run is unbounded")
        say(f"3. generating {args.n_predict} tokens of {PROMPT!r} greedily with llama-simple, {where} ...")
        stock = generate(model, args.n_predict, None, parent, limit)
        zipped = generate(packed, args.n_predict, budget, parent, limit)
        same = stock.text == zipped.text
        if args.json:
            print_json({"synthetic": True, "bf16_bytes": made.file_size, "zipmoe_bytes": report.output_size,
                        "budget_bytes": budget, "limit_bytes": limit if parent is not None else None,
                        "cgroup": parent is not None, "identical_tokens": same,
                        "runs": {"stock": asdict(stock), "zipmoe": asdict(zipped)}})
        say("")
        say(_table(made.file_size, report.output_size, budget, stock, zipped))
        say(f"identical tokens: {'yes' if same else 'NO'}")
        say("Both rows are llama-simple from zipmoe's build of llama.cpp: on the BF16 file without a budget it runs "
            "exactly as stock llama.cpp (zipmoe's code runs only for compressed tensors). Peak = "
            + ("the cgroup's peak usage (memory and page cache)" if parent is not None
               else "the largest resident set (no cgroup)") + ".")
        if not same:
            raise ZipmoeError("the zipmoe model generated other tokens than its BF16 source: this is a bug")
        if args.keep:
            bin_dir = Path(_program_dir())
            say("")
            say(f"files kept in {workdir}. Run them yourself:")
            say(f"  {bin_dir / 'llama-cli'} -m {packed} --memory-budget {human_size(budget).replace(' ', '')} "
                f"-p '{PROMPT}' -n 32 -st")
            say(f"  python -c \"import pyzipmoe; llm = pyzipmoe.Llama('{packed}', "
                f"memory_budget='{human_size(budget).replace(' ', '')}', verbose=False); "
                f"print(llm('{PROMPT}', max_tokens=32)['choices'][0]['text'])\"")
    finally:
        progress.close()
        if not args.keep:
            if args.workdir:
                for p in (model, model.with_name(model.name + ".part"), packed):
                    p.unlink(missing_ok=True)
            else:
                shutil.rmtree(workdir, ignore_errors=True)
    return EXIT_OK


def _program_dir() -> str:
    from ..paths import bin_dir

    return str(bin_dir())


def _table(bf16_size: int, zipmoe_size: int, budget: int, stock: Run, zipped: Run) -> str:
    """One row per run, named for what ran: which file, under which budget; the peak column for where it was read."""
    peak = {"cgroup": "peak memory (cgroup)", "rss": "peak RSS"}
    header = ("model file", "size", "memory budget", "tokens/s",
              " / ".join(dict.fromkeys(peak[r.peak_source] for r in (stock, zipped))))
    rows = [("BF16 GGUF (as stock llama.cpp)", human_size(bf16_size), "none", f"{stock.tokens_per_second:.1f}",
             human_size(stock.peak_bytes)),
            ("zipmoe GGUF", human_size(zipmoe_size), human_size(budget), f"{zipped.tokens_per_second:.1f}",
             human_size(zipped.peak_bytes))]
    return render_table(header, rows)


def _synth_progress(progress: Progress) -> Callable[[int, int, str], None]:
    """synth reports cumulative bytes; Progress wants increments."""
    last = [0]

    def update(done: int, total: int, name: str) -> None:
        progress.advance(done - last[0])
        last[0] = done

    return update


def register(sub: Any) -> None:
    """Adds `demo` to the `zipmoe` command's subparsers."""
    p = command(
        sub, "demo", cmd_demo, help="run a SYNTHETIC MoE model under a memory budget, next to its BF16 file",
        description="zipmoe's main job in a minute or two: make a SYNTHETIC MoE model (random BF16 weights whose "
                    "exponents have the statistics of trained ones), convert it, and generate with it under a "
                    "memory budget of half its size, next to its BF16 file run as stock llama.cpp runs it, in the "
                    "same memory limit (a cgroup where this process may make one). Prints tokens/s, peak memory and "
                    "whether the tokens are identical.",
        examples=("zipmoe demo", "zipmoe demo --preset 1g --keep --workdir /tmp/z"))
    p.add_argument("--preset", choices=("tiny", "small", "1g"), default="small",
                   help="model size: tiny (~0.3 MB), small (~64 MB, the default) or 1g (~1 GiB, minutes)")
    p.add_argument("--arch", choices=("qwen3moe", "olmoe"), default="qwen3moe", help="model architecture")
    p.add_argument("-n", "--n-predict", type=positive, default=32, metavar="N",
                   help="tokens to generate (default: %(default)s)")
    p.add_argument("--workdir", metavar="DIR", help="where to put the files (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the files, and say how to run them")
    p.add_argument("--no-cgroup", action="store_true", help="no memory cgroup even where one could be made")
    p.add_argument("--threads", type=positive, metavar="N", help="conversion threads (default: all CPUs)")
    add_report_flags(p, json_help="print the results as JSON", quiet_help="no progress bars, no output")
