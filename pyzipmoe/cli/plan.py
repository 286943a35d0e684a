"""`zipmoe plan`: the slots per tier of every MoE layer for a memory budget, and the speed they should give.

The zipmoe command (pyzipmoe.cli) calls `register(subparsers)`. The planner itself is pyzipmoe/plan/.

The option is `--memory-budget` but its attribute is `plan_budget`: the run commands (pyzipmoe.cli.programs) turn
an attribute `memory_budget` into the runtime's environment, which planning must not do.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from ..plan import inputs
from ..plan import trace as routing_file
from ..plan import solver as planner
from ..runtime.config import DEFAULT_POLICY, PLAN_ENV, POLICIES, RuntimeConfig
from .formatting import command, human_size

__all__ = ["register"]

DESCRIPTION = (
    "Plan how many experts of each MoE layer of MODEL to keep hot (decoded), warm (compressed in RAM) or sm (sign and "
    "mantissa in RAM, exponent codes read from disk) within SIZE bytes, the rest cold (read from disk when routed), "
    "so that generation is fastest. MODEL is a zipmoe GGUF or a plain GGUF of any expert type (BF16, F16, Q8_0, "
    "Q4_K_M, ...): experts stored raw (every expert of a plain GGUF, a zipmoe file's quantized ones) are hot or cold "
    "only, each tensor counted at its own size, and a cold one costs its read (no decode). SIZE is the model's "
    "whole budget, as `zipmoe run --memory-budget` takes it: "
    "the weights that are not experts and the experts of the expert tensor in flight come first, the tiers get the "
    "rest (the KV cache and compute buffers are not counted). Routing frequencies come from --trace (without it "
    "every expert is equally likely); costs from the model's calibration, --costs, or else a conservative estimate "
    "(0.5 GB/s of decoding per core, a 0.5 GB/s disk with 0.1 ms per read, 10 GB/s of memory bandwidth). Prints "
    "the slots, bytes, "
    "predicted hit rates and tokens/s per layer, and the plan as the runtime reads it: ZIPMOE_PLAN="
    "\"<layer>:<hot>,<warm>,<sm>;...\". This is the frequency model, which a run uses for its first tokens "
    "when given --trace; without one a run starts with decoded experts, and pyzipmoe.Llama (zipmoe run -p) "
    "re-plans from the order its own tokens route in, which predicts the decoded tier better.")

EPILOG = """\
examples:
  zipmoe plan model.zipmoe.gguf --memory-budget 6GiB
  zipmoe plan model-Q4_K_M.gguf --memory-budget 3GiB
  zipmoe plan model.zipmoe.gguf --memory-budget 40% --trace routing.npz
  zipmoe plan model.zipmoe.gguf --memory-budget 6GiB --costs costs.json --json

