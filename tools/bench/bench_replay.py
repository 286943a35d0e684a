#!/usr/bin/env python3
"""Replays routing through the real expert cache: hit rates per policy and budget against Belady's optimum.

Drives the native stores (ggml_zipmoe/src/cache/, through pyzipmoe._native) of a small SYNTHETIC zipmoe file, one
store per MoE layer, with a routing sequence: each step asks every layer's store to materialise the experts it
routed to, as llama.cpp's op does for a generated token. The sequence comes from
  --trace FILE    per-prompt activation counts (n_prompts, n_layer, n_expert), e.g. the Qwen1.5-MoE-A2.7B trace:
                  prompts in order, each of round(counts / k) tokens, each token's top-k drawn from its prompt's
                  per-layer counts (seeded; pyzipmoe.plan.replay.steps_from_counts);
  --routing FILE  a recorded-routing file (pyzipmoe.plan.trace; pyzipmoe.Llama(record_routing=...) writes one);
  --synthetic     uniform and Zipf(1) stationary routing (pyzipmoe.plan.replay.synthetic_steps).
Experts' sizes do not change a hit or a miss, so the store's experts are small (--expert-values); the bytes and
times reported are scaled to a reference expert (--expert-bytes, default Qwen1.5-MoE-A2.7B's: gate, up and down
of 2048 x 1408 in BF16).

For each source, config, budget and policy:
  budget   a share of the experts (of each layer's BF16 bytes);
  config   hot: that many decoded slots per layer (the planner's all-hot split); warm: every expert kept compressed,
           as many as the budget holds at the measured compression ratio (the runtime's default split where nearly
           all fit compressed), decoded on every use;
  hit %    routed experts found decoded (hot) or compressed in RAM (warm), per routed expert;
  belady % the most hits any cache of that many slots can have on the same sequence (pyzipmoe.plan.replay);
  freq %   the hits of a cache that knows each prompt's expert frequencies but not their order (the prompt's most
           used experts held through it): with tokens drawn independently within a prompt, as --trace draws them,
           the most a policy that does not see the order can expect; a policy's distance to Belady beyond this
           one's is what it could still gain (--synthetic and --routing: the whole sequence one prompt);
  read/tok bytes read from storage per token, decode/tok bytes decoded per token (reference expert, all layers);
  tok/s    predicted from the cost model below, per --read-rates; x stock: the same for stock llama.cpp, whose
           page cache holds the budget's share of the BF16 experts (LRU) and reads a missing expert in BF16.
With --plan, the planner's split (pyzipmoe.plan.solver.runtime_plan, recency model of the same sequence) of each
budget at each read rate, replayed: its mean slots per layer, hits per tier, and tokens/s by the cost model below
next to the planner's own prediction.
Cost model (stated, not measured end to end): seconds per token = 1 / --base-tps (a token with every expert in
memory) + per layer, misses x (compressed bytes / read rate + BF16 bytes / decode rate) + warm hits x BF16 bytes /
decode rate + sm hits x (codes' bytes / read rate + BF16 bytes / decode rate). The decode rate is --decode-rate,
or, with "measured", this replay's own (decode time less read time per BF16 byte, one thread, small experts, under
whatever load the machine has) times --cores.

    .venv/bin/python tools/bench/bench_replay.py --trace ../shared/traces/qwen1.5-moe-a2.7b_expert_counts.npz --synthetic
    .venv/bin/python tools/bench/bench_replay.py --routing run.routing.npz --policies lru,lfuda --budgets 40,60
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results.py, beside this script
import results as result_files  # noqa: E402

UNBOUNDED = 2**64 - 1
QWEN_EXPERT_BYTES = 3 * 2048 * 1408 * 2  # Qwen1.5-MoE-A2.7B: gate, up, down of one expert of one layer, BF16
QWEN_LAYERS = 24


class ReplayError(Exception):
    pass


@dataclass
class Source:
    name: str
    steps: list[list[np.ndarray]]  # per layer, per step: routed expert ids
    n_expert: int
    k: int
    layers_total: int  # the model's MoE layers (the replay may take fewer): what a token's time sums over
    segments: list[int] | None = None  # steps of each prompt, in order (None: one prompt)
    priors: np.ndarray | None = None  # per prompt, the prior its layers' stores start from (prompts, layers, experts)
    counts: np.ndarray | None = None  # per prompt, the trace's counts of the replayed layers


# ------------------------------------------------------------------------------------------ the store


def ensure_store_file(workdir: Path, n_layer: int, n_expert: int, k: int, values: int) -> Path:
    """A synthetic zipmoe GGUF of n_layer MoE layers of n_expert experts of `values` BF16 values (ffn_gate: 64 x
    values/64), made once and kept."""
    from pyzipmoe import synth
    from pyzipmoe.file import convert

    n_embd, n_ff = 64, max(1, values // 64)
    base = workdir / f"replay-{n_layer}x{n_expert}x{n_embd}x{n_ff}"
    src, dst = base.with_suffix(".gguf"), base.with_suffix(".zipmoe.gguf")
    if not dst.exists():
        workdir.mkdir(parents=True, exist_ok=True)
        cfg = synth.SynthConfig(n_layer=n_layer, n_embd=n_embd, n_ff_exp=n_ff, n_expert=n_expert, n_expert_used=k)
        synth.write_config(src, cfg)
        convert.convert(src, dst, codec="esc", threads=2)
        src.unlink()
    return dst


class Stores:
    """One store per MoE layer (its ffn_gate_exps tensor), opened fresh: no policy state carried between runs."""

    def __init__(self, path: Path, n_layer: int):
        from pyzipmoe._native import ffi, lib
        from pyzipmoe.file import reader as zreader

        self.ffi, self.lib = ffi, lib
        zf = zreader.open_zipmoe(path)
        gates = {ct.name: ct for ct in zf.compressed if ct.name.endswith("ffn_gate_exps.weight")}
        self.handles, self.index = [], []
        self.bf16_bytes = self.data_bytes = 0
        with open(path, "rb") as f:
            for i in range(n_layer):
                ct = gates[f"blk.{i}.ffn_gate_exps.weight"]
                f.seek(ct.index.file_offset)
                index = f.read(ct.index.nbytes)
                out = ffi.new("zipmoe_store **")
                if lib.zipmoe_store_open(ct.name.encode(), index, len(index), ct.data.nbytes, out) != 0:
                    raise ReplayError(f"cannot open the store of {ct.name}")
                handle = ffi.gc(out[0], lib.zipmoe_store_free)
                if lib.zipmoe_store_bind(handle, f.fileno(), ct.data.file_offset, ffi.new("void **"),
                                         ffi.new("size_t *")) != 0:
                    raise ReplayError(f"cannot bind the store of {ct.name}")
                self.handles.append(handle)
                self.index.append(index)
                ne0, ne1, n_expert = ct.source.dims
                self.bf16_bytes += ne0 * ne1 * n_expert * 2
                self.data_bytes += ct.data.nbytes
        self.keys = [ffi.new("char[1]"), ffi.new("char[1]")]  # an invocation's key differs from the store's last

    @property
    def ratio(self) -> float:
        return self.data_bytes / self.bf16_bytes

    def close(self) -> None:
        self.handles.clear()

    def set_priors(self, counts: np.ndarray) -> None:
        """Each layer's store starts from its prior, counts[layer] (per expert)."""
        for handle, row in zip(self.handles, counts):
            row = np.ascontiguousarray(row, dtype=np.uint64)
            if self.lib.zipmoe_store_set_prior(handle, self.ffi.cast("uint64_t *", self.ffi.from_buffer(row)),
                                               len(row)) != 0:
                raise ReplayError(f"the store refused a prior of {len(row)} experts")

    def prefill(self) -> None:
        """The fill at load: every store's tiers filled as a freshly loaded model's (zipmoe_cache_prefill)."""
        arr = self.ffi.new("zipmoe_store *[]", list(self.handles))
        if self.lib.zipmoe_cache_prefill(arr, len(self.handles), 1, self.ffi.NULL) < 0:
            raise ReplayError("the fill at load failed")

    def materialize(self, layer: int, step: int, ids: np.ndarray) -> None:
        if not len(ids):
            return  # (a prompt's step in the last layer, computed only for the rows whose logits are wanted)
        ffi, lib = self.ffi, self.lib
        r = lib.zipmoe_store_materialize(self.handles[layer], self.keys[step % 2], ffi.from_buffer(ids), len(ids), 1,
                                         4, 4 * len(ids), ffi.NULL, 0, 1)
        if r < 0:
            raise ReplayError(f"materialize failed in layer {layer} at step {step}: {r}")


