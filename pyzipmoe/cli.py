"""The `zipmoe` command: convert, verify, inspect, unpack, demo.

Expected failures (bad input, corrupted files, missing files) print one line, `zipmoe: error: ...`, and
exit with 2 (1 when verify finds a difference); a traceback means a bug in zipmoe.

Modules that load the native library (codec, convert) are imported inside functions, under main()'s
error handling, so a missing library is one line that says how to build it, not an import traceback.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .errors import ZipmoeError
from .progress import Progress, for_terminal

EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130

DESCRIPTION = """\
Lossless compression of the BF16 expert tensors of Mixture-of-Experts GGUF models.

Each BF16 value is split into its exponent byte, entropy coded in small independently
decodable chunks, and its sign+mantissa byte, stored as is. The result is still a GGUF:
every other tensor and key is unchanged, and `zipmoe unpack` gives back the original file
bit for bit. llama.cpp with zipmoe's patch runs it directly."""

EPILOG = """\
examples:
  zipmoe demo                                   try it all on a synthetic model
  zipmoe inspect model-bf16.gguf                what would compression gain?
  zipmoe convert model-bf16.gguf model.zipmoe.gguf
  zipmoe verify model.zipmoe.gguf --against model-bf16.gguf
  zipmoe unpack model.zipmoe.gguf model-bf16-again.gguf

exit status: 0 success, 1 verify found a difference, 2 bad input or usage, 130 interrupted.
docs/FORMAT.md specifies the file format."""


# ------------------------------------------------------------------------------------------ formatting


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _pct(x: float | None, signed: bool = False) -> str:
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
    header = ("tensor group", "tensors", "BF16 size", "zipmoe size", "ratio", "floor", "vs floor")
    rows = [(g["label"], str(g["n_tensors"] or ""), human_size(g["bf16_bytes"]),
             "-" if g["zipmoe_bytes"] is None else human_size(g["zipmoe_bytes"]),
             _pct(g["ratio"]), _pct(g["floor"]), _pct(g["floor_gap_pct"], signed=True)) for g in groups]
    return render_table(header, rows)


def tensor_table(tensors: Sequence[dict[str, Any]]) -> str:
    header = ("tensor", "shape", "BF16 size", "zipmoe size", "H(exp)", "ratio", "floor", "vs floor")
    rows = [(t["name"], "x".join(map(str, t["dims"])), human_size(t["bf16_bytes"]),
             "-" if t["zipmoe_bytes"] is None else human_size(t["zipmoe_bytes"]),
             f"{t['exponent_entropy']:.3f}", _pct(t["ratio"]), _pct(t["floor"]),
             _pct(t["floor_gap_pct"], signed=True)) for t in tensors]
    return render_table(header, rows)


TABLE_NOTE = ("ratio = zipmoe size / BF16 size; floor = (8 + H(exp)) / 16, the best a code that stores "
              "sign+mantissa raw can do; vs floor = ratio / floor - 1")


def _print_json(data: dict[str, Any]) -> None:
    print(json.dumps(data, indent=2))


# -------------------------------------------------------------------------------------------- commands


def cmd_convert(args: argparse.Namespace) -> int:
    from . import convert

    if args.level is not None and args.codec != "zstd":
        raise ZipmoeError("--level applies to --codec zstd only")
    report = convert.convert(
        args.src, args.dst, codec=args.codec,
        level=convert.zcodec.DEFAULT_ZSTD_LEVEL if args.level is None else args.level,
        chunk_n=args.chunk_size, threads=args.threads, progress=for_terminal(args.quiet or args.json),
    )
    if args.json:
        _print_json(report.to_dict())
    elif not args.quiet:
        total = report.rows()[-1]
        print(f"{report.src} -> {report.dst}: {human_size(report.source_size)} -> "
              f"{human_size(report.output_size)} ({total.ratio:.1%}) in {report.seconds:.1f} s "
              f"[{report.codec}, {report.chunk_n} values per chunk, {report.threads} threads]")
        print()
        print(size_table([r.to_dict() for r in report.rows()]))
        print(TABLE_NOTE)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from . import convert

    report = convert.verify(args.file, args.against, threads=args.threads,
                            progress=for_terminal(args.quiet or args.json))
    if args.json:
        _print_json({**report.to_dict(), "ok": True})
    elif not args.quiet:
        against = f"; identical to {report.against}" if report.against else ""
        print(f"OK {report.path}: {report.tensors} expert tensors, {report.experts} experts, {report.chunks} "
              f"chunks decoded with good checksums; the restored source matches its sha256 "
              f"{report.sha256[:16]}...{against}")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    from . import convert

    info = convert.inspect(args.file, progress=for_terminal(args.json))
    if args.json:
        _print_json(info)
        return EXIT_OK
    print(f"{info['file']}: {human_size(info['file_size'])}, {info['status']}")
    if info["compressed"]:
        src = info["source"]
        print(f"codec {info['codec']} (level {info['codec_level']}), {info['chunk_size']} values per chunk; "
              f"source {human_size(src['size'])}, sha256 {src['sha256']}")
    for t in info["unsupported_experts"]:
        print(f"  {t['name']}: {t['type']}")
    if info["tensors"]:
        print()
        print(tensor_table(info["tensors"]))
        print()
        print(size_table(info["groups"]))
        print(TABLE_NOTE)
    return EXIT_OK


