"""Dated result files of the benchmarks, as bench/results/README.md describes them.

A finished run writes `DIR/YYYY-MM-DD-<benchmark>[-<label>].md` (DIR: --results, default bench/results): the
exact command line, the machine (CPU model, cores), the code (commit), whether the weights were synthetic, where
the JSON went, and the table the run printed. A second run on the same day gets `-2`, `-3`, ...: a record is never
overwritten. --no-results writes nothing. Each benchmark calls `add_arguments` on its parser and `write` at the
end (or `report`, which prints the results first); `Tee` keeps what a benchmark prints while it prints it.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO / "bench" / "results"
SYNTHETIC = "SYNTHETIC weights"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("result files (bench/results/README.md)")
    g.add_argument("--results", type=Path, default=RESULTS_DIR, metavar="DIR",
                   help="write the finished run's table, command and machine to DIR/YYYY-MM-DD-<benchmark>"
                        "[-<label>].md (default: bench/results)")
    g.add_argument("--label", metavar="WORD", help="a word for the file name, e.g. the change measured")
    g.add_argument("--no-results", action="store_true", help="write no result file")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    cores = os.cpu_count() or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = cores
    shown = f"{cores} cores" if usable == cores else f"{cores} cores ({usable} usable by this process)"
    return f"{cpu_model()}, {shown}, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def commit() -> str:
    """The commit the code ran at, and whether the tree had changes; "unknown" outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head} (with uncommitted changes)" if dirty else head


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran: the interpreter and the script (relative to the repository when inside it) and the
    arguments."""
    def short(path: str) -> str:
        p = Path(path).absolute()
        return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else path

    args = list(sys.argv if argv is None else argv)
    if args:
        args[0] = short(args[0])
    return shlex.join([short(sys.executable), *args])


def script_argv(script: str, argv: list[str] | None) -> list[str]:
    """The command line of a benchmark's main(argv): the script and argv, or this process's arguments."""
    return [script, *(sys.argv[1:] if argv is None else argv)]


def synthetic_gguf(path: Path) -> bool | None:
    """Whether a GGUF was made by pyzipmoe.synth (its general.name says so); None if it cannot be read."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(path).get_field("general.name")
        name = bytes(field.parts[field.data[0]]).decode("utf-8", "replace") if field else ""
    except Exception:  # noqa: BLE001 - any unreadable file: unknown
        return None
    return "synthetic" in name


def file_name(benchmark: str, label: str | None, day: datetime.date) -> str:
    word = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-") if label else ""
    return f"{day.isoformat()}-{benchmark}{'-' + word if word else ''}.md"


def write(args: argparse.Namespace, benchmark: str, table: str, *, weights: str, json_path: Path | str | None = None,
          argv: list[str] | None = None, day: datetime.date | None = None,
          notes: list[str] | None = None) -> Path | None:
    """Writes the result file of a finished run (None with --no-results) and says where on stderr.

    weights: a sentence on the weights measured; say SYNTHETIC (the constant) where they are. json_path: where
    the run's JSON went ("stdout" when printed). day: the day the numbers were taken (default: today)."""
    if getattr(args, "no_results", False):
        return None
    out_dir = Path(args.results)
    out_dir.mkdir(parents=True, exist_ok=True)
    day = day or datetime.date.today()
    base = file_name(benchmark, getattr(args, "label", None), day)
    path, n = out_dir / base, 1
    while path.exists():
        n += 1
        path = out_dir / base.replace(".md", f"-{n}.md")
    lines = [f"# {benchmark}{' (' + args.label + ')' if getattr(args, 'label', None) else ''}, {day.isoformat()}",
             "",
             f"- command: `{command_line(argv)}`",
             f"- machine: {machine()}",
             f"- code: {commit()}",
             f"- weights: {weights}"]
    if json_path is not None:
        lines.append(f"- JSON: {json_path}")
    lines += [f"- {note}" for note in notes or []]
    lines += ["", "```text", table.rstrip("\n"), "```", ""]
    path.write_text("\n".join(lines))
    print(f"wrote {path}", file=sys.stderr, flush=True)
    return path


class Tee(io.TextIOBase):
    """`with Tee() as t:` prints as usual and keeps a copy of what went to stdout in t.text."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._out: TextIO | None = None

    def __enter__(self) -> Tee:
        self._out, sys.stdout = sys.stdout, self  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.stdout = self._out  # type: ignore[assignment]

    def write(self, s: str) -> int:
        self._parts.append(s)
        return self._out.write(s) if self._out is not None else len(s)

    def flush(self) -> None:
        if self._out is not None:
            self._out.flush()

    @property
    def text(self) -> str:
        return "".join(self._parts)


def printed(fn: Any, *args: Any, **kwargs: Any) -> str:
    """What fn(*args, **kwargs) prints to stdout, not printed."""
    buf = io.StringIO()
    out, sys.stdout = sys.stdout, buf
    try:
        fn(*args, **kwargs)
    finally:
        sys.stdout = out
    return buf.getvalue()


def report(args: argparse.Namespace, benchmark: str, res: dict[str, Any], print_report: Any, *, weights: str,
           script: str, argv: list[str] | None) -> None:
    """The end of a run with --json: the results as JSON on stdout with --json, else print_report's tables; then
    the dated result file of those tables."""
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print()
        print_report(res)
    write(args, benchmark, printed(print_report, res), weights=weights, json_path="stdout" if args.json else None,
          argv=script_argv(script, argv))