a trace: an .npz with key "counts" (or an .npy) of integer counts shaped (n_prompts, n_layer, n_expert): how many
tokens of each prompt routed to each expert of each layer; or a recorded-routing file (an .npz with format
"zipmoe-routing", docs/FORMAT.md), which pyzipmoe.Llama(record_routing=PATH) writes: the planner then models the
hits of the order in which its tokens routed, as a run re-plans from its own tokens.
a costs file: JSON with some of cores, t_decode (seconds for one core to decode one expert of one layer),
disk_bandwidth (bytes/s), read_latency (s), base_seconds_per_token (a token with every expert hot), e.g.
  {"cores": 8, "t_decode": 0.0004, "disk_bandwidth": 2e9, "read_latency": 5e-5, "base_seconds_per_token": 0.03}"""


# ------------------------------------------------------------------------------------------ inputs


def _costs(args: argparse.Namespace, model_path: str, geometry: inputs.ModelGeometry) -> tuple[inputs.Costs, str]:
    """The calibration (or defaults), overridden by --costs; and where they came from."""
    from ..runtime.controller import machine_costs

    costs, source = machine_costs(model_path, geometry)
    if args.costs is not None:
        costs = inputs.costs_from_file(args.costs, defaults=costs)
        source = f"{args.costs} (missing keys: {source})"
    return costs, source


def _routing(args: argparse.Namespace, geometry: inputs.ModelGeometry) -> tuple[Any, Any]:
    """The trace's activation counts and, from a recorded-routing file, each MoE block's routing in order (the
    recency model's input, as a run's own log); None and None (uniform) without a trace."""
    if args.trace is None:
        return None, None
    if routing_file.is_routing_file(args.trace):
        g = geometry
        recorded = routing_file.load(args.trace)
        return routing_file.planner_inputs(recorded, g.n_layer, g.n_expert, g.n_expert_used, g.layers,
                                           f"routing file {args.trace}")
    return inputs.counts_from_trace(args.trace, geometry.n_layer, geometry.n_expert), None


def _source_kind(trace: str | None) -> str:
    if not trace:
        return "uniform"
    return "routing" if routing_file.is_routing_file(trace) else "trace"


def _frequencies(trace: str | None) -> str:
    if trace and routing_file.is_routing_file(trace):
        return f"recorded routing {trace} (the order its tokens routed in, where enough tokens were generated)"
    return f"trace {trace}" if trace else "uniform (no --trace: every expert equally likely)"


# ---------------------------------------------------------------------------------------- formatting


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _pct(fraction: float) -> str:
    return f"{fraction:.1%}"


def _mean_size(sizes: Sequence[int]) -> str:
    return human_size(sum(sizes) / len(sizes))


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """The first column left-aligned, numbers right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in [header, *rows])


def _report(model_path: str, geometry: inputs.ModelGeometry, costs: inputs.Costs, costs_source: str,
            trace: str | None, plan: planner.Plan) -> str:
    g, c = geometry, costs
    raw = [i for i in range(len(g.layers)) if not g.has_tiers(i)]
    if not raw:
        sizes = (f"an expert is {_mean_size(g.hot_bytes)} hot, {_mean_size(g.warm_bytes)} warm, "
                 f"{_mean_size(g.sm_bytes)} sm")
    else:
        which = "every layer's" if len(raw) == len(g.layers) else f"{len(raw)} layers'"
        sizes = (f"an expert is {_mean_size(g.hot_bytes)} hot; {which} experts are stored raw: hot or cold only, a "
                 f"cold one read as stored ({_mean_size([g.warm_bytes[i] for i in raw])}), not decoded")
    lines = [
        (f"model:        {model_path}: {len(g.layers)} MoE layers of {g.n_expert} experts, {g.n_expert_used} "
         f"routed per token; {sizes}"),
        f"budget:       {human_size(plan.budget)} for the expert tiers (all hot: {human_size(g.all_hot_bytes)})",
        f"frequencies:  {_frequencies(trace)}",
        (f"costs:        {costs_source}: {c.cores} cores, decode {_ms(c.t_decode)} ms per expert per core, disk "
         f"{c.disk_bandwidth / 1e6:.0f} MB/s + {_ms(c.read_latency)} ms per read, base "
         f"{_ms(c.base_seconds_per_token)} ms per token"),
        "",
    ]
    header = ("layer", "hot", "warm", "sm", "cold", "bytes", "hit hot", "warm", "sm", "cold", "delay ms")
    rows = [(str(lp.layer), str(lp.hot), str(lp.warm), str(lp.sm), str(lp.cold), human_size(lp.nbytes),
             *map(_pct, lp.hit_rates), _ms(lp.delay)) for lp in plan.layers]
    rates = plan.hit_rates
    rows.append(("all", *(str(sum(getattr(lp, t) for lp in plan.layers)) for t in inputs.TIERS),
                 human_size(plan.nbytes), *(_pct(rates[t]) for t in inputs.TIERS), _ms(plan.delay)))
    lines += [_table(header, rows), ""]
    all_hot = 1.0 / plan.base_seconds_per_token
    lines.append(f"predicted generation: {plan.tokens_per_second:.1f} tokens/s (all hot: {all_hot:.1f} tokens/s)")
    lines.append(f"{PLAN_ENV}={plan.encode()}")
    return "\n".join(lines)