def cmd_unpack(args: argparse.Namespace) -> int:
    from . import convert

    report = convert.unpack(args.file, args.out, threads=args.threads, progress=for_terminal(args.quiet))
    if not args.quiet:
        print(f"{report.path} -> {report.out}: {human_size(report.size)}, sha256 {report.sha256} "
              f"matches the original's")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from . import convert, synth

    progress = for_terminal(args.quiet)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="zipmoe-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model, packed, restored = (workdir / f"{args.preset}-{args.arch}{s}.gguf" for s in ("", ".zipmoe", ".restored"))
    say: Callable[[str], None] = (lambda s: None) if args.quiet else print
    try:
        config = synth.for_arch(synth.PRESETS[args.preset], args.arch)
        progress.start("generate", synth.tensor_data_bytes(config))
        made = synth.write_config(model, config, progress=_synth_progress(progress))
        progress.close()
        say(f"1. generated {model} ({human_size(made.file_size)}): a {args.arch} model with random BF16 weights")
        report = convert.convert(model, packed, threads=args.threads, progress=progress)
        say(f"2. converted it to {packed} ({human_size(report.output_size)}) in {report.seconds:.1f} s")
        checked = convert.verify(packed, model, threads=args.threads, progress=progress)
        say(f"3. verified: {checked.experts} experts decode bit for bit to the source's")
        back = convert.unpack(packed, restored, threads=args.threads, progress=progress)
        if back.sha256 != report.sha256:
            raise convert.MismatchError(f"{restored} has sha256 {back.sha256}, the source {report.sha256}")
        say(f"4. unpacked it to {restored}: sha256 {back.sha256[:16]}... equals the source's")
        say("")
        say(size_table([r.to_dict() for r in report.rows()]))
        say(TABLE_NOTE)
    finally:
        progress.close()
        if not args.keep:
            if args.workdir:
                for p in (model, model.with_name(model.name + ".part"), packed, restored):
                    p.unlink(missing_ok=True)
            else:
                shutil.rmtree(workdir, ignore_errors=True)
    if args.keep:
        say(f"files kept in {workdir}")
    return EXIT_OK


def _synth_progress(progress: Progress) -> Callable[[int, int, str], None]:
    """synth reports cumulative bytes; Progress wants increments."""
    last = [0]

    def update(done: int, total: int, name: str) -> None:
        progress.advance(done - last[0])
        last[0] = done

    return update


# --------------------------------------------------------------------------------------------- parsing


