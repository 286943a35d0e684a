"""The `zipmoe` command: convert, verify, inspect, unpack, demo; run, serve, bench (zipmoe's llama.cpp).

Expected failures (bad input, corrupted files, missing files) print one line, `zipmoe: error: ...`, and
exit with 2 (1 when verify finds a difference); a traceback means a bug in zipmoe.

Modules that load the native library (codec, convert) are imported inside functions, under main()'s
error handling, so a missing library is one line that says how to build it, not an import traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import ZipmoeError
from ..progress import Progress, for_terminal

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
  zipmoe run model.zipmoe.gguf -p 'Once upon a time'   complete a prompt with zipmoe's llama.cpp
  zipmoe serve model.zipmoe.gguf                         llama-server on http://127.0.0.1:8080
  zipmoe bench model-bf16.gguf model.zipmoe.gguf         tokens/s of both (llama-bench)
  zipmoe run model.zipmoe.gguf --memory-budget 6GiB -p 'Hi'  under a memory budget (planned once calibrated)
  zipmoe calibrate model.zipmoe.gguf                     measure this machine's decode and disk costs
  zipmoe plan model.zipmoe.gguf --memory-budget 6GiB     the planner's split of the budget, per layer

exit status: 0 success, 1 verify found a difference, 2 bad input or usage, 130 interrupted.
run, serve and bench exit with the status of the llama.cpp program they run.
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
    from ..file import convert

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
    from ..file import convert

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
    from ..file import convert

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
    from ..file import convert

    report = convert.unpack(args.file, args.out, threads=args.threads, progress=for_terminal(args.quiet))
    if not args.quiet:
        print(f"{report.path} -> {report.out}: {human_size(report.size)}, sha256 {report.sha256} "
              f"matches the original's")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from ..file import convert
    from .. import synth

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
    from ..file import codec

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
    p.add_argument("--codec", choices=("auto", "huff", "esc", "zstd"), default="auto",
                   help="exponent codec: huff (the smallest of the fast ones), esc (2-3%% larger, decoded several "
                        "times faster on CPUs with AVX-512 VBMI2, slower than huff elsewhere) or zstd; "
                        f"auto = {codec.DEFAULT_CODEC}")
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
    _add_llama_commands(sub, fmt)
    from .models import register as add_model_commands  # create, list/ls, show, cp, rm, prune, export, import

    add_model_commands(sub)
    from .calibrate import register as add_calibrate_command
    from .plan import register as add_plan_command

    add_calibrate_command(sub)
    add_plan_command(sub)
    return parser


def _add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=_positive, metavar="N", help="worker threads (default: all CPUs)")


# ------------------------------------------------------------------- running models: run, serve, bench


LLAMA_COMMANDS = ("run", "serve", "bench")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """build_parser().parse_args, except that for run/serve/bench everything after the first `--` is kept, untouched,
    as llama_args for the llama.cpp program (argparse would mix it into the positionals or drop later `--`s)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if argv[:1] and argv[0] in LLAMA_COMMANDS and "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    if argv[:1] and argv[0] in LLAMA_COMMANDS:
        args.llama_args = passthrough
    return args


def _llama_args(args: argparse.Namespace) -> list[str]:
    return list(getattr(args, "llama_args", None) or [])


def _common_llama_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    if getattr(args, "threads", None) is not None:
        flags += ["-t", str(args.threads)]
    if getattr(args, "ctx_size", None) is not None:
        flags += ["-c", str(args.ctx_size)]
    return flags


def _resolve(args: argparse.Namespace, program: str) -> tuple[str, list[str], Any]:
    """MODEL as a GGUF path or a stored model's name: (file, the package's flags for `program`, package)."""
    from ..models.local import resolve_model

    path, package = resolve_model(args.model)
    return str(path), (package.llama_program_args(program) if package else []), package