def stats() -> dict[str, int]:
    from pyzipmoe._native import ffi, lib

    s = ffi.new("zipmoe_stats *")
    lib.zipmoe_stats_get(s)
    return {k: int(getattr(s, k)) for k in dir(s)}


def run_policy(path: Path, source: Source, policy: str, hot: int, warm: int,
               plan: list[tuple[int, int, int]] | None = None, fresh: bool = False) -> dict[str, int]:
    """Replays the source's steps through fresh stores with `hot` and `warm` slots per layer (or a planner's hot,
    warm and sm slots for each layer); the counters. With the source's priors, each prompt's stores are given its
    prior as it begins (zipmoe_store_set_prior). fresh: a run per prompt, each on stores opened for it and filled
    as at load (zipmoe_cache_prefill: in the prior's order, or by id without one)."""
    from pyzipmoe._native import lib
    from pyzipmoe.runtime.cache_control import policy_id

    n_layer = len(source.steps)
    segments = source.segments or [len(source.steps[0])]
    lib.zipmoe_cache_configure(UNBOUNDED, 0, 0, policy_id(policy))
    stores: Stores | None = None
    try:
        rules = [(b"", (hot, warm, 0))] if plan is None else [(f"blk.{i}.".encode(), p) for i, p in enumerate(plan)]
        for prefix, slots in rules:
            if lib.zipmoe_cache_set_slots(prefix, *slots) != 0:
                raise ReplayError(f"slot rule {prefix.decode()}{slots} refused")
        lib.zipmoe_stats_reset()
        start, ratio = 0, 0.0
        for p, n in enumerate(segments):
            if stores is None or fresh:
                if stores is not None:
                    stores.close()
                stores = Stores(path, n_layer)
                ratio = stores.ratio
            if source.priors is not None:
                stores.set_priors(source.priors[p])
            if fresh:
                stores.prefill()
            for t in range(start, start + n):
                for i in range(n_layer):
                    stores.materialize(i, t, source.steps[i][t])
            start += n
        out = stats()
        out["ratio_milli"] = int(ratio * 1000)
    finally:
        if stores is not None:
            stores.close()
        lib.zipmoe_cache_set_slots(_null(), 0, 0, 0)
        lib.zipmoe_cache_configure(UNBOUNDED, 0, 0, lib.ZIPMOE_POLICY_TOKEN_LFU)
    return out