def _to_json(model_path: str, geometry: inputs.ModelGeometry, costs: inputs.Costs, costs_source: str,
             trace: str | None, plan: planner.Plan) -> dict[str, Any]:
    g = geometry
    return {
        "model": model_path, "frequencies": _source_kind(trace), "trace": trace,
        "costs": asdict(costs), "costs_source": costs_source,
        "geometry": {"n_layer": g.n_layer, "n_expert": g.n_expert, "n_expert_used": g.n_expert_used,
                     "layers": list(g.layers), "hot_bytes": list(g.hot_bytes), "warm_bytes": list(g.warm_bytes),
                     "sm_bytes": list(g.sm_bytes), "all_hot_bytes": g.all_hot_bytes,
                     "tiered": [g.has_tiers(i) for i in range(len(g.layers))]},
        **plan.to_dict(), "all_hot_tokens_per_second": 1.0 / plan.base_seconds_per_token,
        "env": RuntimeConfig(plan=plan.encode()).to_env(),
    }


# ------------------------------------------------------------------------------------------- command


def cmd_plan(args: argparse.Namespace) -> int:
    from ..runtime.budget import AUTO, check_budget, model_memory, parse_budget
    from ..models.directory import resolve_model

    if str(args.plan_budget).strip().lower() != AUTO:
        parse_budget(args.plan_budget)  # a usage error (exit 2) before any file is read
    path, _ = resolve_model(args.model)
    model_path = str(path)
    geometry = inputs.geometry_from_gguf(path)  # (a zipmoe or plain GGUF; PlanInputError for anything else)
    need = model_memory(path)
    budget = parse_budget(args.plan_budget, model_bytes=need.whole)
    check_budget(budget, need)
    counts, routing = _routing(args, geometry)
    costs, costs_source = _costs(args, model_path, geometry)
    model = planner.cost_model(geometry, costs, counts, routing, policy=args.policy)
    plan = planner.plan_tiers(model, budget - need.minimum)
    memory = {"budget": budget, "other_bytes": need.other_bytes, "in_flight_bytes": need.in_flight_bytes,
              "read_bytes": plan.read_bytes, "tier_bytes": budget - need.minimum - plan.read_bytes,
              "embd_bytes": need.embd_bytes, "embd_charged_bytes": need.embd_charged}
    if args.json:
        print(json.dumps({**_to_json(model_path, geometry, costs, costs_source, args.trace, plan), "memory": memory},
                         indent=2))
    else:
        print(f"memory:       {human_size(budget)} in all = {human_size(need.other_bytes)} of weights that are not "
              f"experts{need.embd_note} + {human_size(need.in_flight_bytes)} for one expert tensor's experts in flight + "
              f"{human_size(plan.read_bytes)} for a prompt's reads + "
              f"{human_size(budget - need.minimum - plan.read_bytes)} for the tiers")
        print(_report(model_path, geometry, costs, costs_source, args.trace, plan))
    return 0


def register(sub: Any) -> None:
    """Adds `plan` to the `zipmoe` command's subparsers."""
    p = command(sub, "plan", cmd_plan, DESCRIPTION, help="plan the expert tiers of each layer for a memory budget",
                epilog=EPILOG)
    p.add_argument("model", metavar="MODEL", help="a zipmoe or plain GGUF, or the name of a stored model")
    p.add_argument("--memory-budget", dest="plan_budget", required=True, metavar="SIZE",
                   help="the model's whole budget: 6GiB, 512MiB, 1000000, a percentage of the memory (60%%) or "
                        "auto (what this process could allocate now, less a margin)")
    p.add_argument("--trace", metavar="FILE",
                   help="routing counts (.npz with key counts, or .npy), or a recorded-routing file (docs/FORMAT.md, "
                        "pyzipmoe.Llama(record_routing=...)); default: every expert equally likely")
    p.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY,
                   help=f"the run's eviction policy, whose hits a recorded routing predicts (default {DEFAULT_POLICY})")
    p.add_argument("--costs", metavar="FILE.json",
                   help="costs of this machine (JSON; see below); default: the model's calibration, else a "
                        "conservative estimate")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")