def cmd_run(args: argparse.Namespace) -> int:
    from ..runtime import runner

    model, package_flags, package = _resolve(args, "llama-cli")
    params = package.parameters if package else {}
    cache = args.cache or params.get("cache_policy")
    extra = _llama_args(args)
    if args.prompt is None:
        os.environ.update(_cache_settings(args, model, package))  # what libllama in llama-cli reads  # interactive chat: llama-cli; the package's flags first, so that the user's win
        argv = [str(runner.program("llama-cli")), "-m", model, *package_flags, *_common_llama_flags(args)]
        if args.n_predict is not None:
            argv += ["-n", str(args.n_predict)]
        if args.temp is not None:
            argv += ["--temp", str(args.temp)]
        if args.seed is not None:
            argv += ["--seed", str(args.seed)]
        return runner.run_foreground([*argv, *extra], runner.environment(cache))
    if extra:
        raise ZipmoeError("llama.cpp arguments after -- go to the interactive llama-cli, not to a -p completion; "
                          "for a single chat turn with llama-cli use: zipmoe run MODEL -- -st -p PROMPT")
    def pick(given: Any, key: str, default: Any) -> Any:
        return given if given is not None else params.get(key, default)

    completion = runner.complete(model, args.prompt, n_predict=pick(args.n_predict, "num_predict", 128),
                                 threads=args.threads, n_ctx=pick(args.ctx_size, "num_ctx", None),
                                 temperature=pick(args.temp, "temperature", 0.8), seed=pick(args.seed, "seed", None),
                                 cache=cache or "unbounded", out=sys.stdout,
                                 options={"memory_budget": args.memory_budget or params.get("memory_budget"),
                                          "cache_policy": args.policy, "hot_share": args.hot_share,
                                          "sm_share": args.sm_share, "trace": args.trace,
                                          "planner": args.planner})
    print()
    if args.stats:
        runner.print_completion_stats(completion)
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    from ..runtime import runner

    model, package_flags, package = _resolve(args, "llama-server")
    cache = args.cache or (package.parameters.get("cache_policy") if package else None)
    os.environ.update(_cache_settings(args, model, package))
    argv = [str(runner.program("llama-server")), "-m", model, "--host", args.host, "--port", str(args.port),
            *package_flags, *_common_llama_flags(args)]
    return runner.run_foreground([*argv, *_llama_args(args)], runner.environment(cache))


def cmd_bench(args: argparse.Namespace) -> int:
    from ..runtime import runner

    flags = ["-p", str(args.n_prompt), "-n", str(args.n_gen), "-r", str(args.repetitions)]
    if args.threads is not None:
        flags += ["-t", str(args.threads)]
    if args.no_warmup:
        flags.append("--no-warmup")
    from ..runtime.llama import is_zipmoe_file

    zipmoe_models = [m for m in args.models if is_zipmoe_file(m)]
    if args.planner is True and args.memory_budget is not None and len(zipmoe_models) > 1:
        raise ZipmoeError("the planner plans one model at a time: bench one zipmoe model under --memory-budget, or "
                          "give --hot-share (and --sm-share) to split every model's budget the same way")
    os.environ.update(_cache_settings(args, zipmoe_models[0] if zipmoe_models else args.models[0]))
    results, records = runner.llama_bench(args.models, [*flags, *_llama_args(args)], cache=args.cache)
    if args.json:
        _print_json({"results": [r.to_dict() for r in results], "cache": args.cache or "unbounded",
                     "llama_bench": records})
        return EXIT_OK
    header = ("model", "size", "params", "threads", "ubatch", "test", "tokens/s")
    rows = [(r.model, human_size(r.model_size), f"{r.model_n_params / 1e6:.1f} M", str(r.n_threads), str(r.n_ubatch),
             r.test, f"{r.tokens_per_second:.2f} ± {r.stddev:.2f}") for r in results]
    print(render_table(header, rows))
    print(f"llama-bench, {args.repetitions} repetitions{', no warmup' if args.no_warmup else ' after a warmup run'}; "
          f"zipmoe cache: {args.cache or 'unbounded'}")
    return EXIT_OK