def _null() -> Any:
    from pyzipmoe._native import ffi

    return ffi.NULL


# ------------------------------------------------------------------------------------------ sources


def trace_source(path: str, prompts: int, layers: int, k: int, seed: int, prior: str = "none") -> Source:
    from pyzipmoe.plan.inputs import PlanInputError, _trace_array
    from pyzipmoe.plan.replay import prompt_priors, prompt_tokens, steps_from_counts

    try:
        counts = _trace_array(path, "expected an .npz with key 'counts' (n_prompts, n_layer, n_expert)")
    except PlanInputError as e:
        raise ReplayError(str(e)) from None
    if counts.ndim != 3:
        raise ReplayError(f"{path}: counts must be (n_prompts, n_layer, n_expert), got shape {counts.shape}")
    n_layer = counts.shape[1]
    take = np.linspace(0, n_layer - 1, min(layers, n_layer)).round().astype(int)  # spread over the depth
    taken = counts[:prompts][:, take]
    name = f"trace {Path(path).name} ({min(prompts, counts.shape[0])} prompts, layers {take.tolist()})"
    priors = prompt_priors(counts[:, take], prompts, prior)
    return Source(name + ("" if priors is None else f", prior: {prior}"), steps_from_counts(taken, k, seed),
                  counts.shape[2], k, n_layer, prompt_tokens(taken, k), priors, taken)


