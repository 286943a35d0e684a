"""`zipmoe calibrate MODEL`: what decoding and reading experts cost on this machine, measured once and cached.

The zipmoe command (pyzipmoe.cli) calls `register(subparsers)`; the native library loads only when a measurement
runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .formatting import command, human_size

from ..errors import ZipmoeError

from ..plan.calibration import Calibration, cache_file
from ..plan.disk import LATENCY_PROBES
from ..runtime.measure import DEFAULT_READ_BYTES

if TYPE_CHECKING:
    from ..models.directory import ModelDirectory
    from ..models.routing_run import RecordedRouting

__all__ = ["calibration_table", "register"]


# ------------------------------------------------------------------------------------------ formatting


def duration(seconds: float) -> str:
    """3 significant digits in the unit that keeps them above 1: 850 ns, 12.3 µs, 4.56 ms, 1.20 s."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if seconds >= scale or unit == "ns":
            return f"{seconds / scale:#.3g}".rstrip(".") + f" {unit}"
    raise AssertionError("unreachable")


def _values_per_second(v: float) -> str:
    return f"{v / 1e9:.2f} G values/s" if v >= 1e9 else f"{v / 1e6:.1f} M values/s"


def _table(rows: list[tuple[str, str, str]]) -> str:
    """Names left, values right-aligned (so units line up), notes left."""
    wn, wv = (max(len(r[i]) for r in rows) for i in (0, 1))
    return "\n".join(f"  {n:<{wn}}  {v:>{wv}}  {note}".rstrip() for n, v, note in rows)


def calibration_table(cal: Calibration, cache_path: Path | None = None) -> str:
    """What `zipmoe calibrate` prints: a heading, one row per cost with its unit and what it means, the cache."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(cal.measured_at))
    source = "from the cache" if cal.from_cache else f"measured in {cal.seconds:.1f} s"
    expert = (f"one expert of layer {cal.layer} ({cal.expert_tensors} tensors, {cal.expert_values} values, "
              f"{human_size(cal.expert_compressed_bytes)})")
    raw = cal.t_read_sm is None  # stored raw: no decode, no compressed tier
    rows = [("cores", str(cal.cores), "usable by this process (CPU affinity, cgroup CPU quota)")]
    if raw:
        rows += [("t_decode", duration(cal.t_decode) if cal.t_decode else "0",
                  f"{expert}: stored raw, kept decoded or read as stored, never decoded"),
                 ("t_read_cold", duration(cal.t_read_cold), "wall time per expert read from disk into place (cold)")]
    else:
        rows += [("t_decode", duration(cal.t_decode),
                  f"core time: {expert} from RAM, through the runtime on every core"),
                 ("t_read_sm", duration(cal.t_read_sm),
                  "wall time per expert, exponent codes read from disk (sm tier)"),
                 ("t_read_cold", duration(cal.t_read_cold), "wall time per expert, whole region read from disk (cold)")]
    if cal.t_decode_fresh is not None:
        rows.append(("decode, fresh", duration(cal.t_decode_fresh), "the decoder alone into freshly mapped pages"))
    for name, v in sorted(cal.decode_values_per_second.items(), key=lambda kv: kv[0] != cal.codec):
        how = "the file's codec" if name == cal.codec else "the same expert re-encoded"
        rows.append((f"decode {name}", _values_per_second(v), f"one core, checksums checked; {how}"))
    if cal.merge_seconds_per_value is not None and cal.split_seconds_per_value is not None:
        rows += [
            ("merge", f"{cal.merge_seconds_per_value * 1e9:.3f} ns/value",
             "exponent + sign/mantissa planes into BF16/F16"),
            ("split", f"{cal.split_seconds_per_value * 1e9:.3f} ns/value", "BF16/F16 into the two planes"),
        ]
    rows += [
        ("read latency", duration(cal.read_latency), f"cold read of one page, median of up to {LATENCY_PROBES}"),
        ("disk bandwidth", f"{human_size(cal.disk_bandwidth)}/s",
         f"cold, {cal.reads} expert regions of ~{human_size(cal.read_size)} ({human_size(cal.bytes_read)}), net of latency"),
        ("base time/token", duration(cal.base_seconds_per_token) if cal.base_seconds_per_token else "-",
         "given" if cal.base_seconds_per_token else "not measured: it needs the model running"),
    ]
    what = ("a plain GGUF, experts served as stored" if cal.plain else
            "experts stored raw" if cal.codec == "raw" else f"{cal.codec} codec")
    lines = [f"calibration of {cal.model['path']} ({what}) on {cal.machine['cpu']}, {when}, {source}",
             "", _table(rows)]
    if not cal.page_cache_dropped:
        lines += ["", "note: the page cache could not be dropped here, so the disk reads may have been warm"]
    if cache_path is not None:
        lines += ["", f"cached in {cache_path}; `zipmoe calibrate --force` measures again"]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ command


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ..models.directory import ModelDirectory, resolve_model
    from ..runtime.measure import calibrate
    from ..progress import for_terminal

    path, package = resolve_model(args.model)
    prior_path = None
    if args.routing is not None:
        if package is None:
            raise ZipmoeError(f"{args.model}: --routing keeps a prior for a stored model (a name that `zipmoe list` "
                              "shows), not a file; for a file, write one with pyzipmoe.plan.prior")
        prior_path = _keep_prior(ModelDirectory(), str(package.name), args.routing)
    cal = calibrate(path, force=args.force, progress=for_terminal(args.json), read_bytes=args.read,
                    engine=not args.no_engine)
    recorded = None
    if package is not None and args.routing is None and not args.no_prior and not args.no_engine:
        if args.force or package.prior() is None:
            recorded, prior_path = _record_prior(ModelDirectory(), str(package.name), for_terminal(args.json))
    where = cache_file(cal.model["path"], cal.machine)
    if args.json:
        print(json.dumps({**cal.to_dict(), "from_cache": cal.from_cache, "costs": cal.as_costs_dict(),
                          "cache_file": str(where), "prior": str(prior_path) if prior_path else None},
                         indent=2, ensure_ascii=False))
    else:
        print(calibration_table(cal, where))
        if prior_path is not None:
            source = "" if recorded is None else (
                f", the routing of {recorded.tokens} tokens of built-in prompts run "
                + ("as chat turns in its template" if recorded.chat else
                   "as plain completions (the model has no chat template)"))
            print(f"\nprior kept in {prior_path}{source}: runs of {args.model} under a memory budget start from it")
    return 0


def _keep_prior(store: ModelDirectory, name: str, routing: str) -> Path:
    """Keeps the counts of a recorded routing (pyzipmoe.Llama(record_routing=True).save_routing) as the stored
    model's prior, checked as the runtime will check it at load."""
    from ..plan import prior, trace

    counts = prior.from_routing(trace.load(routing))
    prior.decode(prior.encode(counts), f"the prior of {routing}")
    return store.keep_prior(name, counts)


