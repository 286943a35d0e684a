"""The `zipmoe` command. One module per group of subcommands, each with its `register(subparsers)`: files (convert,
verify, inspect, unpack), demo, programs (run, serve, bench: zipmoe's llama.cpp), models (create, list, show, cp,
rm, prune, export, import), calibrate, plan; formatting holds what they share.

Expected failures (bad input, corrupted files, missing files) print one line, `zipmoe: error: ...`, and
exit with 2 (1 when verify finds a difference); a traceback means a bug in zipmoe.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import ZipmoeError
from .formatting import EXIT_BAD_INPUT, EXIT_INTERRUPTED

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

exit status: 0 success, 1 verify found a difference, 2 bad input or usage, 130 interrupted.
run, serve and bench exit with the status of the llama.cpp program they run.
docs/FORMAT.md specifies the file format."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zipmoe", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    from . import calibrate, demo, files, models, plan, programs, server

    for group in (files, demo, programs, models, calibrate, plan, server):
        group.register(sub)
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """build_parser().parse_args, except that for run/serve/bench everything after the first `--` is kept, untouched,
    as llama_args for the llama.cpp program (argparse would mix it into the positionals or drop later `--`s)."""
    from . import programs

    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if argv[:1] and argv[0] in programs.LLAMA_COMMANDS and "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    if argv[:1] and argv[0] in programs.LLAMA_COMMANDS:
        args.llama_args = passthrough
    return args


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
