#!/usr/bin/env python3
"""Write a synthetic BF16 MoE GGUF (random weights, loadable by stock llama.cpp) for zipmoe tests and benchmarks."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pyzipmoe.synth import PRESETS, ProgressFn, SynthConfig, for_arch, tensor_data_bytes, write_config  # noqa: E402

EPILOG = """\
examples:
  tools/dev/make_synth.py tiny.gguf                               # the "tiny" preset (~0.3 MB), qwen3moe
  tools/dev/make_synth.py --preset 2.8g --routing skewed ref.gguf # the reference benchmark model, Zipf-like routing
  tools/dev/make_synth.py --preset small --arch olmoe olmoe.gguf  # olmoe instead of qwen3moe
  tools/dev/make_synth.py --preset 1g --seed 7 --n-layer 12 x.gguf
  tools/dev/make_synth.py --list-presets

then, for instance:
  llama-simple -m tiny.gguf -n 8 "hello"
"""

# Config fields settable from the command line (arch and routing have their own choices).
_INT_FIELDS = ("n_layer", "n_embd", "n_ff_exp", "n_expert", "n_expert_used", "n_head", "n_head_kv", "head_dim",
               "n_vocab", "n_ctx", "seed")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output", nargs="?", type=Path, help="GGUF file to write")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="base configuration (default: tiny)")
    p.add_argument("--arch", choices=["qwen3moe", "olmoe"],
                   help="architecture (default: qwen3moe; olmoe adapts the attention geometry: "
                        "n_head_kv = n_head, head_dim = n_embd / n_head)")
    p.add_argument("--routing", choices=["uniform", "skewed"], help="expert usage profile (default: uniform)")
    for name in _INT_FIELDS:
        p.add_argument("--" + name.replace("_", "-"), type=int, dest=name, help=f"override the preset's {name}")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--list-presets", action="store_true", help="print the presets and their sizes, then exit")
    args = p.parse_args(argv)
    if args.output is None and not args.list_presets:
        p.error("the output path is required")
    return args


def _config(args: argparse.Namespace) -> SynthConfig:
    """The preset with the command line's overrides; --arch last, so olmoe can adapt the overridden shape."""
    overrides = {name: getattr(args, name) for name in (*_INT_FIELDS, "routing") if getattr(args, name) is not None}
    config = dataclasses.replace(PRESETS[args.preset], **overrides)
    return for_arch(config, args.arch) if args.arch else config


def _progress(quiet: bool) -> tuple[ProgressFn | None, Callable[[], None]]:
    """A per-tensor progress callback (tqdm bar if installed, else a line per 10%) and its closer."""
    if quiet:
        return None, lambda: None
    try:
        from tqdm import tqdm
    except ImportError:
        last = [-1]

        def report(done: int, total: int, name: str) -> None:
            tenth = done * 10 // total
            if tenth != last[0]:
                last[0] = tenth
                print(f"  {done * 100 // total:3d}%  {name}", file=sys.stderr)

        return report, lambda: None
    bar = tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="writing", file=sys.stderr)

    def update(done: int, total: int, name: str) -> None:
        bar.total = total
        bar.update(done - bar.n)
        bar.set_postfix_str(name, refresh=False)

    return update, bar.close


def _human(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _list_presets() -> None:
    for name, c in PRESETS.items():
        print(f"{name:6s} {_human(tensor_data_bytes(c)):>10s}  {c}")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.list_presets:
        _list_presets()
        return 0
    try:
        config = _config(args)
    except ValueError as e:
        print(f"make_synth: {e}", file=sys.stderr)
        return 2
    progress, close = _progress(args.quiet)
    try:
        info = write_config(args.output, config, progress=progress)
    finally:
        close()
    print(f"wrote {info.path}: {info.file_size} bytes ({_human(info.file_size)}), {info.n_tensors} tensors, "
          f"expert tensors {info.expert_bytes} bytes ({100 * info.expert_bytes / info.file_size:.1f}%)")
    print(f"config: {config}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
