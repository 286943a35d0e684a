#!/usr/bin/env python3
"""Bare llama-bench with --memory-budget against `zipmoe bench` with the same budget, interleaved.

A user who runs zipmoe's llama-bench (or llama-cli, llama-server) with --memory-budget and nothing in their
environment should get what the `zipmoe` wrapper gets. The wrapper sets OpenMP's GOMP_SPINCOUNT for the programs
it starts; a bare program under a budget sets it itself and executes itself again (patches/0005-zipmoe-args.patch).
Per budget and round, one run of each variant, each a fresh process, their order turned around every round (the
first of two runs measured slower on a loaded machine, and load drifts), so that neither order nor drift favours one:

  bare     llama-bench -m ZIPMOE --memory-budget B, nothing of zipmoe's or OpenMP's in the environment
  zipmoe   zipmoe bench ZIPMOE --memory-budget B (the wrapper)
  spin     bare, with GOMP_SPINCOUNT=300000, libgomp's own default, set by hand: what a bare program ran like
           before it set the spin itself

Every run starts --settle seconds after the previous one ended, so that the variants start alike: without the
pause bare llama-bench started within milliseconds of the previous run's exit, the wrapper's llama-bench about a
second later (Python's start-up). The two configure the cache identically (tests/system/test_llama_flags.py checks
it) and, run for run, count the same hits, misses, evictions and bytes read, so what remains between them is how
and when the program starts.

Budgets are percentages of the BF16 file's size, as in bench_budget.py. The speed of each run is llama-bench's tg
tokens/s; the table gives each variant's median over the rounds and the median over the rounds of bare / zipmoe
within a round (paired: a round's runs share the machine's load). --spin adds the third variant.

  .venv/bin/python tools/bench/bench_flags.py --preset 1g --budgets 75,93 --rounds 6 -n 64 -t 2 [--spin] [--settle 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import results  # noqa: E402

from pyzipmoe.runtime.config import RUNTIME_ENV  # noqa: E402

VARIANTS = ("bare", "zipmoe", "spin")  # (spin with --spin only)
LIBGOMP_DEFAULT_SPIN = "300000"


def clean_env() -> dict[str, str]:
    drop = set(RUNTIME_ENV) | {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"}
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("LLAMA_ARG_")}


def tg_speed(stdout: str) -> float:
    rows = json.loads(stdout[stdout.index("["):])
    return float(next(r for r in rows if r.get("n_gen", 0) > 0 and r.get("n_prompt", 1) == 0)["avg_ts"])


def run(variant: str, bin_dir: Path, model: Path, budget: str, n_gen: int, threads: int, reps: int) -> float:
    flags = ["-p", "0", "-n", str(n_gen), "-r", str(reps), "-t", str(threads)]
    env = clean_env()
    if variant == "zipmoe":
        argv = [sys.executable, "-m", "pyzipmoe", "bench", str(model), "--memory-budget", budget, "--json",
                "--no-planner", *flags]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False, timeout=900)
        if done.returncode != 0:
            raise SystemExit(f"zipmoe bench failed: {done.stderr[-2000:]}")
        return float(next(r for r in json.loads(done.stdout)["results"] if r["n_gen"] > 0)["tokens_per_second"])
    if variant == "spin":
        env["GOMP_SPINCOUNT"] = LIBGOMP_DEFAULT_SPIN
    argv = [str(bin_dir / "llama-bench"), "-m", str(model), "--memory-budget", budget, "-o", "json", *flags]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"llama-bench failed: {done.stderr[-2000:]}")
    return tg_speed(done.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a zipmoe GGUF (default: a SYNTHETIC model of --preset, made here)")
    p.add_argument("--bf16-size", type=int, help="its BF16 source's size in bytes (with --model)")
    p.add_argument("--preset", default="1g", help="synthetic preset when no --model (default: %(default)s)")
    p.add_argument("--budgets", default="75,93", help="percentages of the BF16 file (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("-r", "--repetitions", type=int, default=2, help="llama-bench's, per run (default: %(default)s)")
    p.add_argument("--spin", action="store_true", help="also run bare with libgomp's default spin (slow)")
    p.add_argument("-n", "--n-gen", type=int, default=32)
    p.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--settle", type=float, default=3.0,
                   help="seconds between a run's end and the next run's start (default: %(default)s)")
    p.add_argument("--json", type=Path, help="write every run's speed here")
    p.add_argument("--note", action="append", default=[], help="a line for the result file (e.g. the load)")
    results.add_arguments(p)
    args = p.parse_args(argv)

    from pyzipmoe.paths import bin_dir

    work = Path(tempfile.mkdtemp(prefix="bench-flags-"))
    if args.model is None:
        from pyzipmoe import synth
        from pyzipmoe.file import convert

        src = work / f"{args.preset}-bf16.gguf"
        made = synth.write_config(src, synth.PRESETS[args.preset])
        model, bf16_size = work / f"{args.preset}.zipmoe.gguf", made.file_size
        convert.convert(src, model)
        src.unlink()
        weights = f"{results.SYNTHETIC}, preset {args.preset} ({bf16_size / 2**30:.2f} GiB BF16)"
    else:
        if args.bf16_size is None:
            p.error("--model needs --bf16-size")
        model, bf16_size = args.model, args.bf16_size
        weights = f"{results.SYNTHETIC}, {model}" if results.synthetic_gguf(model) else str(model)
    speeds: dict[str, dict[str, list[float]]] = {}
    variants = VARIANTS if args.spin else VARIANTS[:2]
    order = list(variants)
    for r in range(args.rounds):
        for pct in args.budgets.split(","):
            budget = f"{int(bf16_size * float(pct) / 100) // 2**20}MiB"
            for variant in order:
                time.sleep(args.settle)
                tps = run(variant, bin_dir(), model, budget, args.n_gen, args.threads, args.repetitions)
                speeds.setdefault(pct, {}).setdefault(variant, []).append(tps)
                print(f"round {r + 1} budget {pct}% ({budget}) {variant}: {tps:.2f} tokens/s", file=sys.stderr,
                      flush=True)
        order.reverse()
    lines = [f"{'budget':>8}  {'bare llama-bench':>18}  {'zipmoe bench':>14}  {'bare / zipmoe':>13}"
             + (f"  {'bare, libgomp spin':>18}" if args.spin else "")]
    for pct, by in speeds.items():
        med = {v: statistics.median(by[v]) for v in variants}
        paired = statistics.median(b / z for b, z in zip(by["bare"], by["zipmoe"]))
        lines.append(f"{pct + '%':>8}  {med['bare']:>18.2f}  {med['zipmoe']:>14.2f}  {paired:>13.3f}"
                     + (f"  {med['spin']:>18.2f}" if args.spin else ""))
    table = "\n".join(lines) + (f"\n\ntg{args.n_gen} tokens/s (llama-bench -r {args.repetitions}), median of "
                                f"{args.rounds} interleaved rounds, {args.threads} threads, {args.settle:g} s between "
                                "runs; budgets as % of the BF16 file; bare / zipmoe: the median of the rounds' ratios")
    print(table)
    if args.json:
        args.json.write_text(json.dumps({"speeds": speeds, "bf16_bytes": bf16_size}, indent=2))
    results.write(args, "flags", table, weights=weights, json_path=args.json,
                  notes=args.note)
    for f in work.iterdir():
        f.unlink()
    work.rmdir()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
