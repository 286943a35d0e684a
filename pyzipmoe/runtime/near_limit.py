"""A timed generation with its time ledger, and its speed against the limit model (pyzipmoe.plan.limit): what
`zipmoe bench --ledger` and `zipmoe bench --memory-budget` print after llama-bench's figures, and what
tools/bench/bench_budget.py reports for each row.

The timed run (pyzipmoe.runtime.timing, a fresh process) generates greedily under the budget and records its own
routing; the limit is computed from that routing, the budget's expert cache (the budget less the weights that are
not experts) and this machine's calibration of the model (`zipmoe calibrate`, measured through the stores if none is
kept); the compute per token with every expert resident is measured by the same generation unbounded unless given.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..plan.limit import ExpertSizes, Limit, Rates, from_calibration, limit


@dataclass(frozen=True)
class Report:
    tokens_per_second: float  # the timed run's
    stats: dict[str, float]  # the runtime's counters over its timed tokens (the ledger: ledger_*)
    limit: Limit | None  # None without a budget
    rates: Rates | None
    sizes: ExpertSizes | None
    cache_bytes: int | None
    parallel: int = 1  # sequences generated in lockstep (tokens_per_second counts every sequence's)
    prompt: dict[str, Any] | None = None  # a timed prompt's {"tokens", "tps", "seconds", "stats"}, if one was asked

    @property
    def share(self) -> float | None:
        """The measured tokens/s as a share of the limit's."""
        return None if self.limit is None else self.tokens_per_second / self.limit.tokens_per_second

    def to_dict(self) -> dict[str, Any]:
        return {"tokens_per_second": self.tokens_per_second, "stats": self.stats, "share_of_limit": self.share,
                "limit": None if self.limit is None else vars(self.limit),
                "rates": None if self.rates is None else vars(self.rates),
                "sizes": None if self.sizes is None else vars(self.sizes), "cache_bytes": self.cache_bytes,
                "parallel": self.parallel, "prompt": self.prompt}


def unbounded_seconds_per_token(model: str | os.PathLike[str], *, threads: int, warmup: int = 16,
                                gen: int = 64) -> float:
    """Seconds per generated token with every expert resident: the same timed generation, unbounded and warm."""
    from .timing import time_generation

    got = time_generation(model, llama={}, warmup=warmup, gen=gen, threads=threads)
    return float(got["seconds"]) / gen


def measure(model: str | os.PathLike[str], *, llama: dict[str, Any], threads: int, budget_bytes: int | None,
            warmup: int = 16, gen: int = 64, compute_seconds_per_token: float | None = None, prompt: int = 0,
            parallel: int = 1) -> Report:
    """The timed run under `llama` (pyzipmoe.Llama's keywords: memory_budget, cache_policy, ...) and, with
    budget_bytes (what memory_budget comes to), the limit for a cache of that budget on its routing. `prompt` and
    `parallel` as time_generation's; the limit models one sequence (ValueError with parallel > 1)."""
    from ..plan import trace
    from .timing import time_generation

    if budget_bytes is None:
        got = time_generation(model, llama=llama, warmup=warmup, gen=gen, threads=threads, prompt=prompt,
                              parallel=parallel)
        return Report(float(got["tps"]), got["stats"], None, None, None, None, parallel, got["prompt"])
    if parallel > 1:
        raise ValueError("the limit model is one sequence's: no parallel sequences with a budget's limit")
    from .budget import model_memory
    from .measure import calibrate

    cal = calibrate(model, engine=False)  # (first: the rates the limit takes, then the runs back to back)
    if compute_seconds_per_token is None:
        compute_seconds_per_token = cal.base_seconds_per_token or \
            unbounded_seconds_per_token(model, threads=threads, warmup=warmup, gen=gen)
    rates, sizes = from_calibration(cal, compute_seconds_per_token=compute_seconds_per_token, cores=threads)
    with tempfile.TemporaryDirectory(prefix="zipmoe-limit-") as tmp:
        record = Path(tmp) / "routing.npz"
        got = time_generation(model, llama=llama, warmup=warmup, gen=gen, threads=threads, record=record,
                              prompt=prompt)
        routing = trace.load(record)
    tps = float(got["tps"])
    cache_bytes = max(0, budget_bytes - model_memory(model).other_bytes)
    best = limit(routing, rates, sizes, cache_bytes, timed_from=int(got["timed_from"]))
    return Report(tps, got["stats"], best, rates, sizes, cache_bytes, prompt=got["prompt"])


def limit_line(report: Report) -> str:
    """One line: the measured tokens/s as a share of the limit, and what the limit assumed."""
    from .budget import human_size

    if report.limit is None or report.cache_bytes is None:
        what = f"{report.parallel} sequences in lockstep" if report.parallel > 1 else "no budget"
        return f"timed generation: {report.tokens_per_second:.2f} tokens/s ({what}: no limit)"
    lim = report.limit
    return (f"timed generation ({lim.tokens} tokens): {report.tokens_per_second:.2f} tokens/s = {report.share:.0%} of "
            f"the limit {lim.tokens_per_second:.2f} tokens/s for a {human_size(report.cache_bytes)} expert cache "
            f"(Belady's hits {lim.hits / max(1, lim.routed):.1%}, experts kept {lim.layout}, reads overlapped, "
            f"decoding on {report.rates.cores if report.rates else '?'} cores)")