def _record_prior(store: ModelDirectory, name: str, progress: Any) -> tuple[RecordedRouting, Path]:
    """Records the stored model's routing on the built-in prompts (pyzipmoe.models.routing_run) and keeps it as its
    prior: the recording, and where it is kept."""
    from ..models.routing_run import record_routing

    recorded = record_routing(store, name, progress)
    return recorded, store.keep_prior(name, recorded.counts)


def _read_size(text: str) -> int:
    from ..runtime.budget import parse_size

    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return n


def register(sub: Any) -> None:
    """Adds `calibrate` to the `zipmoe` command's subparsers."""
    p = command(
        sub, "calibrate", cmd_calibrate,
        help="measure what decoding and reading experts cost on this machine",
        description=(
            "Measure, for MODEL (a zipmoe GGUF, or a plain GGUF of any expert type) on this machine, what the "
            "memory-budget planner predicts with: "
            "the time a generated token takes with every expert decoded (base time/token) and what one expert of "
            "a layer adds when it comes from each tier: decoded from RAM (t_decode), its exponent codes read from "
            "disk (sm), all of it read from disk (cold). An expert stored raw (every expert of a plain GGUF, a "
            "zipmoe file's quantized ones) is never decoded: it is kept decoded or read as stored, so its cold read "
            "is what is measured. These are measured through the engine, by generating with the model six times "
            "(three for experts stored raw; some tens of seconds on a 3 GB model). Also, for information: each "
            "codec's decode speed, the cost of merging BF16 planes, and cold reads of the file (latency, "
            "bandwidth; the file is dropped from the page cache first and after). The result is cached per "
            "machine and model file under $XDG_CACHE_HOME/zipmoe/calibration (default "
            "~/.cache/zipmoe/calibration) and measured again when either changes. For a stored model that keeps "
            "no prior yet (or with --force), the model also runs a few built-in prompts (greedy, a few hundred "
            "tokens, in its chat template where it has one) and their routing is kept as its prior, which its runs "
            "under a memory budget start their eviction from and go on teaching."),
        examples=("zipmoe calibrate model.zipmoe.gguf",
                  "zipmoe calibrate model.zipmoe.gguf --force --read 1GiB   measure again, reading more of the file",
                  "zipmoe calibrate model.zipmoe.gguf --json | jq .costs",
                  "zipmoe calibrate model-Q4_K_M.gguf                  a plain GGUF: its experts' reads",
                  "zipmoe calibrate mymoe                               a stored model: also keep a prior from "
                  "its routing on built-in prompts",
                  "zipmoe calibrate mymoe --routing run.routing.npz     keep a stored model's prior from a recorded "
                  "routing"))
    p.add_argument("model", metavar="MODEL", help="a zipmoe GGUF (zipmoe convert makes one), a plain GGUF, or a "
                                                  "stored model's name")
    p.add_argument("--force", action="store_true", help="measure again even if a calibration is cached")
    p.add_argument("--read", type=_read_size, default=DEFAULT_READ_BYTES, metavar="SIZE",
                   help="how much of the file the disk measurement reads (default: 256MiB, or all of the experts "
                        "if they hold less); applies when measuring")
    p.add_argument("--no-engine", action="store_true",
                   help="time the tiers through the runtime's stores alone, without generating (seconds instead of "
                        "tens of seconds; no base time/token; on the machine measured it overstated some costs)")
    p.add_argument("--routing", metavar="FILE.npz",
                   help="a stored model only: keep the expert popularity of this recorded routing "
                        "(pyzipmoe.Llama(record_routing=True), save_routing) as the model's prior, which its runs "
                        "under a memory budget start their eviction from (ZIPMOE_PRIOR, unless set)")
    p.add_argument("--no-prior", action="store_true",
                   help="a stored model: do not record its routing on the built-in prompts as its prior (recorded "
                        "when it keeps none, or with --force; --no-engine does not run the model either)")
    p.add_argument("--json", action="store_true", help="print the calibration as one JSON object")
