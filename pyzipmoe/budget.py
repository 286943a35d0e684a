"""Memory budgets as people write them ("6GiB", "512M", "60%") and the environment that carries them to the runtime.

The runtime in libllama reads ZIPMOE_MEMORY_BUDGET (bytes), ZIPMOE_HOT_SHARE and ZIPMOE_CACHE_POLICY when a model
loads (ggml_zipmoe/src/op/zipmoe-llama.cpp); this module validates what a user gives before it gets there.
"""

from __future__ import annotations

import re

from .errors import ZipmoeError

POLICIES = ("tlfu", "lru", "lfu", "fifo")  # tlfu: the paper's token-weighted LFU
BUDGET_ENV, HOT_SHARE_ENV, POLICY_ENV = "ZIPMOE_MEMORY_BUDGET", "ZIPMOE_HOT_SHARE", "ZIPMOE_CACHE_POLICY"
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z%]*)\s*$")


def total_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def parse_budget(text: str | int, *, total: int | None = None) -> int:
    """Bytes from "6GiB", "512MiB", "1000000" or "60%" (of `total`, default the machine's memory)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ZipmoeError(f"memory budget {text} is negative")
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ZipmoeError(f"memory budget {text!r} is not a size: write e.g. 6GiB, 512MiB or 60%")
    value, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        if value > 100:
            raise ZipmoeError(f"memory budget {text!r} is more than all of the memory (at most 100%)")
        return int(value / 100 * (total if total is not None else total_memory()))
    if unit not in _UNITS:
        raise ZipmoeError(f"memory budget {text!r} has an unknown unit {m.group(2)!r}: use B, KiB, MiB, GiB or %")
    return int(value * _UNITS[unit])


def cache_environment(budget: str | int | None = None, policy: str | None = None,
                      hot_share: float | None = None) -> dict[str, str]:
    """The variables that configure the runtime's cache; empty for the defaults (unbounded, tlfu)."""
    env = {}
    if budget is not None:
        env[BUDGET_ENV] = str(parse_budget(budget))
    if policy is not None:
        if policy not in POLICIES:
            raise ZipmoeError(f"cache policy {policy!r} is not one of {', '.join(POLICIES)}")
        env[POLICY_ENV] = policy
    if hot_share is not None:
        if not 0 <= hot_share <= 1:
            raise ZipmoeError(f"hot share {hot_share} is not a fraction between 0 and 1")
        env[HOT_SHARE_ENV] = repr(float(hot_share))
    return env
