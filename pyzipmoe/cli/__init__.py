"""The `zipmoe` command. One module per group of subcommands, each with its `register(subparsers)`: files (convert,
verify, inspect, unpack), demo, programs (run, serve, bench: zipmoe's llama.cpp), models (create, list, show, cp,
rm, prune, export, import), calibrate, plan; formatting holds what they share.

Expected failures (bad input, corrupted files, missing files) print one line, `zipmoe: error: ...`, and exit with
a status of the one table every subcommand uses (pyzipmoe.errors.EXIT_STATUSES); a traceback means a bug in zipmoe.
Options may come before, between or after the positional arguments (`zipmoe run MODEL -n 4 hello`); for run, serve
and bench everything after the first `--` goes to the llama.cpp program untouched.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, ZipmoeError, exit_status_text

DESCRIPTION = """\
Lossless compression of the BF16 expert tensors of Mixture-of-Experts GGUF models.

Each BF16 value is split into its exponent byte, entropy coded in small independently
decodable chunks, and its sign+mantissa byte, stored as is. The result is still a GGUF:
every other tensor and key is unchanged, and `zipmoe unpack` gives back the original file
bit for bit. llama.cpp with zipmoe's patch runs it directly."""

EPILOG = """\
examples:
  zipmoe demo                                   a SYNTHETIC MoE under a memory budget, next to stock
  zipmoe inspect model-bf16.gguf                what would compression gain?
  zipmoe convert model-bf16.gguf model.zipmoe.gguf
  zipmoe verify model.zipmoe.gguf --against model-bf16.gguf
  zipmoe unpack model.zipmoe.gguf model-bf16-again.gguf
  zipmoe run model.zipmoe.gguf -p 'Once upon a time'   complete a prompt with zipmoe's llama.cpp
  zipmoe serve model.zipmoe.gguf                         llama-server on http://127.0.0.1:8080
  zipmoe bench model-bf16.gguf model.zipmoe.gguf         tokens/s of both (llama-bench)
  zipmoe run model.zipmoe.gguf --memory-budget 6GiB -p 'Hi'  under a memory budget (planned once calibrated)
  zipmoe calibrate model.zipmoe.gguf                     measure this machine's decode and disk costs
  zipmoe plan model.zipmoe.gguf --memory-budget 6GiB     the planner's split of the budget, per layer

options may come anywhere after COMMAND; `zipmoe COMMAND --help` describes each command and its arguments.
docs/FORMAT.md specifies the file format.

"""


def version() -> str:
    """pyzipmoe's version: its installed metadata, else (run from a checkout) pyproject.toml's, the one place it is
    written."""
    from importlib import metadata

    try:
        return metadata.version("pyzipmoe")
    except metadata.PackageNotFoundError:
        import tomllib
        from pathlib import Path

        try:
            with open(Path(__file__).resolve().parents[2] / "pyproject.toml", "rb") as f:
                return str(tomllib.load(f)["project"]["version"])
        except (OSError, ValueError, KeyError):
            return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zipmoe", description=DESCRIPTION, epilog=EPILOG + exit_status_text(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"zipmoe {version()}",
                        help="print zipmoe's version and exit")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    from . import calibrate, demo, files, models, plan, programs, server

    for group in (files, demo, programs, models, calibrate, plan, server):
        group.register(sub)
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, read as build_parser() describes it, with options anywhere after the subcommand (its
    parser's parse_intermixed_args: `zipmoe run MODEL -n 4 hello` is `zipmoe run -n 4 MODEL hello`). For
    run/serve/bench everything after the first `--` is kept, untouched, as llama_args for the llama.cpp program
    (argparse would mix it into the positionals or drop later `--`s)."""
    from . import programs

    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if argv[:1] and argv[0] in programs.LLAMA_COMMANDS and "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    command = _subcommands(parser).get(argv[0]) if argv else None
    args = command.parse_intermixed_args(argv[1:]) if command is not None else parser.parse_args(argv)
    if argv[:1] and argv[0] in programs.LLAMA_COMMANDS:
        args.llama_args = passthrough
    return args


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands' parsers by name (aliases included)."""
    for action in parser._actions:  # argparse keeps them there; it has no public accessor
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:  # --help, or a usage error argparse has already explained
        return int(e.code or 0)
    except ZipmoeError as e:
        return _fail(str(e), e.exit_code)
    try:
        return args.run(args)
    except ZipmoeError as e:
        return _fail(str(e), e.exit_code)
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        return _fail(f"{e.strerror or e}{where}", EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_INTERRUPTED)


def _fail(message: str, code: int) -> int:
    print(f"zipmoe: error: {' '.join(message.split())}", file=sys.stderr)
    return code