def routing_source(path: str, layers: int) -> Source:
    from pyzipmoe.plan import trace

    try:
        r = trace.load(path)
    except trace.RoutingFileError as e:
        raise ReplayError(str(e)) from None
    take = np.linspace(0, r.n_layer - 1, min(layers, r.n_layer)).round().astype(int)
    return Source(f"routing {Path(path).name} ({r.n_steps} steps)", [r.steps(int(i)) for i in take], r.n_expert, r.k,
                  r.n_layer)


def synthetic_sources(kinds: list[str], layers: int, n_expert: int, k: int, steps: int, seed: int) -> list[Source]:
    from pyzipmoe.plan.replay import synthetic_steps

    return [Source(f"synthetic {kind} ({steps} tokens)", synthetic_steps(kind, layers, n_expert, k, steps, seed),
                   n_expert, k, QWEN_LAYERS) for kind in kinds]


# ------------------------------------------------------------------------------------------ the report


def predict(per_layer: dict[str, float], layers_total: int, args: argparse.Namespace, decode_rate: float,
            ratio: float, read_rate: float) -> float:
    """Tokens/s of the cost model (module docstring) from per-token-per-layer counts."""
    b = args.expert_bytes
    miss = per_layer["misses"] * (b * ratio / read_rate + b / decode_rate)
    warm = per_layer["warm"] * b / decode_rate
    sm = per_layer.get("sm", 0.0) * (max(b * ratio - b / 2, 0) / read_rate + b / decode_rate)  # the codes read
    return 1.0 / (1.0 / args.base_tps + layers_total * (miss + warm + sm))


def stock_tps(misses_per_layer: float, layers_total: int, args: argparse.Namespace, read_rate: float) -> float:
    return 1.0 / (1.0 / args.base_tps + layers_total * misses_per_layer * args.expert_bytes / read_rate)


