#!/usr/bin/env python3
"""Guest instructions per value of zipmoe's kernels on emulated ARM64: each NEON kernel against its portable oracle.

ARM64 speed cannot be measured under qemu, but the work a kernel does can: a qemu-user plugin
(tools/dev/qemu_insn_count.c) counts the instructions a program executes, and zipmoe-selftest's bench mode runs one
kernel REPS times over N values. A kernel's instructions per value are the difference between REPS repetitions and
none (which cancels the setup), over REPS x N. Counts are deterministic; they are not cycles (a NEON instruction may
take more than one, and a table lookup's latency is not counted), so they say which path does less work, not how
much faster it runs.

    tools/bench/arm64_insn.py --build build-arm64 --plugin build-arm64/libqemu_insn_count.so
    tools/bench/arm64_insn.py ... --novec-build build-arm64-novec   # also the portable C without auto-vectorization

(tools/dev/cross_arm64.sh insn builds the plugin and runs this.)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results as result_files  # noqa: E402

SYSROOT = "/usr/aarch64-linux-gnu"
KERNELS = ("split", "merge", "checksum")


def qemu_cmd(plugin: Path, program: Path, *args: str) -> list[str]:
    # the sysroot's libc with its loader (tools/dev/cross_arm64.sh says why)
    return ["qemu-aarch64", "-L", SYSROOT, "-E", "LD_LIBRARY_PATH=/lib:/usr/lib/aarch64-linux-gnu",
            "-plugin", str(plugin), str(program), *args]


def count(plugin: Path, build: Path, kernel: str, n: int, reps: int) -> int:
    out = subprocess.run(qemu_cmd(plugin, build / "bin" / "zipmoe-selftest", "bench", kernel, str(n), str(reps)),
                         capture_output=True, text=True, timeout=600, check=False)
    m = re.search(r"^insns: (\d+)$", out.stderr, re.M)
    if out.returncode != 0 or not m:
        raise SystemExit(f"arm64_insn.py: {kernel} did not run under qemu: {out.stderr[-2000:]}")
    return int(m[1])


def per_value(plugin: Path, build: Path, kernel: str, n: int, reps: int) -> float:
    return (count(plugin, build, kernel, n, reps) - count(plugin, build, kernel, n, 0)) / (reps * n)


def table(args: argparse.Namespace) -> str:
    novec = args.novec_build is not None
    head = f"{'kernel':<10} {'portable':>9} {'neon':>7} {'ratio':>6}"
    if novec:
        head += f" {'no-autovec':>11} {'ratio':>6}"
    lines = [head]
    for k in KERNELS:
        portable = per_value(args.plugin, args.build, f"{k}-scalar", args.n, args.reps)
        neon = per_value(args.plugin, args.build, f"{k}-neon", args.n, args.reps)
        row = f"{k:<10} {portable:>9.3f} {neon:>7.3f} {portable / neon:>6.2f}"
        if novec:
            plain = per_value(args.plugin, args.novec_build, f"{k}-scalar", args.n, args.reps)
            row += f" {plain:>11.3f} {plain / neon:>6.2f}"
        lines.append(row)
    for k, name in (("huff", "huff"), ("esc-scalar", "esc")):
        lines.append(f"{name:<10} {per_value(args.plugin, args.build, k, args.n, args.reps):>9.3f} {'-':>7} {'-':>6}")
    lines += ["",
              f"guest instructions per value (N = {args.n} values, {args.reps} repetitions less none), qemu-aarch64",
              "split: BF16 -> exponent + sign/mantissa planes; merge: the reverse; checksum: XXH3-64, per byte;",
              "huff, esc: exponent decoding of one chunk by the portable decoders (no NEON decoder: see the README).",
              "portable: the C reference at -O3, which GCC auto-vectorizes for the base NEON"
              + ("; no-autovec: the same C built with -fno-tree-vectorize" if novec else "") + ".",
              "ratio: portable (or no-autovec) instructions over NEON's: above 1, NEON does less work."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", type=Path, required=True, help="the ARM64 build with zipmoe-selftest in bin/")
    p.add_argument("--plugin", type=Path, required=True, help="the qemu plugin (tools/dev/qemu_insn_count.c, built)")
    p.add_argument("--novec-build", type=Path, help="an ARM64 build with -fno-tree-vectorize, for a plain-C column")
    p.add_argument("-n", type=int, default=65536, help="values per repetition (default: %(default)s)")
    p.add_argument("--reps", type=int, default=20, help="repetitions (default: %(default)s)")
    result_files.add_arguments(p)
    args = p.parse_args(argv)
    text = table(args)
    print(text, end="")
    result_files.write(args, "arm64-insn", text, weights="SYNTHETIC weights (Gaussian-like BF16, zipmoe-selftest)",
                       argv=result_files.script_argv(__file__, argv),
                       notes=["instructions counted under qemu-user emulation: not ARM64 speed"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
