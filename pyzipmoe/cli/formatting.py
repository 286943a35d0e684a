"""What the zipmoe command's subcommands share: exit statuses, sizes and tables as text, JSON output, help paragraphs
and argument types."""

from __future__ import annotations

import argparse
import json
import shutil
import textwrap
from collections.abc import Sequence
from typing import Any

from ..errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, exit_status_text  # noqa: F401  (the one table)
from ..runtime.budget import human_size  # noqa: F401  (the subcommands' sizes: one formatter)


def pct(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:+.1f}%" if signed else f"{x:.1%}"


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned first column, right-aligned numbers."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = f"{cells[0]:<{widths[0]}}"
        return "  ".join([first, *(f"{c:>{w}}" for c, w in zip(cells[1:], widths[1:]))]).rstrip()

    return "\n".join([line(header), *(line(r) for r in rows)])


def size_table(groups: Sequence[dict[str, Any]]) -> str:
    """The tensor-group size table of convert and inspect (dicts of SizeRow.to_dict())."""
    header = ("tensor group", "tensors", "size", "zipmoe size", "ratio", "floor", "vs floor")
    rows = [(g["label"], str(g["n_tensors"] or ""), human_size(g["bf16_bytes"]),
             "-" if g["zipmoe_bytes"] is None else human_size(g["zipmoe_bytes"]),
             pct(g["ratio"]), pct(g["floor"]), pct(g["floor_gap_pct"], signed=True)) for g in groups]
    return render_table(header, rows)


def tensor_table(tensors: Sequence[dict[str, Any]]) -> str:
    header = ("tensor", "shape", "type", "size", "zipmoe size", "H(exp)", "ratio", "floor", "vs floor")
    rows = [(t["name"], "x".join(map(str, t["dims"])), t["type"], human_size(t["bf16_bytes"]),
             "-" if t["zipmoe_bytes"] is None else human_size(t["zipmoe_bytes"]),
             f"{t['exponent_entropy']:.3f}", pct(t["ratio"]), pct(t["floor"]),
             pct(t["floor_gap_pct"], signed=True)) for t in tensors]
    return render_table(header, rows)


TABLE_NOTE = ("ratio = zipmoe size / source size; floor = (8 + H(exp)) / 16, the best a code that stores "
              "sign+mantissa raw can do (for F16, H of its code byte: exponent and 3 mantissa bits); quantized and "
              "F32 experts are stored raw, H(exp) is the entropy of their bytes and floor = H / 8, what coding them "
              "could reach; vs floor = ratio / floor - 1")


def print_json(data: dict[str, Any]) -> None:
    print(json.dumps(data, indent=2))


def para(text: str) -> str:
    """A description paragraph wrapped for the terminal (the formatter keeps the epilogs' line breaks)."""
    return textwrap.fill(text, width=min(100, shutil.get_terminal_size().columns - 2))


def command(sub: Any, name: str, run: Any, description: str, examples: Sequence[str] = (),
            **kw: Any) -> argparse.ArgumentParser:
    """Subcommand `name` of `zipmoe`, which `run(args)` carries out: its description wrapped by para, its command
    lines `examples` listed below the options, the line breaks of an epilog kept, the exit statuses (the one table,
    pyzipmoe.errors.EXIT_STATUSES) last; kw as for add_parser (help, epilog, usage...)."""
    if examples:
        listed = f"example{'s' if len(examples) > 1 else ''}:\n" + "\n".join("  " + line for line in examples)
        kw["epilog"] = listed + (f"\n\n{kw['epilog']}" if kw.get("epilog") else "")
    kw["epilog"] = (f"{kw['epilog']}\n\n" if kw.get("epilog") else "") + exit_status_text()
    p = sub.add_parser(name, formatter_class=argparse.RawDescriptionHelpFormatter, description=para(description), **kw)
    p.set_defaults(run=run)
    return p


def positive(text: str) -> int:
    return _whole_at_least(text, 1)


def nonnegative(text: str) -> int:
    return _whole_at_least(text, 0)


def _whole_at_least(text: str, least: int) -> int:
    """What positive and nonnegative check: a whole number of at least `least`."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {n}")
    return n


def fraction(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= f <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {f}")
    return f


def add_report_flags(p: argparse.ArgumentParser, *, json_help: str | None = None,
                     quiet_help: str | None = None) -> None:
    """--json and --quiet, each with its command's help (None: the command has not that flag)."""
    if json_help is not None:
        p.add_argument("--json", action="store_true", help=json_help)
    if quiet_help is not None:
        p.add_argument("--quiet", action="store_true", help=quiet_help)
