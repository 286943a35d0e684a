"""Memory budgets as people write them ("6GiB", "512M", "60%", "auto") and the environment that carries them to the
runtime.

The runtime in libllama reads ZIPMOE_MEMORY_BUDGET (bytes), ZIPMOE_HOT_SHARE and ZIPMOE_CACHE_POLICY when a model
loads (ggml_zipmoe/src/op/zipmoe-llama.cpp); this module validates what a user gives before it gets there.

A budget covers everything the model keeps resident: its weights that are not experts (read through llama.cpp's
mmap), the experts of the expert tensor in flight (decoded whatever the budget, since its matmul needs them; a
prompt may route to all of them) and the cache tiers, which get the rest. `model_memory` gives the first two, whose
sum is the smallest budget that works.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .errors import ZipmoeError

POLICIES = ("tlfu", "lru", "lfu", "fifo")  # tlfu: the paper's token-weighted LFU
BUDGET_ENV, HOT_SHARE_ENV, POLICY_ENV = "ZIPMOE_MEMORY_BUDGET", "ZIPMOE_HOT_SHARE", "ZIPMOE_CACHE_POLICY"
SM_SHARE_ENV, PLAN_ENV = "ZIPMOE_SM_SHARE", "ZIPMOE_PLAN"
CACHE_ENV = "ZIPMOE_CACHE"  # "none": decode on every use
PREFILL_ENV = "ZIPMOE_PREFILL"  # "0": leave the cache tiers empty at load
DIRECT_IO_ENV = "ZIPMOE_DIRECT_IO"  # "0": read the model file through the page cache instead of O_DIRECT
READ_BUFFER_ENV = "ZIPMOE_READ_BUFFER"  # what each of the reader's buffers keeps between uses (default 16MiB)
PREDICT_ENV = "ZIPMOE_PREDICT"  # "1": read ahead the experts the next layer's router picks on this layer's input
# every variable that configures the runtime: what a benchmark or test clears to start from the defaults
RUNTIME_ENV = (CACHE_ENV, BUDGET_ENV, HOT_SHARE_ENV, SM_SHARE_ENV, PLAN_ENV, POLICY_ENV, PREFILL_ENV, DIRECT_IO_ENV,
               READ_BUFFER_ENV, PREDICT_ENV)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z%]*)\s*$")


def total_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


AUTO = "auto"
_WRITE = "write e.g. 6GiB, 512MiB, 60% or auto"


def parse_budget(text: str | int, *, total: int | None = None, model_bytes: int | None = None) -> int:
    """Bytes from "6GiB", "512MiB", "1000000", "60%" (of `total`, default the machine's memory) or "auto".

    "auto" is what this process could allocate now less a safety margin, at most `model_bytes` if given
    (pyzipmoe.memory.auto_budget). "0" is a budget too: keep no expert, decode on every use.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ZipmoeError(f"memory budget {text} is negative: {_WRITE}")
        return text
    if str(text).strip().lower() == AUTO:
        from . import memory  # imported on use: psutil and /proc are read only for "auto"

        return memory.auto_budget(memory.read_memory(), model_bytes)
    m = _SIZE.match(str(text))
    if not m:
        raise ZipmoeError(f"memory budget {text!r} is not a size{_why_not(str(text).strip())}: {_WRITE}")
    value, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        if value > 100:
            raise ZipmoeError(f"memory budget {text!r} is more than all of the memory: write at most 100%, or auto")
        return int(value / 100 * (total if total is not None else total_memory()))
    if unit not in _UNITS:
        raise ZipmoeError(f"memory budget {text!r} has an unknown unit {m.group(2)!r}: use B, KiB, MiB, GiB, TiB "
                          "or %, or write auto")
    return int(value * _UNITS[unit])


def _why_not(text: str) -> str:
    """The common mistakes named, so that the message says more than "not a size"."""
    if not text:
        return " (it is empty)"
    if text.startswith("-"):
        return " (it is negative)"
    return ""


def cache_environment(budget: str | int | None = None, policy: str | None = None,
                      hot_share: float | None = None, sm_share: float | None = None) -> dict[str, str]:
    """The variables that configure the runtime's cache; empty for the defaults (unbounded, tlfu). The shares split
    what the budget leaves for the cache tiers: hot_share decoded, sm_share sign+mantissa planes, the rest whole
    compressed experts."""
    env = {}
    if budget is not None:
        env[BUDGET_ENV] = str(parse_budget(budget))
    if policy is not None:
        if policy not in POLICIES:
            raise ZipmoeError(f"cache policy {policy!r} is not one of {', '.join(POLICIES)}")
        env[POLICY_ENV] = policy
    for name, share, var in (("hot share", hot_share, HOT_SHARE_ENV), ("sm share", sm_share, SM_SHARE_ENV)):
        if share is not None:
            if not 0 <= share <= 1:
                raise ZipmoeError(f"{name} {share} is not a fraction between 0 and 1")
            env[var] = repr(float(share))
    if (hot_share or 0) + (sm_share or 0) > 1 + 1e-9:
        raise ZipmoeError(f"hot share {hot_share} and sm share {sm_share} add up to more than 1")
    return env


@dataclass(frozen=True)
class ModelMemory:
    """What a zipmoe model keeps resident whatever its budget, in bytes."""

    other_bytes: int      # weights that are not compressed experts
    in_flight_bytes: int  # the BF16 experts of the largest expert tensor: decoded at once when a batch routes to all
    expert_bytes: int     # every expert in BF16

    @property
    def minimum(self) -> int:
        return self.other_bytes + self.in_flight_bytes


def model_memory(path: str | os.PathLike[str]) -> ModelMemory:
    """The runtime's own accounting (zipmoe_llama_configure) for a zipmoe GGUF, from its header and indexes."""
    from . import format

    zf = format.open_zipmoe(path)
    compressed = {c.name for c in zf.compressed}
    other = sum(t.nbytes for t in zf.source.tensors if t.name not in compressed)
    return ModelMemory(other_bytes=other, in_flight_bytes=max((c.source.nbytes for c in zf.compressed), default=0),
                       expert_bytes=sum(c.source.nbytes for c in zf.compressed))


def check_budget(budget: int, need: ModelMemory) -> None:
    """The runtime's refusal, said before a model is loaded: the budget must hold `need.minimum`."""
    if budget < need.minimum:
        mib = 1 << 20
        raise ZipmoeError(
            f"memory budget {budget / mib:.0f} MiB is too small for this model: it needs at least "
            f"{need.minimum / mib:.0f} MiB ({need.other_bytes / mib:.0f} MiB of weights that are not experts + "
            f"{need.in_flight_bytes / mib:.0f} MiB for the experts of one expert tensor in flight); raise "
            "--memory-budget")
