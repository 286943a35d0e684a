"""The time ledger per token: where the computing thread's time went (ggml_zipmoe/include/zipmoe-ledger.h), from the
counters of pyzipmoe.runtime.llama.zipmoe_stats (ledger_*). Pure: no native calls here.

Parts, in the order a table lists them: compute (the graph's nodes and expert matmuls), decode, read_wait (bytes
not yet read from the file), thread_wait (other threads: siblings, other plans, locks), other (zipmoe's
bookkeeping in its ops) and outside (between graphs: llama.cpp's own work, sampling, the caller). Together they are
the thread's wall time from the first graph's start after a reset to the last graph's end.
"""

from __future__ import annotations

from collections.abc import Mapping

PARTS: tuple[tuple[str, str, str], ...] = (
    ("compute", "ledger_compute_ns", "the graph: attention, router, expert matmuls"),
    ("decode", "ledger_decode_ns", "decoding experts"),
    ("read_wait", "ledger_read_wait_ns", "waiting for reads from the file"),
    ("thread_wait", "ledger_thread_wait_ns", "waiting for other threads"),
    ("other", "ledger_other_ns", "zipmoe's plans, evictions, bookkeeping"),
    ("outside", "ledger_between_ns", "outside the graph: llama.cpp, sampling, caller"),
)


def per_token(stats: Mapping[str, float]) -> dict[str, float]:
    """Seconds per token of each part, and their sum as "total"; every value 0 where no token was counted."""
    tokens = int(stats.get("ledger_tokens", 0))
    out = {name: (stats.get(key, 0) / tokens / 1e9 if tokens else 0.0) for name, key, _ in PARTS}
    out["total"] = sum(out.values())
    return out


def table_rows(stats: Mapping[str, float]) -> list[tuple[str, str, str]]:
    """(part, ms per token, share of the total) for a table, the total last."""
    parts = per_token(stats)
    total = parts["total"]
    rows = [(f"{name} ({what})", f"{parts[name] * 1e3:.3f}", f"{parts[name] / total:.1%}" if total else "-")
            for name, _, what in PARTS]
    rows.append(("total", f"{total * 1e3:.3f}", "100.0%" if total else "-"))
    return rows
