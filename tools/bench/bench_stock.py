#!/usr/bin/env python3
"""zipmoe's llama.cpp against stock llama.cpp on plain GGUFs without a budget: the same speed, measured.

zipmoe patches llama.cpp (patches/); without a memory budget a plain GGUF must run as in stock llama.cpp, its graph
unchanged (tests/engine/test_llama.py checks the logits bit for bit against the stock build). This measures the
speed side: llama-bench of zipmoe's build (build/bin) and of stock llama.cpp, the same sdist built without the
patches (tools/dev/build_stock.sh: build/llama-stock/bin), on the same SYNTHETIC models (a BF16 one from
pyzipmoe.synth and llama-quantize's copies of it), nothing of zipmoe's in the environment. Per type and round, one
run of each build, each a fresh process, their order turned around every round so that neither order nor the
machine's drifting load favours one. The table gives each build's median pp and tg tokens/s over the rounds and the
median of the rounds' ratios (zipmoe / stock, paired: a round's runs share the machine's load).

--budgets P,P,... adds zipmoe runs with a memory budget of P % of the model file (ZIPMOE_MEMORY_BUDGET), in the same
rounds and without any memory limit: a user whose machine holds the file and who gives zipmoe a budget at or above
it. There zipmoe serves the plain file's experts from its cache (in the CPU backend's repacked layout where stock
repacks them: Q4_0, Q4_K, IQ4_NL, ...) and must be as fast as stock as users run it (issue 47: at least 0.98x from
100 to 150 %). --model FILE runs an existing GGUF (e.g. bench_budget's 1g models) instead of the preset's.

  .venv/bin/python tools/bench/bench_stock.py                          # small preset, BF16 Q8_0 Q4_K_M, 6 rounds
  .venv/bin/python tools/bench/bench_stock.py --preset 1g --types BF16,Q4_K_M --rounds 10 -t 2
  .venv/bin/python tools/bench/bench_stock.py --model build/bench-budget/1g+n_layer16+n_vocab4096-uniform.Q4_K_M.gguf \
      --budgets 100,125,150 --pp 512 -n 64 --rounds 6          # a plain Q4_K_M file that fits, under a budget
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import results  # noqa: E402

from pyzipmoe.paths import stock_bin_dir  # noqa: E402
from pyzipmoe.runtime.config import BUDGET_ENV, RUNTIME_ENV  # noqa: E402
from pyzipmoe.runtime.runner import library_path  # noqa: E402

BUILDS = ("stock", "zipmoe")


class BenchError(Exception):
    pass


def clean_env(bin_dir: Path) -> dict[str, str]:
    """The environment of one build's run: nothing of zipmoe's, that build's libraries first."""
    env = {k: v for k, v in os.environ.items()
           if k not in RUNTIME_ENV and k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY") and not k.startswith("LLAMA_ARG_")}
    env["LD_LIBRARY_PATH"] = library_path(bin_dir, env)
    return env


def ensure_models(workdir: Path, preset: str, types: list[str]) -> dict[str, Path]:
    """workdir/PRESET.gguf (SYNTHETIC BF16) and its llama-quantize copies, made when missing, reused otherwise."""
    from pyzipmoe import synth

    workdir.mkdir(parents=True, exist_ok=True)
    bf16 = workdir / f"{preset}.gguf"
    if not bf16.is_file():
        print(f"generating {bf16} (SYNTHETIC, preset {preset}) ...", file=sys.stderr, flush=True)
        part = workdir / f"{preset}.part.gguf"
        synth.write_config(part, synth.PRESETS[preset])
        part.replace(bf16)
    models = {}
    for qtype in types:
        if qtype == "BF16":
            models[qtype] = bf16
            continue
        path = workdir / f"{preset}-{qtype}.gguf"
        if not path.is_file() or path.stat().st_mtime < bf16.stat().st_mtime:
            print(f"quantizing it to {path.name} ...", file=sys.stderr, flush=True)
            synth.quantize(bf16, path, qtype)
        models[qtype] = path
    return models


def engine_name(budget: int | None) -> str:
    """A row's engine: zipmoe's build without a budget, or with one of `budget` % of the file."""
    return "zipmoe" if budget is None else f"zipmoe {budget}%"


def llama_bench(bin_dir: Path, model: Path, args: argparse.Namespace, budget: int | None = None) -> dict[str, float]:
    """pp and tg tokens/s of one llama-bench process (the mean of its -r passes); budget: zipmoe's memory budget
    as % of the model file, none when None."""
    argv = [str(bin_dir / "llama-bench"), "-m", str(model), "-p", str(args.pp), "-n", str(args.gen),
            "-r", str(args.reps), "-t", str(args.threads), "-o", "json"]
    env = clean_env(bin_dir)
    if budget is not None:
        env[BUDGET_ENV] = str(model.stat().st_size * budget // 100)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False, timeout=args.timeout)
    if done.returncode != 0:
        raise BenchError(f"{argv[0]} on {model.name} exited with {done.returncode}: {done.stderr[-1500:]}")
    rows = json.loads(done.stdout[done.stdout.index("["):])
    speed = {}
    for r in rows:
        speed["pp" if r["n_prompt"] > 0 else "tg"] = float(r["avg_ts"])
    return speed


def table(measured: dict[str, dict[str, list[dict[str, float]]]]) -> str:
    """One row per model and zipmoe engine (without a budget, with each of --budgets) against stock's runs."""
    head = ["type", "budget", "stock pp", "zipmoe pp", "pp ratio", "stock tg", "zipmoe tg", "tg ratio", "rounds"]
    body = [head]
    for qtype, runs in measured.items():
        for engine in (e for e in runs if e != "stock"):
            cells = [qtype, engine.removeprefix("zipmoe").strip() or "none"]
            for test in ("pp", "tg"):
                stock = [r[test] for r in runs["stock"]]
                ours = [r[test] for r in runs[engine]]
                ratios = [o / s for o, s in zip(ours, stock)]
                cells += [f"{statistics.median(stock):.2f}", f"{statistics.median(ours):.2f}",
                          f"{statistics.median(ratios):.3f}"]
            cells.append(str(len(runs["stock"])))
            body.append(cells)
    widths = [max(len(row[i]) for row in body) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in body)


def main(argv: list[str] | None = None) -> int:
    from pyzipmoe import synth

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--preset", choices=sorted(synth.PRESETS), default="small",
                   help="the SYNTHETIC model's size (default: small, ~64 MB)")
    p.add_argument("--types", default="BF16,Q8_0,Q4_K_M",
                   help=f"BF16 and llama-quantize types ({', '.join(synth.QUANT_TYPES)}); default BF16,Q8_0,Q4_K_M")
    p.add_argument("--model", type=Path, action="append", default=[], metavar="FILE",
                   help="an existing GGUF to run (repeatable; replaces --preset/--types)")
    p.add_argument("--budgets", default="", metavar="P,P,...",
                   help="also run zipmoe with a memory budget of P %% of the model file (no memory limit)")
    p.add_argument("--rounds", type=int, default=6, help="runs of each build per type, alternating (default 6)")
    p.add_argument("--pp", type=int, default=128, help="llama-bench -p (default 128)")
    p.add_argument("-n", "--gen", type=int, default=32, help="llama-bench -n (default 32)")
    p.add_argument("-r", "--reps", type=int, default=2, help="llama-bench -r (default 2)")
    p.add_argument("-t", "--threads", type=int, default=2, help="llama-bench -t (default 2)")
    p.add_argument("--stock-bin", type=Path, default=stock_bin_dir(),
                   help="stock llama.cpp's programs (default build/llama-stock/bin: tools/dev/build_stock.sh)")
    p.add_argument("--zipmoe-bin", type=Path, default=REPO / "build" / "bin", help="zipmoe's (default build/bin)")
    p.add_argument("--workdir", type=Path, default=REPO / "build" / "bench-stock")
    p.add_argument("--timeout", type=int, default=900, help="seconds one llama-bench run may take (default 900)")
    p.add_argument("--json", type=Path, help="write every run's speeds here")
    p.add_argument("--note", action="append", default=[], help="a line for the result file, e.g. the machine's load")
    results.add_arguments(p)
    args = p.parse_args(argv)
    types = [t for t in args.types.split(",") if t]
    try:
        budgets = [int(b) for b in args.budgets.split(",") if b]
    except ValueError:
        p.error(f"--budgets takes whole percentages of the model file, e.g. 100,150; got {args.budgets!r}")
    if any(b <= 0 for b in budgets):
        p.error(f"--budgets: each percentage must be above 0; got {args.budgets!r}")
    if missing := [str(m) for m in args.model if not m.is_file()]:
        p.error(f"no such model file: {', '.join(missing)}")
    if unknown := [t for t in types if t != "BF16" and t not in synth.QUANT_TYPES]:
        p.error(f"unknown types {unknown}; known: BF16, {', '.join(synth.QUANT_TYPES)}")
    bins = {"stock": args.stock_bin, "zipmoe": args.zipmoe_bin}
    for name, d in bins.items():
        if not (d / "llama-bench").is_file():
            hint = "bash tools/dev/build_stock.sh" if name == "stock" else "bash tools/setup.sh"
            p.error(f"{d / 'llama-bench'} is missing: `{hint}` builds it")
    try:
        models = ({m.name: m for m in args.model} if args.model else ensure_models(args.workdir, args.preset, types))
        runs = [("stock", None), ("zipmoe", None), *(("zipmoe", b) for b in budgets)]
        measured: dict[str, dict[str, list[dict[str, float]]]] = {}
        for qtype, model in models.items():
            measured[qtype] = {engine_name(b) if build == "zipmoe" else build: [] for build, b in runs}
            for i in range(args.rounds):
                for build, budget in (runs if i % 2 == 0 else runs[::-1]):
                    key = engine_name(budget) if build == "zipmoe" else build
                    measured[qtype][key].append(llama_bench(bins[build], model, args, budget))
                print(f"{qtype} round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
    except BenchError as e:
        print(f"bench_stock: {e}", file=sys.stderr)
        return 1
    with results.Tee() as tee:
        what = ", ".join(map(str, args.model)) if args.model else f"preset {args.preset}"
        synthetic = all(results.synthetic_gguf(m) for m in models.values())
        print(f"{'SYNTHETIC models' if synthetic else 'models'} ({what}), no memory limit: llama-bench -p {args.pp} -n "
              f"{args.gen} -r {args.reps} -t {args.threads} of stock llama.cpp ({args.stock_bin}) and of zipmoe's "
              f"build ({args.zipmoe_bin}), alternating")
        print(table(measured))
        print("tokens/s: medians over the rounds; ratio: zipmoe / stock, the median of the rounds' ratios; budget: "
              f"zipmoe's {BUDGET_ENV} as % of the model file (none: no budget, stock's path)")
    if args.json:
        args.json.write_text(json.dumps(measured, indent=1))
    results.write(args, "stock", tee.text, argv=results.script_argv("tools/bench/bench_stock.py", argv),
                  json_path=args.json, weights=f"{results.SYNTHETIC if synthetic else 'not all synthetic'}, {what}", notes=args.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
