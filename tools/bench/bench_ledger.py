#!/usr/bin/env python3
"""Where the time goes under a memory budget: the time ledger of a prompt, of one sequence's tokens and of N
sequences' steps in lockstep (llama-server -np N's slots), at budgets of a zipmoe model, and unbounded.

Each measurement is a fresh process of pyzipmoe.runtime.timing (what `zipmoe bench --ledger` runs): the model loads
under ZIPMOE_MEMORY_BUDGET = P% of its BF16 source's size - --overhead (bench_multitoken's rule: what the process
needs besides the model), evaluates a prompt of --prompt random tokens twice and times the second, then generates
--gen timed tokens (steps, with N sequences) after --warmup. No cgroup limit: the budget is the runtime's own, and
its reads of experts bypass the page cache (O_DIRECT). Configurations alternate at each budget (--repeat times), as
the machine's speed drifts; the table shows each run.

Per run: tokens/s (a step's N tokens count N), and per token the ledger's parts (ms; ggml_zipmoe/include/
zipmoe-ledger.h: the computing thread's time, compute + decode + read_wait + thread_wait + other + outside), the
misses per token and the MiB read from the file per token. With N sequences, np/1 is the aggregate tokens/s over
the one-sequence run of the same budget and repetition: the gain of the slots.

The models are SYNTHETIC (bench_budget's --preset, made in --workdir when missing), or --model.

Example:
  .venv/bin/python tools/bench/bench_ledger.py --preset 2.8g --budgets 40,44,68,80 --parallel 4 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_budget as bb  # noqa: E402
import results as result_files  # noqa: E402

from pyzipmoe.runtime import ledger  # noqa: E402
from pyzipmoe.runtime.timing import PARALLEL_PROMPTS, time_generation  # noqa: E402

MIB = 1 << 20


def measure(model: Path, budget: int | None, parallel: int, args: argparse.Namespace) -> dict[str, Any]:
    llama = {} if budget is None else {"memory_budget": str(budget)}
    got = time_generation(model, llama=llama, warmup=args.warmup, gen=args.gen, threads=args.threads,
                          prompt=args.prompt if parallel == 1 else 0, parallel=parallel)
    return {"budget": budget, "parallel": parallel, "tps": got["tps"], "stats": got["stats"], "prompt": got["prompt"]}


def row(name: str, tps: float, stats: dict[str, Any], gain: float | None) -> str:
    parts = ledger.per_token(stats)
    tokens = max(1, int(stats.get("ledger_tokens", 0)))
    cells = " ".join(f"{parts[p] * 1e3:>8.2f}" for p, _, _ in ledger.PARTS)
    return (f"{name:<24} {tps:>8.2f} {'-' if gain is None else f'{gain:.2f}x':>6} {cells} {parts['total'] * 1e3:>8.2f} "
            f"{stats.get('misses', 0) / tokens:>7.2f} {stats.get('bytes_read', 0) / tokens / MIB:>8.2f}")


def table(runs: list[dict[str, Any]]) -> str:
    """One row per run (its prompt's first, where timed); np/1 against the one-sequence run of the same budget and
    repetition."""
    head = (f"{'run':<24} {'tok/s':>8} {'np/1':>6} " + " ".join(f"{p[:8]:>8}" for p, _, _ in ledger.PARTS)
            + f" {'total':>8} {'miss/t':>7} {'MiB/t':>8}")
    lines = [head]
    for r in runs:
        where = "unbounded" if r["budget"] is None else f"{r['pct']:g}% {r['budget'] / MIB:.0f} MiB"
        if r["prompt"]:
            lines.append(row(f"{where} pp{r['prompt']['tokens']}", r["prompt"]["tps"], r["prompt"]["stats"], None))
        one = next((o for o in runs if o["budget"] == r["budget"] and o["rep"] == r["rep"] and o["parallel"] == 1),
                   None)
        gain = r["tps"] / one["tps"] if one and r["parallel"] > 1 else None
        lines.append(row(f"{where} tg np{r['parallel']} r{r['rep']}", r["tps"], r["stats"], gain))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="2.8g", choices=("1g", "2.8g", "small", "tiny"),
                   help="synthetic model (bench_budget's presets, uniform routing; default: %(default)s)")
    p.add_argument("--model", type=Path, help="a zipmoe GGUF instead of the preset's; --bf16-size its source's")
    p.add_argument("--bf16-size", type=bb._size, help="with --model: the BF16 source's size the budgets are of")
    p.add_argument("--workdir", type=Path, default=bb.REPO / "build" / "bench-budget",
                   help="where the preset's models are kept (default: %(default)s)")
    p.add_argument("--budgets", type=bb._budgets, default=bb._budgets("40,80"),
                   help="%% of the BF16 file, less --overhead (default: 40,80)")
    p.add_argument("--no-unbounded", action="store_true", help="no unbounded run (by default one comes first)")
    p.add_argument("--overhead", type=bb._size, default=256 * MIB, help="taken from each budget (default: 256MiB)")
    p.add_argument("--parallel", type=int, default=4, help="sequences in lockstep besides one (default: 4; 1: none)")
    p.add_argument("--prompt", type=int, default=512, help="timed prompt's random tokens, 0: none (default: 512)")
    p.add_argument("--gen", type=int, default=32, help="timed tokens (steps) (default: 32)")
    p.add_argument("--warmup", type=int, default=16, help="untimed tokens (steps) before them (default: 16)")
    p.add_argument("--threads", type=int, default=2, help="threads (default: 2)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each configuration, alternating (default: 1)")
    p.add_argument("--json", type=Path, help="write every run's counters here")
    result_files.add_arguments(p)
    args = p.parse_args(argv)
    if not 1 <= args.parallel <= len(PARALLEL_PROMPTS):
        p.error(f"--parallel: 1 to {len(PARALLEL_PROMPTS)} sequences (one prompt each)")
    if min(args.gen, args.repeat, args.threads) < 1 or min(args.prompt, args.warmup) < 0:
        p.error("--gen, --repeat and --threads are at least 1; --prompt and --warmup at least 0")
    if args.model is not None:
        if args.bf16_size is None:
            p.error("--model needs --bf16-size (the budgets are % of the BF16 source)")
        model, size = args.model, args.bf16_size
    else:
        bf16, model = bb.ensure_models(args.workdir, args.preset, "uniform", args.threads, False,
                                       bb.default_bench_codec())
        size = bf16.stat().st_size
    budgets: list[tuple[float | None, int | None]] = [] if args.no_unbounded else [(None, None)]
    budgets += [(b, int(size * b / 100) - args.overhead) for b in args.budgets]
    if any(b is not None and b <= 0 for _, b in budgets):
        p.error(f"{min(args.budgets):g}% of {size / MIB:.0f} MiB leaves no budget after --overhead "
                f"{args.overhead / MIB:.0f} MiB: a smaller --overhead, or larger budgets")
    configs = [1] if args.parallel <= 1 else [1, args.parallel]
    runs = []
    for pct, budget in budgets:
        for rep in range(args.repeat):
            for parallel in configs:
                bb.say(f"{'unbounded' if budget is None else f'{budget / MIB:.0f} MiB'}, {parallel} sequence(s), "
                       f"run {rep} ...")
                runs.append({**measure(model, budget, parallel, args), "rep": rep, "pct": pct})
    out = table(runs)
    weights = result_files.SYNTHETIC + f" (preset {args.preset})" if args.model is None else f"those of {model}"
    head = (f"{model.name} ({weights}), BF16 source {size / MIB:.0f} MiB; "
            f"budget = P% of it - {args.overhead / MIB:.0f} MiB; {args.threads} threads; ms per token (a step of N "
            f"sequences: N tokens) of the ledger's parts; miss/t: experts decoded anew per token; MiB/t: read from "
            f"the file per token")
    print(head)
    print(out)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    result_files.write(args, "ledger", f"{head}\n{out}", argv=argv, json_path=args.json, weights=weights)
    return 0


if __name__ == "__main__":
    sys.exit(main())