def replay(args: argparse.Namespace, source: Source, path: Path) -> list[dict[str, Any]]:
    from pyzipmoe.plan.replay import (belady_fresh_hits, belady_hits, frequency_oracle_fresh_hits,
                                      frequency_oracle_hits, lru_hits, routed_total)

    rows = []
    n_layer, n = len(source.steps), source.n_expert
    n_steps = len(source.steps[0])
    routed = sum(routed_total(s) for s in source.steps)
    ratio = None
    for config in args.configs:
        for budget in args.budgets:
            for policy in args.policies:
                if ratio is None:  # measured once, on the first run
                    ratio = run_policy(path, Source("probe", [s[:1] for s in source.steps], n, source.k, 1),
                                       policy, 1, 0)["ratio_milli"] / 1000
                hot = max(source.k, int(budget / 100 * n)) if config == "hot" else 0
                warm = min(n, int(budget / 100 * n / ratio)) if config == "warm" else 0
                slots = hot or warm
                t0 = time.monotonic()
                st = run_policy(path, source, policy, hot, warm, fresh=args.fresh)
                hits = st["hits_hot"] + st["hits_warm"]
                found = st["hits_hot"] + st["hits_warm"] + st["hits_sm"] + st["misses"]
                if found != routed:
                    raise ReplayError(f"the cache counted {found} routed experts, the sequence has {routed}")
                decode_only = max(st["decode_ns"] - st["read_ns"], 1)
                rows.append({
                    "source": source.name, "config": config, "budget": budget, "policy": policy, "slots": slots,
                    "routed": routed, "hits_hot": st["hits_hot"], "hits_warm": st["hits_warm"],
                    "misses": st["misses"], "hit": hits / routed,
                    "bytes_read": st["bytes_read"], "bytes_decoded": st["bytes_decoded"],
                    "decode_ns_per_byte": decode_only / max(st["bytes_decoded"], 1),
                    "per_layer": {"misses": st["misses"] / n_steps / n_layer,
                                  "warm": st["hits_warm"] / n_steps / n_layer},
                    "ratio": ratio, "seconds": time.monotonic() - t0,
                })
            segments = source.segments or [len(source.steps[0])]
            if args.fresh:
                belady = sum(belady_fresh_hits(s, slots, segments) for s in source.steps) / routed
                freq = sum(frequency_oracle_fresh_hits(s, slots, segments) for s in source.steps) / routed
            else:
                belady = sum(belady_hits(s, slots) for s in source.steps) / routed
                freq = sum(frequency_oracle_hits(s, slots, segments) for s in source.steps) / routed
            stock_cap = max(source.k, int(budget / 100 * n))
            stock_miss = 1 - sum(lru_hits(s, stock_cap) for s in source.steps) / routed
            prior_static = prior_aware = None
            if source.priors is not None:
                from pyzipmoe.plan.replay import prior_aware_hits, prior_static_hits

                prior_static = sum(prior_static_hits(s, slots, segments, source.priors[:, i])
                                   for i, s in enumerate(source.steps)) / routed
                prior_aware = sum(prior_aware_hits(s, slots, segments, source.priors[:, i])
                                  for i, s in enumerate(source.steps)) / routed
            for row in rows[-len(args.policies):]:
                row["belady"] = belady
                row["freq_oracle"] = freq
                row["stock_miss_per_layer"] = stock_miss * routed / n_steps / n_layer
                row["prior_static"] = prior_static
                row["prior_aware"] = prior_aware
    return rows


def prior_report(rows: list[dict[str, Any]], sources: list[Source]) -> str:
    """What the priors could tell the cache: the distance of each prompt's routing from its prior, the hits of a
    cache that holds only the prior's most used experts, and of a policy told where each prompt begins that counts
    its uses on top of the prior (pyzipmoe.plan.replay.prior_aware_hits)."""
    from pyzipmoe.plan.replay import prior_distance

    lines = []
    for source in sources:
        if source.priors is None or source.counts is None:
            continue
        hot = [r for r in rows if r["source"] == source.name and r["config"] == "hot"]
        static = {r["budget"]: r["prior_static"] for r in hot}
        aware = {r["budget"]: r["prior_aware"] for r in hot}
        lines.append(f"{source.name}: mean total variation distance of a prompt's routing (a layer) from its prior "
                     f"{prior_distance(source.counts, source.priors):.3f}; a cache holding only the prior's most used "
                     f"experts finds " + ", ".join(f"{100 * h:.1f}% at {b}%" for b, h in static.items())
                     + "; a policy told where each prompt begins, counting its uses on top of the prior, "
                     + ", ".join(f"{100 * h:.1f}% at {b}%" for b, h in aware.items()))
    return "\n".join(lines)


def masks(steps: list[np.ndarray], n_expert: int) -> np.ndarray:
    out = np.zeros((len(steps), n_expert), bool)
    for t, ids in enumerate(steps):
        out[t, ids] = True
    return out