def _para(text: str) -> str:
    """A description paragraph wrapped for the terminal (the formatter keeps the epilogs' line breaks)."""
    return textwrap.fill(text, width=min(100, shutil.get_terminal_size().columns - 2))


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    from . import codec

    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="zipmoe", description=DESCRIPTION, epilog=EPILOG, formatter_class=fmt)
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "convert", formatter_class=fmt, help="compress the BF16 expert tensors of a GGUF",
        description=_para("Compress every BF16 expert tensor (blk.N.ffn_{up,gate,down,gate_up}_exps.weight) of SRC "
                      "into DST, a GGUF that keeps every other tensor and key of SRC. SRC is read twice "
                      "(statistics, then encoding); memory use does not grow with the model."),
        epilog="examples:\n  zipmoe convert model-bf16.gguf model.zipmoe.gguf\n"
               "  zipmoe convert model-bf16.gguf model.zipmoe.gguf --codec zstd --level 3 --threads 8")
    p.add_argument("src", metavar="SRC", help="a BF16 MoE GGUF")
    p.add_argument("dst", metavar="DST", help="the zipmoe GGUF to write (replaced if it exists)")
    p.add_argument("--codec", choices=("auto", "huff", "zstd"), default="auto",
                   help=f"exponent codec: huff (fast to decode) or zstd; auto = {codec.DEFAULT_CODEC}")
    p.add_argument("--level", type=int, metavar="N",
                   help=f"zstd compression level (default: {codec.DEFAULT_ZSTD_LEVEL}; zstd only)")
    p.add_argument("--chunk-size", type=_positive, default=codec.DEFAULT_CHUNK_N, metavar="N",
                   help="BF16 values per independently decodable chunk (default: %(default)s)")
    _add_threads(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bars, no size table")
    p.set_defaults(run=cmd_convert)

    p = sub.add_parser(
        "verify", formatter_class=fmt, help="check that a zipmoe file restores its source exactly",
        description=_para("Decode every expert of FILE (each chunk's checksum is checked) and restore the source in "
                      "memory, checking its sha256 against the one recorded at conversion. With --against, "
                      "also compare with the source file and name the first differing value."),
        epilog="example:\n  zipmoe verify model.zipmoe.gguf --against model-bf16.gguf")
    p.add_argument("file", metavar="FILE", help="a zipmoe GGUF")
    p.add_argument("--against", metavar="SRC", help="the BF16 GGUF it was converted from")
    _add_threads(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bars, no report (the exit status tells)")
    p.set_defaults(run=cmd_verify)

    p = sub.add_parser(
        "inspect", formatter_class=fmt, help="sizes, exponent entropy and ratios of a GGUF",
        description=_para("For a zipmoe file: per expert tensor its BF16 and compressed sizes, the entropy of its "
                      "exponents H(exp), the entropy floor (8 + H(exp)) / 16 and how far the achieved ratio is "
                      "above it. For a plain GGUF: its expert tensors, their measured H(exp) and floor."),
        epilog="examples:\n  zipmoe inspect model.zipmoe.gguf\n  zipmoe inspect model-bf16.gguf --json")
    p.add_argument("file", metavar="FILE", help="a zipmoe or plain GGUF")
    p.add_argument("--json", action="store_true", help="print everything as JSON on stdout")
    p.set_defaults(run=cmd_inspect)

    p = sub.add_parser(
        "unpack", formatter_class=fmt, help="restore the original BF16 GGUF",
        description=_para("Write the source of FILE back, byte for byte, to OUT; its sha256 is checked before OUT "
                      "appears."),
        epilog="example:\n  zipmoe unpack model.zipmoe.gguf model-bf16.gguf")
    p.add_argument("file", metavar="FILE", help="a zipmoe GGUF")
    p.add_argument("out", metavar="OUT", help="where to write the restored GGUF")
    _add_threads(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars, no report")
    p.set_defaults(run=cmd_unpack)

    p = sub.add_parser(
        "demo", formatter_class=fmt, help="generate a synthetic MoE model, convert, verify and unpack it",
        description=_para("Run the whole cycle on a synthetic BF16 MoE model with random weights (whose exponents "
                      "have the statistics of trained ones): generate, convert, verify against the source, "
                      "unpack and compare sha256, then print the size table."),
        epilog="examples:\n  zipmoe demo\n  zipmoe demo --preset tiny --arch olmoe --workdir /tmp/z --keep")
    p.add_argument("--preset", choices=("tiny", "small"), default="small",
                   help="model size: tiny (~0.3 MB) or small (~64 MB, the default)")
    p.add_argument("--arch", choices=("qwen3moe", "olmoe"), default="qwen3moe", help="model architecture")
    p.add_argument("--workdir", metavar="DIR", help="where to put the files (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the files afterwards")
    _add_threads(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars, no output")
    p.set_defaults(run=cmd_demo)
    return parser


def _add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=_positive, metavar="N", help="worker threads (default: all CPUs)")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
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
