#!/usr/bin/env python3
"""What ordering a prompt's read-ahead by the prior gains: the share of a prompt's routed experts that the
read-ahead of the next layer has read before that layer's routing is known, in the prior's order against the ids'.

When a prompt's batch routes to most of a layer's experts, the reader reads the next layer's store ahead while this
layer computes (ggml_zipmoe/src/cache/readahead.c); within the budget's read room the buffer holds only some of the
experts not in RAM, and it takes them in the store's prior order (zipmoe_store_set_prior), by id without a prior.
This model of it takes, per prompt and layer of a routing trace (per-prompt counts, as bench_replay.py's --trace):
  resident  the cache's share of the experts (--budgets): the prior's most used ones (what the fill at load and the
            prior's head start keep), the same with either order;
  ahead     the next --buffers share of the experts that are not resident: the prior's next most used, or the
            lowest ids;
  routed    the experts the prompt routed to in that layer.
  ahead %   of the routed experts not resident, those read ahead (what the prompt does not wait for);
  used %    of the experts read ahead, those routed (the read-ahead's reads that were not wasted).
Priors as bench_replay.py's --prior: others (every other prompt's counts: a calibration) or earlier (the prompts
before it: learned across runs; the first prompt has none). The weights do not enter: nothing is decoded.

    .venv/bin/python tools/bench/bench_readahead_prior.py --trace ../shared/traces/qwen1.5-moe-a2.7b_expert_counts.npz
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # results.py, beside this script
import results as result_files  # noqa: E402


def order_by(prior: np.ndarray) -> np.ndarray:
    """Experts by prior, the most used first, ties by id (cache/prior.c's cache_prior_order)."""
    return np.lexsort((np.arange(prior.size), -prior.astype(np.float64)))


def measure(counts: np.ndarray, prior_kind: str, budget: float, buffer: float) -> dict[str, float]:
    n_prompt, n_layer, n_expert = counts.shape
    resident_n, ahead_n = int(round(budget * n_expert)), max(1, int(round(buffer * n_expert)))
    total = counts.sum(axis=0)
    got = {"prior": [0, 0, 0], "id": [0, 0, 0]}  # routed misses read ahead, routed misses, read ahead
    for p in range(n_prompt):
        for layer in range(n_layer):
            prior = (total[layer] - counts[p, layer]) if prior_kind == "others" else counts[:p, layer].sum(axis=0)
            ranked = order_by(prior)
            resident = set(ranked[:resident_n].tolist())
            routed = set(np.flatnonzero(counts[p, layer]).tolist()) - resident
            for name, order in (("prior", ranked), ("id", np.arange(n_expert))):
                ahead = [e for e in order.tolist() if e not in resident][:ahead_n]
                g = got[name]
                g[0] += len(routed.intersection(ahead))
                g[1] += len(routed)
                g[2] += len(ahead)
    return {f"{name}_{what}": 100.0 * v[0] / max(1, v[i]) for name, v in got.items()
            for what, i in (("ahead", 1), ("used", 2))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, required=True, help="an .npz of per-prompt counts (n_prompt, n_layer, "
                                                            "n_expert) under key 'counts'")
    p.add_argument("--prompts", type=int, default=200, help="the trace's first N prompts (default 200)")
    p.add_argument("--budgets", default="25,40,60", help="resident shares of the experts, %% (default 25,40,60)")
    p.add_argument("--buffers", default="10,25", help="read-ahead buffer shares of the experts, %% (default 10,25)")
    p.add_argument("--priors", default="others,earlier", help="others, earlier (default both)")
    result_files.add_arguments(p)
    args = p.parse_args(argv)
    counts = np.load(args.trace)["counts"][: args.prompts].astype(np.int64)
    rows = [f"trace {args.trace.name} ({counts.shape[0]} prompts, {counts.shape[1]} layers, {counts.shape[2]} "
            "experts): routed experts not resident that a prompt's read-ahead read, and its reads used, %",
            f"{'prior':>8} {'budget':>7} {'buffer':>7} {'ahead% prior':>13} {'ahead% id':>10} {'used% prior':>12} "
            f"{'used% id':>9}"]
    for prior_kind in args.priors.split(","):
        for budget in (float(b) / 100 for b in args.budgets.split(",")):
            for buffer in (float(b) / 100 for b in args.buffers.split(",")):
                m = measure(counts, prior_kind, budget, buffer)
                rows.append(f"{prior_kind:>8} {budget:>7.0%} {buffer:>7.0%} {m['prior_ahead']:>13.1f} "
                            f"{m['id_ahead']:>10.1f} {m['prior_used']:>12.1f} {m['id_used']:>9.1f}")
    table = "\n".join(rows)
    print(table)
    result_files.write(args, "readahead-prior", table, argv=argv,
                       weights="none (a model of the read-ahead's order on the trace's routing; nothing decoded)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