def _fraction(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= f <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {f}")
    return f


def _cache_settings(args: argparse.Namespace, model: str, package: Any = None) -> dict[str, str]:
    """The runtime's environment for MODEL from --memory-budget, --policy, --hot-share, --sm-share and --trace (a
    stored model's memory_budget parameter is the default budget); the planner splits the budget unless shares
    are given."""
    from ..runtime.controller import planner_by_default, runtime_environment
    from ..runtime.llama import is_zipmoe_file

    budget = args.memory_budget
    if budget is None and package is not None:
        budget = package.parameters.get("memory_budget")
    is_zipmoe = bool(is_zipmoe_file(model))
    use_planner = args.planner if args.planner is not None else planner_by_default(
        model, budget=budget, hot_share=args.hot_share, sm_share=args.sm_share, is_zipmoe=is_zipmoe)
    return runtime_environment(model, budget=budget, policy=args.policy, hot_share=args.hot_share,
                               sm_share=args.sm_share, trace=args.trace, is_zipmoe=is_zipmoe, use_planner=use_planner)


def _nonnegative(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {n}")
    return n


def _add_llama_options(p: argparse.ArgumentParser, *, ctx: str | None = "default: llama.cpp's") -> None:
    p.add_argument("-t", "--threads", type=_positive, metavar="N", help="CPU threads (default: llama.cpp's)")
    if ctx:
        p.add_argument("-c", "--ctx-size", type=_positive, metavar="N", help=f"context size in tokens ({ctx})")
    p.add_argument("--memory-budget", metavar="SIZE",
                   help="everything the model may keep resident: e.g. 6GiB, 512MiB, 60%%, or auto (what the machine "
                        "or container has free, less a margin). It holds the weights that are not experts, the "
                        "experts of one expert tensor in flight, and the expert cache: decoded experts, unless "
                        "--hot-share, --sm-share or --planner split it. Too small: an error says the minimum. "
                        "Default: unbounded. Sets ZIPMOE_MEMORY_BUDGET")
    p.add_argument("--policy", choices=("tlfu", "lru", "lfu", "fifo"),
                   help="eviction under a budget: tlfu (default, the paper's token-weighted LFU), lru, lfu, fifo")
    p.add_argument("--hot-share", type=_fraction, metavar="F",
                   help="share of the cache for decoded experts (default 1)")
    p.add_argument("--sm-share", type=_fraction, metavar="F",
                   help="fixed share for sign+mantissa planes (their exponents are read from disk); the rest of "
                        "the cache keeps whole compressed experts")
    p.add_argument("--planner", action=argparse.BooleanOptionalAction, default=None,
                   help="let the planner split the cache per layer (see zipmoe plan). Default: on under a budget "
                        "without shares once `zipmoe calibrate MODEL` has measured this machine, else the cache "
                        "keeps decoded experts. It re-plans from the order the run's tokens route in with -p "
                        "(llama-cpp-python); llama-cli and llama-server keep the first plan (from --trace)")
    p.add_argument("--trace", metavar="FILE",
                   help="expert activation counts for the planner (.npz with counts[prompts, layers, experts]); "
                        "default: every expert equally likely")
    p.add_argument("--cache", choices=("unbounded", "none"),
                   help="zipmoe expert cache: unbounded (default) keeps decoded experts, none decodes on every "
                        "use (sets ZIPMOE_CACHE)")


def _add_llama_commands(sub: Any, fmt: type[argparse.HelpFormatter]) -> None:
    """`run`, `serve` and `bench`: zipmoe's llama.cpp build (build/bin) on a zipmoe or plain GGUF."""
    p = sub.add_parser(
        "run", formatter_class=fmt, usage="zipmoe run [options] MODEL [-- LLAMA_CLI_ARGS ...]",
        help="chat with a model, or complete a prompt (-p)",
        description=_para("Without -p: an interactive chat with llama-cli from zipmoe's build of llama.cpp. With -p: "
                          "a one-shot raw completion of PROMPT printed to stdout (through llama-cpp-python and the "
                          "same libllama). MODEL may be a zipmoe GGUF or a plain one. Arguments after -- go to "
                          "llama-cli."),
        epilog="examples:\n"
               "  zipmoe run model.zipmoe.gguf                                  chat (llama-cli)\n"
               "  zipmoe run model.zipmoe.gguf -p 'Once upon a time' -n 64      raw completion\n"
               "  zipmoe run model.zipmoe.gguf -p 'The capital of France is' --temp 0 --stats\n"
               "  zipmoe run model.zipmoe.gguf -- -st -p 'Why is the sky blue?'  one chat turn (llama-cli)\n"
               "  zipmoe run model.zipmoe.gguf -t 8 -- --jinja -sys 'Answer briefly.'")
    p.add_argument("model", metavar="MODEL", help="a zipmoe GGUF (or a plain GGUF)")
    p.add_argument("-p", "--prompt", metavar="PROMPT", help="complete PROMPT once and exit (raw completion)")
    p.add_argument("-n", "--n-predict", type=_positive, metavar="N", help="tokens to generate (default with -p: 128)")
    p.add_argument("--temp", type=float, metavar="T", help="sampling temperature; 0 = greedy (default: 0.8)")
    p.add_argument("--seed", type=_nonnegative, metavar="S", help="sampling seed (default: random)")
    p.add_argument("--stats", "-v", "--verbose", dest="stats", action="store_true",
                   help="with -p: print speed and the expert cache's counters (hits per tier, bytes read and decoded, "
                        "time stalled per token) to stderr")
    _add_llama_options(p, ctx="default: llama.cpp's; with -p the model's, at most 4096")
    p.set_defaults(run=cmd_run)

    p = sub.add_parser(
        "serve", formatter_class=fmt, usage="zipmoe serve [options] MODEL [-- LLAMA_SERVER_ARGS ...]",
        help="serve a model over HTTP (llama-server)",
        description=_para("Run llama-server from zipmoe's build of llama.cpp on MODEL: an OpenAI-compatible HTTP API "
                          "and a web UI. Arguments after -- go to llama-server."),
        epilog="examples:\n"
               "  zipmoe serve model.zipmoe.gguf                     http://127.0.0.1:8080\n"
               "  zipmoe serve model.zipmoe.gguf --host 0.0.0.0 --port 9000 -t 8\n"
               "  zipmoe serve model.zipmoe.gguf -- -np 4 --jinja\n"
               "  curl http://127.0.0.1:8080/completion -d '{\"prompt\": \"Hello\", \"n_predict\": 16}'")
    p.add_argument("model", metavar="MODEL", help="a zipmoe GGUF (or a plain GGUF)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=_positive, default=8080, help="port (default: %(default)s)")
    _add_llama_options(p)
    p.set_defaults(run=cmd_serve)

    p = sub.add_parser(
        "bench", formatter_class=fmt, usage="zipmoe bench [options] MODEL [MODEL ...] [-- LLAMA_BENCH_ARGS ...]",
        help="measure prompt and generation speed (llama-bench)",
        description=_para("Measure prompt processing (ppN) and generation (tgN) speed in tokens/s with llama-bench "
                          "from zipmoe's build of llama.cpp. Give several models to compare them, e.g. a BF16 GGUF and "
                          "its zipmoe GGUF. llama-bench's warmup run decodes most experts, so by default this measures "
                          "a warm expert cache; --no-warmup measures the first run after loading. Arguments after -- "
                          "go to llama-bench."),
        epilog="examples:\n"
               "  zipmoe bench model.zipmoe.gguf\n"
               "  zipmoe bench model-bf16.gguf model.zipmoe.gguf -p 256 -n 64 -t 8\n"
               "  zipmoe bench model.zipmoe.gguf --cache none --json\n"
               "  zipmoe bench model.zipmoe.gguf -- -ub 1,512")
    p.add_argument("models", nargs="+", metavar="MODEL", help="one or more GGUFs (zipmoe or plain)")
    p.add_argument("-p", "--n-prompt", type=_nonnegative, default=512, metavar="N",
                   help="prompt tokens of the pp test, 0 for none (default: %(default)s)")
    p.add_argument("-n", "--n-gen", type=_nonnegative, default=128, metavar="N",
                   help="generated tokens of the tg test, 0 for none (default: %(default)s)")
    p.add_argument("-r", "--repetitions", type=_positive, default=5, metavar="N",
                   help="repetitions of each test (default: %(default)s)")
    p.add_argument("--no-warmup", action="store_true", help="no warmup run: the first repetition is a cold start")
    p.add_argument("--json", action="store_true", help="print the results (and llama-bench's records) as JSON")
    _add_llama_options(p, ctx=None)
    p.set_defaults(run=cmd_bench)


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