def planner_rows(args: argparse.Namespace, source: Source, path: Path, ratio: float,
                 decode_rate: float) -> list[dict[str, Any]]:
    """The planner's split of each budget at each read rate (pyzipmoe.plan.solver.runtime_plan: the recency model
    of the source's own sequence under --plan-policy, the reference expert's sizes, the cost model's rates), replayed
    through the cache."""
    from pyzipmoe.plan import inputs, solver

    n_layer, n, b = len(source.steps), source.n_expert, args.expert_bytes
    g = inputs.ModelGeometry.uniform(n_layer, n, source.k, b, int(b * ratio), b // 2)
    routing = {i: masks(source.steps[i], n) for i in range(n_layer)}
    counts = np.stack([routing[i].sum(axis=0) for i in range(n_layer)]).astype(np.float64)
    routed = sum(len(x) for layer in source.steps for x in layer)
    n_steps = len(source.steps[0])
    rows = []
    for rate_name, rate in args.read_rates:
        costs = inputs.Costs(cores=args.cores, t_decode=b / (decode_rate / args.cores), disk_bandwidth=rate,
                             read_latency=1e-4, base_seconds_per_token=1 / args.base_tps)
        model = solver.cost_model(g, costs, counts, routing, policy=args.plan_policy)
        for budget in args.budgets:
            plan = solver.runtime_plan(model, int(budget / 100 * n * b * n_layer))
            slots = [(lp.hot, lp.warm, lp.sm) for lp in plan.layers]
            st = run_policy(path, source, args.plan_policy, 0, 0, plan=slots)
            rows.append({"source": source.name, "rate": rate_name, "budget": budget, "policy": args.plan_policy,
                         "slots": [float(np.mean([x[j] for x in slots])) for j in range(3)],
                         # the planner's delay is for the replayed layers: scaled to the model's
                         "predicted_tps": 1 / (plan.base_seconds_per_token
                                               + plan.delay * source.layers_total / n_layer),
                         "hits": {t: st[f"hits_{t}"] / routed for t in ("hot", "warm", "sm")},
                         "per_layer": {"misses": st["misses"] / n_steps / n_layer,
                                       "warm": st["hits_warm"] / n_steps / n_layer,
                                       "sm": st["hits_sm"] / n_steps / n_layer},
                         "rate_bytes": rate, "ratio": ratio})
    return rows


def plan_table(rows: list[dict[str, Any]], args: argparse.Namespace, decode_rate: float) -> str:
    head = ["read rate", "budget", "hot/warm/sm slots", "hit hot %", "warm %", "sm %", "tok/s replayed",
            "tok/s planner"]
    lines = []
    for source in dict.fromkeys(r["source"] for r in rows):
        lines.append(f"{source}: the planner's split ({args.plan_policy}), replayed")
        body = [head]
        for r in (r for r in rows if r["source"] == source):
            tps = predict(r["per_layer"], r["layers_total"], args, decode_rate, r["ratio"], r["rate_bytes"])
            body.append([r["rate"], f"{r['budget']}%", "/".join(f"{x:.1f}" for x in r["slots"]),
                         f"{100 * r['hits']['hot']:.1f}", f"{100 * r['hits']['warm']:.1f}",
                         f"{100 * r['hits']['sm']:.1f}", f"{tps:.2f}", f"{r['predicted_tps']:.2f}"])
        widths = [max(len(row[i]) for row in body) for i in range(len(head))]
        lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in body]
        lines.append("")
    return "\n".join(lines)


def decode_rate_of(args: argparse.Namespace, rows: list[dict[str, Any]]) -> float:
    if args.decode_rate != "measured":
        from pyzipmoe.runtime.budget import parse_size

        return float(parse_size(args.decode_rate))
    decoded = sum(r["bytes_decoded"] for r in rows)
    ns = sum(r["decode_ns_per_byte"] * r["bytes_decoded"] for r in rows)
    return decoded / ns * 1e9 * args.cores


