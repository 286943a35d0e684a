"""One memory budget for every model the server has loaded, divided between them through each model's control file
(ZIPMOE_CONTROL, pyzipmoe.runtime.supervise's channel: a split in, the bytes the cache holds out).

The rule (`divide`): every loaded model keeps its minimum (its weights that are not experts and one expert tensor
in flight: pyzipmoe.runtime.budget.ModelMemory.minimum); the rest of the budget goes to the models in the order
they were last used, the most recent first, each up to its whole size (every expert decoded). So the model
answering gets the room, and idle models shrink toward their minimum, evicting experts by the cache's policy,
before anything is unloaded. A model is unloaded (the least recently used idle one first, `evictions`) only when
the minimums no longer fit: to load another model, or when an `auto` budget shrinks.

A plain GGUF has no control file: it runs with the share it was loaded with, which counts as its minimum.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..runtime.budget import AUTO, human_size, parse_budget

REBALANCE_STEP = 0.01  # a share that moves by less than this fraction of itself is not published again
AUTO_THRESHOLD = 0.05  # an `auto` budget is re-divided when it moves by more than this fraction


@dataclass
class Tenant:
    """A loaded model as the budget sees it."""

    name: str
    minimum: int  # the smallest share it can run with
    whole: int  # the share that holds all of it; more is of no use
    last_used: float = field(default_factory=time.monotonic)


def divide(total: int, tenants: Sequence[Tenant]) -> dict[str, int]:
    """Each tenant's share of `total`: its minimum, then what is left to the most recently used first, each up to
    its whole. (The minimums may add up to more than `total` for a moment, before `evictions` are unloaded.)"""
    shares = {t.name: t.minimum for t in tenants}
    left = total - sum(shares.values())
    for t in sorted(tenants, key=lambda t: -t.last_used):
        give = max(0, min(left, t.whole - t.minimum))
        shares[t.name] += give
        left -= give
    return shares


def evictions(total: int, tenants: Sequence[Tenant], incoming: int = 0, busy: Iterable[str] = ()) -> list[str] | None:
    """The tenants to unload, least recently used first, so that their minimums and `incoming` (a model about to
    load: its minimum) fit in `total`; those in `busy` (answering a request) are not unloaded. None: not even
    unloading every idle one makes room."""
    busy = set(busy)
    need = incoming + sum(t.minimum for t in tenants)
    out = []
    for t in sorted(tenants, key=lambda t: t.last_used):
        if need <= total:
            break
        if t.name not in busy:
            out.append(t.name)
            need -= t.minimum
    return out if need <= total else None


@dataclass
class _Loaded:
    tenant: Tenant
    control: Any = None  # pyzipmoe.runtime.supervise.ControlFile; None: a plain GGUF, its share fixed
    sizes: list[tuple[int, int, int]] = field(default_factory=list)  # cache_control.store_sizes of its experts
    warm_fast: bool = False
    other_bytes: int = 0  # its weights that are not experts (mapped: counted in the file cache, not in resident)
    share: int = 0  # what it was last given


class SharedBudget:
    """The server's budget (`--memory-budget`: a size, a percentage or "auto") and the loaded models' shares.
    Thread-safe; the server's routes call it from the event loop, the shares are published at once."""

    def __init__(self, given: str | int = AUTO, *, policy: str | None = None,
                 split: tuple[float | None, float | None, float] = (None, None, 0.0)) -> None:
        self.given = given
        self.auto = str(given).strip().lower() == AUTO
        self.policy = policy
        self.split = split
        self._lock = threading.Lock()
        self._loaded: dict[str, _Loaded] = {}
        self.total = self._read_total() if self.auto else parse_budget(given)

    # -- the total

    def _read_total(self) -> int:
        """`auto`: what the models may use now, by the formula `--memory-budget auto` loads one model with
        (pyzipmoe.runtime.memory.auto_budget), what the loaded models' caches hold counted as theirs."""
        from ..runtime import memory

        return memory.auto_budget(memory.read_memory(), None, self.resident_total())

    def refresh(self, busy: Iterable[str] = ()) -> list[str]:
        """Reads an `auto` budget again and re-divides it when it moved past AUTO_THRESHOLD; the idle models to
        unload when even the minimums no longer fit."""
        if not self.auto:
            return []
        total = self._read_total()
        with self._lock:
            if abs(total - self.total) <= self.total * AUTO_THRESHOLD:
                return []
            self.total = total
            victims = evictions(total, [e.tenant for e in self._loaded.values()], 0, busy) or []
        self.rebalance()
        return victims

    # -- loading and unloading

    def admit(self, tenant: Tenant, busy: Iterable[str] = ()) -> tuple[int, list[str]]:
        """For a model about to load: the share it loads with (as the most recently used) and the idle models to
        unload first. ZipmoeError when the budget cannot hold its minimum next to the models answering now."""
        from ..errors import ZipmoeError

        with self._lock:
            tenants = [e.tenant for e in self._loaded.values()]
            victims = evictions(self.total, tenants, tenant.minimum, busy)
            if victims is None:
                held = sum(t.minimum for t in tenants if t.name in set(busy))
                raise ZipmoeError(
                    f"the server's memory budget of {human_size(self.total)} cannot hold the minimum of "
                    f"{human_size(tenant.minimum)} for {tenant.name}"
                    + (f" next to the models answering now ({human_size(held)})" if held else "")
                    + "; raise --memory-budget")
            staying = [t for t in tenants if t.name not in victims]
            tenant.last_used = time.monotonic()
            return divide(self.total, [*staying, tenant])[tenant.name], victims

    def make_room(self, tenant: Tenant) -> None:
        """Shrinks the loaded models to the shares they keep once `tenant` is loaded (before it starts)."""
        with self._lock:
            tenants = [e.tenant for e in self._loaded.values()]
            shares = divide(self.total, [*tenants, tenant])
        self._publish({k: v for k, v in shares.items() if k != tenant.name})

    def add(self, tenant: Tenant, share: int, *, control: Any = None, sizes: list[tuple[int, int, int]] | None = None,
            warm_fast: bool = False, other_bytes: int = 0) -> None:
        with self._lock:
            if control is None:  # a fixed share: all it can use, and all it must keep
                tenant.minimum = tenant.whole = share
            self._loaded[tenant.name] = _Loaded(tenant, control, list(sizes or []), warm_fast, other_bytes, share)
        self.rebalance()

    def remove(self, name: str) -> None:
        with self._lock:
            self._loaded.pop(name, None)
        self.rebalance()

    def touch(self, name: str) -> None:
        """`name` answers a request: it becomes the most recently used, and gets the room."""
        with self._lock:
            loaded = self._loaded.get(name)
            if loaded is None:
                return
            loaded.tenant.last_used = time.monotonic()
        self.rebalance()

    # -- the shares

    def rebalance(self) -> None:
        with self._lock:
            shares = divide(self.total, [e.tenant for e in self._loaded.values()])
        self._publish(shares)

    def _publish(self, shares: dict[str, int]) -> None:
        from ..runtime.cache_control import apply_shares
        from ..runtime.config import DEFAULT_POLICY
        from ..runtime.supervise import RemoteRuntime

        with self._lock:
            for name, share in shares.items():
                e = self._loaded.get(name)
                if e is None or e.control is None:
                    continue
                if e.share and abs(share - e.share) <= e.share * REBALANCE_STEP:
                    continue
                apply_shares(max(0, share - e.tenant.minimum), self.split, e.sizes, self.policy or DEFAULT_POLICY,
                             RemoteRuntime(e.control), e.warm_fast)
                e.share = share

    def share(self, name: str) -> int:
        e = self._loaded.get(name)
        return e.share if e is not None else 0

    def resident(self, name: str) -> int:
        """What the model's cache holds now (its control file's report), 0 before its first report."""
        from ..runtime.supervise import W_RESIDENT

        e = self._loaded.get(name)
        return e.control.value(W_RESIDENT) if e is not None and e.control is not None else 0

    def resident_total(self) -> int:
        return sum(self.resident(name) for name in list(self._loaded))

    def settled(self, names: Iterable[str]) -> bool:
        """Whether these models' caches hold no more than their shares (after make_room)."""
        from ..runtime.supervise import W_RESIDENT

        for name in names:
            e = self._loaded.get(name)
            if e is not None and e.control is not None and e.control.reporting:
                if e.control.value(W_RESIDENT) > e.share - e.other_bytes:
                    return False
        return True

    def last_used(self, name: str) -> float:
        e = self._loaded.get(name)
        return e.tenant.last_used if e is not None else 0.0

    def names(self) -> list[str]:
        return list(self._loaded)
