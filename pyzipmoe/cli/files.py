"""`zipmoe convert`, `verify`, `inspect` and `unpack`: zipmoe's files.

Modules that load the native library (codec, convert) are imported inside functions, under main()'s error handling,
so a missing library is one line that says how to build it, not an import traceback.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ZipmoeError
from ..progress import for_terminal
from .formatting import (
    EXIT_OK,
    TABLE_NOTE,
    add_report_flags,
    command,
    human_size,
    positive,
    print_json,
    size_table,
    tensor_table,
)

# -------------------------------------------------------------------------------------------- commands


def cmd_convert(args: argparse.Namespace) -> int:
    from ..file import convert

    if args.level is not None and args.codec != "zstd":
        raise ZipmoeError("--level applies to --codec zstd only")
    report = convert.convert(
        args.src, args.dst, codec=args.codec,
        level=convert.zcodec.DEFAULT_ZSTD_LEVEL if args.level is None else args.level,
        chunk_n=args.chunk_size, threads=args.threads, progress=for_terminal(args.quiet or args.json),
    )
    if args.json:
        print_json(report.to_dict())
    elif not args.quiet:
        total = report.rows()[-1]
        print(f"{report.src} -> {report.dst}: {human_size(report.source_size)} -> "
              f"{human_size(report.output_size)} ({total.ratio:.1%}) in {report.seconds:.1f} s "
              f"[{report.codec}, {'whole rows' if report.codec == 'raw' else report.chunk_n} "
              f"{'' if report.codec == 'raw' else 'values '}per chunk, {report.threads} threads]")
        print()
        print(size_table([r.to_dict() for r in report.rows()]))
        print(TABLE_NOTE)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from ..file import verify

    report = verify.verify(args.file, args.against, threads=args.threads,
                            progress=for_terminal(args.quiet or args.json))
    if args.json:
        print_json({**report.to_dict(), "ok": True})
    elif not args.quiet:
        against = f"; identical to {report.against}" if report.against else ""
        print(f"OK {report.path}: {report.tensors} expert tensors, {report.experts} experts, {report.chunks} "
              f"chunks decoded with good checksums; the restored source matches its sha256 "
              f"{report.sha256[:16]}...{against}")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..file import convert

    info = convert.inspect(args.file, progress=for_terminal(args.json))
    if args.json:
        print_json(info)
        return EXIT_OK
    print(f"{info['file']}: {human_size(info['file_size'])}, {info['status']}")
    if info["compressed"]:
        src = info["source"]
        chunks = ("whole rows per chunk" if info["codec"] == "raw" else f"{info['chunk_size']} values per chunk")
        print(f"codec {info['codec']} (level {info['codec_level']}), {chunks}; "
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
    from ..file import verify

    report = verify.unpack(args.file, args.out, threads=args.threads, progress=for_terminal(args.quiet))
    if not args.quiet:
        print(f"{report.path} -> {report.out}: {human_size(report.size)}, sha256 {report.sha256} "
              f"matches the original's")
    return EXIT_OK


# --------------------------------------------------------------------------------------------- parsing


def register(sub: Any) -> None:
    """Adds convert, verify, inspect, unpack to the `zipmoe` command's subparsers."""
    from ..file import codec

    p = command(
        sub, "convert", cmd_convert, help="compress the expert tensors of a GGUF", examples=(
            "zipmoe convert model-bf16.gguf model.zipmoe.gguf",
            "zipmoe convert model-bf16.gguf model.zipmoe.gguf --codec zstd --level 3 --threads 8"),
        description="Compress every expert tensor (blk.N.ffn_{up,gate,down,gate_up}_exps.weight) of SRC "
                    "into DST, a GGUF that keeps every other tensor and key of SRC: BF16 and F16 experts entropy "
                    "coded, F32 and quantized ones (Q8_0, Q4_K, IQ4_XS, ...) stored raw, all in checksummed "
                    "chunks. SRC is read twice (statistics, then encoding); memory use does not grow with the "
                    "model.")
    p.add_argument("src", metavar="SRC", help="a MoE GGUF")
    p.add_argument("dst", metavar="DST", help="the zipmoe GGUF to write (replaced if it exists)")
    p.add_argument("--codec", choices=("auto", "huff", "esc", "zstd"), default="auto",
                   help="codec of BF16/F16 experts: huff (the smallest of the fast ones), esc (BF16 only; 2-3%% "
                        "larger, decoded several times faster on CPUs with AVX-512 VBMI2, slower than huff "
                        f"elsewhere) or zstd; auto = {codec.DEFAULT_CODEC}, or zstd level 1 for a model whose "
                        "BF16/F16 experts are all F16 (as small, decoded faster)")
    p.add_argument("--level", type=int, metavar="N",
                   help=f"zstd compression level (default: {codec.DEFAULT_ZSTD_LEVEL}; zstd only)")
    p.add_argument("--chunk-size", type=positive, default=codec.DEFAULT_CHUNK_N, metavar="N",
                   help="values per independently decodable chunk (default: %(default)s; raw experts: whole "
                        "rows of about the bytes as many BF16 values take)")
    add_threads(p)
    add_report_flags(p, json_help="print the report as JSON on stdout",
                     quiet_help="no progress bars, no size table")

    p = command(sub, "verify", cmd_verify, help="check that a zipmoe file restores its source exactly",
                examples=["zipmoe verify model.zipmoe.gguf --against model-bf16.gguf"],
                description="Decode every expert of FILE (each chunk's checksum is checked) and restore the source "
                            "in memory, checking its sha256 against the one recorded at conversion. With "
                            "--against, also compare with the source file and name the first differing value.")
    p.add_argument("file", metavar="FILE", help="a zipmoe GGUF")
    p.add_argument("--against", metavar="SRC", help="the GGUF it was converted from")
    add_threads(p)
    add_report_flags(p, json_help="print the report as JSON on stdout",
                     quiet_help="no progress bars, no report (the exit status tells)")

    p = command(
        sub, "inspect", cmd_inspect, help="sizes, exponent entropy and ratios of a GGUF",
        examples=("zipmoe inspect model.zipmoe.gguf", "zipmoe inspect model-bf16.gguf --json"),
        description="For a zipmoe file: per expert tensor its type, source and compressed sizes, the entropy "
                    "of its exponents H(exp) (of its bytes for quantized types), the entropy floor and how far "
                    "the achieved ratio is above it. For a plain GGUF: its expert tensors, their measured H(exp) "
                    "and floor.")
    p.add_argument("file", metavar="FILE", help="a zipmoe or plain GGUF")
    p.add_argument("--json", action="store_true", help="print everything as JSON on stdout")

    p = command(
        sub, "unpack", cmd_unpack, help="restore the original GGUF",
        description="Write the source of FILE back, byte for byte, to OUT; its sha256 is checked before OUT "
                    "appears.",
        examples=["zipmoe unpack model.zipmoe.gguf model-bf16.gguf"])
    p.add_argument("file", metavar="FILE", help="a zipmoe GGUF")
    p.add_argument("out", metavar="OUT", help="where to write the restored GGUF")
    add_threads(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars, no report")


def add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=positive, metavar="N", help="worker threads (default: all CPUs)")


# ------------------------------------------------------------------- running models: run, serve, bench