def table(rows: list[dict[str, Any]], args: argparse.Namespace, decode_rate: float) -> str:
    rates = args.read_rates
    head = ["config", "budget", "policy", "slots", "hit %", "belady %", "vs belady", "freq %", "freq vs belady",
            "read/tok", "decode/tok"]
    for name, _ in rates:
        head += [f"tok/s@{name}", f"x stock@{name}"]
    lines = []
    for source in dict.fromkeys(r["source"] for r in rows):
        lines.append(f"{source}:")
        body = [head]
        for r in (r for r in rows if r["source"] == source):
            layers_total = r["layers_total"]
            pl = r["per_layer"]
            b = args.expert_bytes
            read = layers_total * pl["misses"] * b * r["ratio"]
            decoded = layers_total * (pl["misses"] + pl["warm"]) * b
            cells = [r["config"], f"{r['budget']}%", r["policy"], str(r["slots"]), f"{100 * r['hit']:.1f}",
                     f"{100 * r['belady']:.1f}", f"{r['hit'] / r['belady']:.3f}" if r["belady"] else "-",
                     f"{100 * r['freq_oracle']:.1f}",
                     f"{r['freq_oracle'] / r['belady']:.3f}" if r["belady"] else "-",
                     f"{read / 1e6:.0f} MB", f"{decoded / 1e6:.0f} MB"]
            for _, rate in rates:
                tps = predict(pl, layers_total, args, decode_rate, r["ratio"], rate)
                stock = stock_tps(r["stock_miss_per_layer"], layers_total, args, rate)
                cells += [f"{tps:.2f}", f"{tps / stock:.2f}"]
            body.append(cells)
        widths = [max(len(row[i]) for row in body) for i in range(len(head))]
        lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in body]
        lines.append("")
    return "\n".join(lines)


def parse_rates(text: str) -> list[tuple[str, float]]:
    from pyzipmoe.runtime.budget import parse_size

    out = []
    for part in text.split(","):
        try:
            out.append((part.strip(), float(parse_size(part.strip()))))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return out


