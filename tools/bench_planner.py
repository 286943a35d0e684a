#!/usr/bin/env python3
"""The planner against every fixed split of the budget between tiers: measured and predicted generation speed.

For each budget (a share of the model's BF16 size, as in tools/bench_budget.py), the zipmoe model generates with
(a) the planner (its first plan, re-planned after the warm-up from the routing the run has seen, as
pyzipmoe.Llama's monitor does) and (b) each fixed split of the cache between the hot, warm and sm tiers in
steps of --step (the same slots in every layer), and the script prints measured tokens/s next to the planner's
prediction for the same split. Generation is measured in steady state: the model is loaded and warmed up with
--warmup tokens, then --gen tokens are timed (greedy, one token at a time, through pyzipmoe.Llama in a fresh
process per run). The runtime enforces the budget itself; no cgroup is needed (tools/bench_budget.py measures
under cgroup limits).

The planner's costs are this machine's calibration (`zipmoe calibrate`, run first if missing) and a base time
per token measured here: the unconstrained model's generation once every expert is decoded.

    .venv/bin/python tools/bench_planner.py                       # the 2.8g synthetic model of bench_budget
    .venv/bin/python tools/bench_planner.py --budgets 60,75 --step 0.25 --json out.json
    .venv/bin/python tools/bench_planner.py --model m.zipmoe.gguf --trace routing.npz

Acceptance (the planner's issue): measured tokens/s with the planner within 10% of the best fixed split at
every budget, and predicted within 25% of measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEFAULT_MODEL = REPO / "build" / "bench-budget" / "2.8g-uniform.zipmoe.gguf"
BASE_WARMUP = 96  # tokens before timing the unconstrained run: by then every expert has been routed and decoded

WORKER = r"""
import json, os, sys, time
import numpy as np
job = json.loads(sys.argv[1])
from pyzipmoe.llama import Llama, zipmoe_stats
llm = Llama(job["model"], n_ctx=512, n_threads=job["threads"], n_threads_batch=job["threads"], verbose=False,
            **job["llama"])
tokens = llm.tokenize(b"Once upon a time, in a land far away")
llm.eval(tokens)
def step():
    llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
for _ in range(job["warmup"]):
    step()
predicted = None
if llm.zipmoe_monitor is not None:  # the planner: re-plan from the routing this run has seen so far
    plan = llm.zipmoe_monitor.refresh_routing(min_tokens=1)
    predicted = plan.tokens_per_second if plan else None
    llm.zipmoe_monitor.stop()  # nothing else changes while timing
for _ in range(job["warmup"] // 2):
    step()
zipmoe_stats(reset=True)
t0 = time.perf_counter()
for _ in range(job["gen"]):
    step()
dt = time.perf_counter() - t0
s = zipmoe_stats()
print(json.dumps({"tps": job["gen"] / dt, "seconds": dt, "stats": s, "predicted_live": predicted}))
"""


def run_worker(model: Path, llama_kwargs: dict[str, Any], args: argparse.Namespace, warmup: int | None = None
               ) -> dict[str, Any]:
    from pyzipmoe import runner

    job = {"model": str(model), "llama": llama_kwargs, "threads": args.threads,
           "warmup": args.warmup if warmup is None else warmup, "gen": args.gen}
    env = runner.environment(base={k: v for k, v in os.environ.items() if not k.startswith("ZIPMOE_")})
    env["LLAMA_CPP_LIB_PATH"] = str(runner.bin_dir())
    done = subprocess.run([sys.executable, "-c", WORKER, json.dumps(job)], env=env, capture_output=True, text=True,
                          timeout=args.timeout, cwd=REPO, check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def splits(step: float) -> list[tuple[float, float, float]]:
    """Every (hot, warm, sm) share in steps of `step` that adds up to 1."""
    n = round(1 / step)
    return [(h / n, w / n, (n - h - w) / n) for h in range(n, -1, -1) for w in range(n - h, -1, -1)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="a zipmoe GGUF (default: %(default)s)")
    p.add_argument("--bf16-bytes", type=int, help="the BF16 size the budgets are shares of (default: the source "
                                                  "GGUF's size, from the zipmoe file's header)")
    p.add_argument("--budgets", default="40,60,75,93", help="budgets in %% of the BF16 size (default: %(default)s)")
    p.add_argument("--step", type=float, default=0.1, help="fixed splits in steps of this share (default: 0.1)")
    p.add_argument("--trace", help="activation counts for the planner (.npz counts[prompts, layers, experts])")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=16, help="tokens generated before timing (default: %(default)s)")
    p.add_argument("--gen", type=int, default=24, help="tokens timed (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", type=Path, help="write every run here")
    args = p.parse_args(argv)

    from pyzipmoe import calibrate, controller, planner
    from pyzipmoe.format import open_zipmoe

    model = args.model
    bf16 = args.bf16_bytes or open_zipmoe(model).meta.source_size
    print(f"model: {model} (synthetic when made by tools/make_synth.py), BF16 {bf16 / 2**20:.0f} MiB", flush=True)
    cal = calibrate.calibrate(model)
    base_run = run_worker(model, {}, args, warmup=BASE_WARMUP)
    if "error" in base_run:
        print(f"the unconstrained run failed: {base_run['error']}", file=sys.stderr)
        return 1
    base = base_run["seconds"] / args.gen
    calibrate.calibrate(model, base_seconds_per_token=base)
    print(f"costs: {cal.as_costs_dict()}; base {base * 1000:.1f} ms/token measured (all experts decoded: "
          f"{1 / base:.1f} tokens/s)", flush=True)
    results: list[dict[str, Any]] = []
    for pct in (float(b) for b in args.budgets.split(",")):
        budget = int(bf16 * pct / 100)
        planned = controller.plan_model(model, budget, trace=args.trace)
        tiers = budget - planned.need.minimum
        rows = [("planner", planned.plan)]
        for h, w, s in splits(args.step):
            fixed = planner.fixed_split_plan(planned.model, tiers, h, w, s)
            rows.append((f"hot {h:.0%} warm {w:.0%} sm {s:.0%}", fixed))
        print(f"\nbudget {pct:g}% = {budget / 2**20:.0f} MiB ({tiers / 2**20:.0f} MiB for the tiers)", flush=True)
        print(f"{'split':<28} {'predicted':>9} {'measured':>9}  plan", flush=True)
        for name, plan in rows:
            kwargs = {"memory_budget": str(budget), "planner": True} if name == "planner" else \
                {"memory_budget": str(budget), "plan": plan.encode()}
            res = run_worker(model, kwargs, args)
            predicted = res.get("predicted_live") or plan.tokens_per_second
            res.update(budget_pct=pct, split=name, predicted=predicted, plan=plan.encode())
            results.append(res)
            got = f"{res['tps']:9.2f}" if "tps" in res else f"{'failed':>9}"
            print(f"{name:<28} {predicted:9.2f} {got}  {plan.encode()[:60]}", flush=True)
        ok = [r for r in results if r["budget_pct"] == pct and "tps" in r]
        best = max((r for r in ok if r["split"] != "planner"), key=lambda r: r["tps"], default=None)
        mine = next((r for r in ok if r["split"] == "planner"), None)
        if best and mine:
            print(f"planner {mine['tps']:.2f} tokens/s = {mine['tps'] / best['tps']:.2f}x the best fixed split "
                  f"({best['split']}, {best['tps']:.2f}); predicted/measured {mine['predicted'] / mine['tps']:.2f}",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": str(model), "base_seconds_per_token": base,
                                         "costs": cal.as_costs_dict(), "runs": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