def main(argv: list[str] | None = None) -> int:
    from pyzipmoe.plan.replay import PRIOR_MODES
    from pyzipmoe.runtime.config import POLICIES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--trace", help="per-prompt activation counts (.npz with 'counts' [prompts, layers, experts])")
    p.add_argument("--routing", help="a recorded-routing file (pyzipmoe.plan.trace)")
    p.add_argument("--synthetic", nargs="?", const="uniform,zipf", default=None,
                   help="stationary synthetic routing: uniform, zipf or both (default with the flag: both)")
    p.add_argument("--prompts", type=int, default=200, help="the trace's first N prompts (default 200)")
    p.add_argument("--layers", type=int, default=8, help="MoE layers replayed, spread over the depth (default 8)")
    p.add_argument("--k", type=int, default=4, help="experts per token for --trace and --synthetic (default 4)")
    p.add_argument("--synthetic-experts", type=int, default=60)
    p.add_argument("--synthetic-steps", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=",".join(POLICIES), help=f"default {','.join(POLICIES)}")
    p.add_argument("--budgets", default="25,40,60,75,90", help="shares of the experts, %% (default 25,40,60,75,90)")
    p.add_argument("--configs", default="hot,warm", help="hot, warm or both (default both)")
    p.add_argument("--read-rates", type=parse_rates, default=parse_rates("150MiB,1GiB"),
                   help="storage read rates for the predicted tokens/s (default 150MiB,1GiB per second)")
    p.add_argument("--decode-rate", default="measured",
                   help="BF16 bytes/s the engine decodes (e.g. 2GiB), or 'measured' (default): this replay's, x --cores")
    p.add_argument("--cores", type=int, default=4, help="decoding threads for a measured decode rate (default 4)")
    p.add_argument("--base-tps", type=float, default=10.0,
                   help="tokens/s with every expert in memory, the cost model's base (default 10, an assumption)")
    p.add_argument("--expert-bytes", type=int, default=QWEN_EXPERT_BYTES,
                   help=f"BF16 bytes of one expert of one layer, what bytes scale to (default {QWEN_EXPERT_BYTES})")
    p.add_argument("--expert-values", type=int, default=8192, help="values of the replay store's experts")
    p.add_argument("--workdir", type=Path, default=REPO / "build" / "bench-replay")
    p.add_argument("--plan", action="store_true",
                   help="also the planner's split at each budget and read rate, replayed through the cache")
    p.add_argument("--plan-policy", default="tlfu", help="the policy of the planner's runs (default tlfu)")
    p.add_argument("--prior", choices=PRIOR_MODES, default="none",
                   help="--trace: each prompt's stores start from a prior (zipmoe_store_set_prior) of the trace's "
                        "other prompts (others: leave-one-out, a calibration) or of the prompts before it (earlier: "
                        "learned across runs); default none")
    p.add_argument("--fresh", action="store_true",
                   help="a run per prompt: fresh stores filled as at load (in the prior's order), Belady and the "
                        "frequency oracle from their best fill; default: the prompts in one run")
    p.add_argument("--json", type=Path, help="write every row as JSON here")
    result_files.add_arguments(p)
    args = p.parse_args(argv)
    args.policies = [x for x in args.policies.split(",") if x]
    args.configs = [x for x in args.configs.split(",") if x]
    try:
        args.budgets = [int(x) for x in args.budgets.split(",") if x]
    except ValueError:
        p.error(f"--budgets: integers, got {args.budgets!r}")
    if unknown := [x for x in args.policies if x not in POLICIES]:
        p.error(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    if args.plan_policy not in POLICIES:
        p.error(f"unknown --plan-policy {args.plan_policy}; known: {', '.join(POLICIES)}")
    if unknown := [x for x in args.configs if x not in ("hot", "warm")]:
        p.error(f"unknown configs {unknown}; known: hot, warm")
    if not (args.trace or args.routing or args.synthetic):
        p.error("give --trace, --routing or --synthetic")
    if args.prior != "none" and (args.routing or args.synthetic or args.plan):
        p.error("--prior: only with --trace alone (a prior per prompt), without --plan")
    try:
        sources = []
        if args.trace:
            sources.append(trace_source(args.trace, args.prompts, args.layers, args.k, args.seed, args.prior))
        if args.routing:
            sources.append(routing_source(args.routing, args.layers))
        if args.synthetic:
            sources += synthetic_sources(args.synthetic.split(","), args.layers, args.synthetic_experts, args.k,
                                         args.synthetic_steps, args.seed)
        rows = []
        with result_files.Tee() as tee:
            for source in sources:
                path = ensure_store_file(args.workdir, len(source.steps), source.n_expert,
                                         max(source.k, 1), args.expert_values)
                print(f"replaying {source.name}: {len(source.steps[0])} steps x {len(source.steps)} layers",
                      file=sys.stderr, flush=True)
                for r in replay(args, source, path):
                    r["layers_total"] = source.layers_total
                    rows.append(r)
            decode_rate = decode_rate_of(args, rows)
            print(table(rows, args, decode_rate))
            if args.prior != "none":
                print(prior_report(rows, sources))
            if args.plan:
                for source in sources:
                    path = ensure_store_file(args.workdir, len(source.steps), source.n_expert, max(source.k, 1),
                                             args.expert_values)
                    ratio = next(r["ratio"] for r in rows if r["source"] == source.name)
                    planned = planner_rows(args, source, path, ratio, decode_rate)
                    for r in planned:
                        r["layers_total"] = source.layers_total
                    print(plan_table(planned, args, decode_rate))
                    rows += planned
            print(f"cost model: base {args.base_tps} tok/s, expert {args.expert_bytes / 1e6:.1f} MB BF16, compressed "
                  f"x{rows[0]['ratio']:.3f} (measured on the SYNTHETIC store), decode {decode_rate / 1e9:.2f} GB/s"
                  f" ({args.decode_rate}), read rates {', '.join(n for n, _ in args.read_rates)}; "
                  f"vs belady = hit / belady; freq vs belady = freq / belady")
    except ReplayError as e:
        print(f"bench_replay: {e}", file=sys.stderr)
        return 1
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    result_files.write(args, "replay", tee.text, argv=result_files.script_argv("tools/bench/bench_replay.py", argv),
                       json_path=args.json,
                       weights=f"{result_files.SYNTHETIC} (the cache's bookkeeping only; routing from the sources "
                               f"named in the table)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
