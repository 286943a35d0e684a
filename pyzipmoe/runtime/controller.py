"""The controller: turns what a user asks for (a memory budget, "auto", a policy) into the runtime's cache settings
for one model, planned from the model's geometry, the machine's measured costs and the routing profile; and, while
the model runs, re-plans when the memory available to the process changes.

Settings reach the runtime two ways. Before a model loads, as environment variables that libllama reads
(ZIPMOE_MEMORY_BUDGET, ZIPMOE_PLAN, ...; see ggml_zipmoe/src/op/zipmoe-llama.cpp), which also works for llama-cli and
llama-server subprocesses. While it runs, through the native library's zipmoe_cache_set_slots, which libllama
shares with this process: every store applies new slots at its next invocation, so tiers shrink or grow without a
restart.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..plan import inputs
from ..plan import solver as planner
from .budget import Budget, ModelMemory, check_budget, model_memory, resolve_budget
from .cache_control import (_runtime_bytes, apply_plan, apply_shares, live_counts, live_routing, set_read_room,
                            store_sizes, warm_decodes_fast)
from .config import DEFAULT_POLICY, POLICY_ENV, PRIOR_ENV, PRIOR_RECORD_ENV, RuntimeConfig
from ..errors import OutOfMemoryError, ZipmoeError

if TYPE_CHECKING:
    from ..file.reader import ZipmoeFile

PENDING_STEPS = 20  # readings a shrink for the mapped weights waits for the tiers to come down to it, at most
ROUTING_MIN_TOKENS = 64  # tokens a layer routes between two re-plans from the routing seen
FLOOR_READINGS = 2  # readings in a row below the model's minimum before "auto" stops the run (the floor)


def model_path_of(model: ZipmoeFile | str | os.PathLike[str]) -> Path:
    """The file of a model given as a path or as its parsed structure."""
    from ..file.reader import ZipmoeFile

    return model.path if isinstance(model, ZipmoeFile) else Path(model)


def machine_costs(model_path: str | os.PathLike[str], geometry: inputs.ModelGeometry) -> tuple[inputs.Costs, str]:
    """The planner's costs: the model's cached calibration (`zipmoe calibrate`) where there is one, the planner's
    conservative defaults for what it lacks (base_seconds_per_token needs the model running); and where they came
    from."""
    costs = inputs.default_costs(geometry)
    try:
        from ..plan.calibration import load_calibration

        cal = load_calibration(model_path)
    except (ImportError, OSError, ZipmoeError):
        cal = None
    if cal is None:
        return costs, "conservative defaults (no calibration)"
    values = cal.as_costs_dict() if hasattr(cal, "as_costs_dict") else dict(cal)
    measured = {k: v for k, v in values.items() if v is not None}
    costs = inputs.costs_from_dict(measured, defaults=costs, label=f"calibration of {model_path}", strict=False)
    estimated = [name for name in inputs.COST_FIELDS
                 if name not in measured and name not in inputs.OPTIONAL_COST_FIELDS]
    return costs, "calibration" + (f" ({', '.join(estimated)}: conservative estimate)" if estimated else "")


@dataclass(frozen=True)
class Planned:
    """A model's plan and what it was made from."""

    need: ModelMemory
    budget: int  # bytes, the whole budget (weights that are not experts + one expert tensor in flight + tiers)
    model: planner.CostModel
    plan: planner.Plan
    costs_source: str


def plan_model(model: ZipmoeFile | str | os.PathLike[str], budget: int, *,
               trace: str | os.PathLike[str] | None = None, need: ModelMemory | None = None) -> Planned:
    """The planner's best split of `budget` between tiers, per layer. Raises ZipmoeError if the budget cannot
    hold the weights that are not experts and one expert tensor's experts."""
    need = need or model_memory(model)
    check_budget(budget, need)
    geometry = inputs.geometry_from_gguf(model)
    costs, source = machine_costs(model_path_of(model), geometry)
    counts = inputs.counts_from_trace(trace, geometry.n_layer, geometry.n_expert) if trace else None
    model = planner.cost_model(geometry, costs, counts)
    return Planned(need, budget, model, planner.plan_tiers(model, budget - need.minimum), source)


def planner_by_default(model_path: str | os.PathLike[str], *, budget: str | int | None, hot_share: float | None,
                       sm_share: float | None, plan: str | None = None, is_zipmoe: bool = True) -> bool:
    """Whether a run plans its budget when the user did not say: under a budget without a fixed split or plan,
    once the model has a calibration measured through the engine (`zipmoe calibrate`). Its costs are what the
    planner's predictions were checked with (tools/bench/bench_planner.py); without them it would plan from guesses,
    and the decoded-only split is the better bet."""
    if budget is None or not is_zipmoe or plan is not None or hot_share is not None or sm_share is not None:
        return False
    try:
        from ..plan.calibration import load_calibration

        cal = load_calibration(model_path)
    except (ImportError, OSError, ZipmoeError):
        return False
    return cal is not None and cal.tier_source == "engine"


@dataclass(frozen=True)
class RuntimeSettings:
    """The runtime's settings for one model: its environment (what libllama reads at load) and the budget it was
    resolved to once (None: no budget), which the callers pass on instead of reading the environment back."""

    env: dict[str, str]
    budget: Budget | None


def runtime_environment(model: ZipmoeFile | str | os.PathLike[str], **kwargs: Any) -> dict[str, str]:
    """The runtime's environment for one model (runtime_settings' env)."""
    return runtime_settings(model, **kwargs).env


def runtime_settings(model: ZipmoeFile | str | os.PathLike[str], *, budget: str | int | None = None,
                     policy: str | None = None, hot_share: float | None = None, sm_share: float | None = None,
                     use_planner: bool = False, trace: str | os.PathLike[str] | None = None,
                     is_zipmoe: bool = True, plan: str | None = None, mapped: bool = True) -> RuntimeSettings:
    """The runtime's settings for one model, its budget resolved once (resolve_budget). The runtime splits the
    budget by the shares (hot_share of what the tiers get decoded, default all; sm_share as sign+mantissa planes;
    the rest compressed), or the planner splits it per layer (use_planner, without shares), or `plan` (as
    `zipmoe plan` prints it) gives the slots.

    With the planner, the first tokens run with the trace's plan, or without a trace with decoded experts only: the
    frequency model underrates the decoded tier, whose LRU eviction follows a conversation's changing experts.
    The monitor (pyzipmoe.Llama) re-plans from the order the run's tokens route in (the recency model) once the
    runtime's routing log holds enough of them.

    Under a budget, a stored model's kept prior (pyzipmoe.plan.prior.kept_prior) becomes ZIPMOE_PRIOR, unless
    the environment already names one (the user's wins); without a budget there are no stores to seed."""
    if budget is None:
        return RuntimeSettings(RuntimeConfig(None, policy, hot_share, sm_share).to_env(), None)
    if not is_zipmoe:
        # a plain GGUF: the runtime serves its expert tensors as stored, decoded only (the shares do not apply). The
        # planner's hot slots per layer (from the trace, else uniform: no monitor re-plans a plain GGUF's run)
        need = model_memory(model, mapped=mapped)
        resolved = resolve_budget(budget, need)
        if plan is not None:
            planner.decode_plan(plan)
        elif use_planner:
            plan = plan_model(model, resolved.nbytes, trace=trace, need=need).plan.encode()
        return RuntimeSettings(_with_prior(RuntimeConfig(resolved.nbytes, policy, hot_share, sm_share,
                                                         plan=plan).to_env(), model), resolved)
    from ..file.reader import as_zipmoe

    model = as_zipmoe(model)  # parsed once for everything below
    need = model_memory(model, mapped=mapped)
    resolved = resolve_budget(budget, need)
    if plan is not None:
        planner.decode_plan(plan)  # a clear error for a malformed one, before the runtime sees it
    elif use_planner and hot_share is None and sm_share is None and trace is not None:
        # a routing profile to plan the first tokens by; else decoded experts until the run's own routing tells.
        # The policy stays the runtime's default (docs/cache-and-planner.md, "Which policy"); the recency model
        # predicts its hits as LRU's, which they follow on real routing
        plan = plan_model(model, resolved.nbytes, trace=trace, need=need).plan.encode()
    return RuntimeSettings(_with_prior(RuntimeConfig(resolved.nbytes, policy, hot_share, sm_share, plan=plan).to_env(),
                                       model), resolved)


def _with_prior(env: dict[str, str], model: ZipmoeFile | str | os.PathLike[str]) -> dict[str, str]:
    """env, plus, for a stored model: its kept prior, with what earlier runs recorded merged in (plan.prior.learn),
    as ZIPMOE_PRIOR where it has one and the user named none; and a fresh place for this run's record as
    ZIPMOE_PRIOR_RECORD unless the user set that (empty: no record)."""
    from ..plan import prior

    path = model_path_of(model)
    kept = None if PRIOR_ENV in os.environ else prior.learn(path)
    record = None if PRIOR_RECORD_ENV in os.environ else prior.record_path(path)
    extra = {PRIOR_ENV: str(kept)} if kept is not None else {}
    if record is not None:
        extra[PRIOR_RECORD_ENV] = str(record)
    return {**env, **extra}


class MemoryMonitor:
    """Re-plans a running model's tiers when the memory available to the process changes.

    Every `interval` seconds, and at once when the kernel signals memory running short (pressure.MemoryEvents), it
    reads the memory (pyzipmoe.runtime.memory.read_memory: psutil and the cgroup limit) and computes the budget the
    model could have now. For "auto" that is memory.auto_budget with what the runtime holds now, the formula of
    the load: what could still be allocated, file cache included, plus the runtime's resident bytes, less the
    margin (so less than it holds when others ate into the margin), never less than the model's minimum nor more
    than `ceiling` (the whole model); when even the minimum no longer fits, `floor` says so (_check_floor). A
    budget the user fixed (`fixed`) keeps at most the room beside it that the process had once the model ran
    (`spare`): in a container sized to the budget, the margin would otherwise take it from the tiers for good,
    though nothing else wanted the memory; the tiers shrink when that room shrinks, and, whatever the hysteresis, when the
    page cache lacks some of the model's mapped weights (`weights_short`: the process no longer fits, as after a
    long prompt's batch), by twice the lack, once until the stores are down to it. As with "auto"
    at load, the budget's reserve for one expert tensor in flight comes out of that memory, not out of the margin: it is
    not held between tokens (decoded, those experts are resident bytes). Hysteresis keeps it
    from chasing noise: it shrinks when that budget falls more than `threshold` below the current one, and grows
    only when it rises more than twice `threshold` above it. A re-plan only sets slots and their room in
    generation (a fixed split: the runtime's budgets, as at load); the stores evict at their next invocation
    (between tokens, a madvise per expert), so there is no stall beyond a token.
    """

    def __init__(self, planned: Planned, *, ceiling: int | None = None, interval: float = 0.5,
                 threshold: float = 0.05, read: Callable[[], Any] | None = None,
                 on_change: Callable[[planner.Plan | None], None] | None = None, lib: Any = None,
                 split: tuple[float | None, float | None, float] | None = None, policy: str | None = None,
                 fixed: bool = False, sizes: list[tuple[int, int, int]] | None = None, warm_fast: bool = False,
                 on_floor: Callable[[str], None] | None = None, events: bool = True) -> None:
        from . import memory

        self.planned = planned
        self.budget = planned.budget
        self.ceiling = ceiling
        self.fixed = fixed
        # the room beside a fixed budget that the monitor keeps free: the margin, or less if the process had less
        # when the model ran; set at the first reading, and again after the model's first decode (note_decode),
        # which touches the compute buffers for the first time
        self.spare: int | None = None
        # fixed budgets: bytes of the mapped weights the page cache lacked at the last reading, the held bytes
        # that the budget covers then, and the budget of a shrink made for those weights until the tiers are down
        # to it (PENDING_STEPS readings at most)
        self.weights_short = 0
        self._kept = 0
        self._calls = 0
        self._pending: tuple[int, int, int] | None = None  # (budget, readings left, invocations at the last one)
        self._rebase = threading.Event()
        self._decoded = False
        self.interval = interval
        self.threshold = threshold
        self._read = read or memory.read_memory
        self._on_change = on_change
        self._lib = lib
        self.split = split  # fixed (hot, warm, sm) shares of the tiers instead of the planner's split (hot None:
        # the runtime's default for each budget, apply_shares)
        # with a split: the model's expert tensors (store_sizes), so that a new budget is split by the runtime's
        # shares as at load (apply_shares); without them, by slots
        self.sizes = sizes
        self.warm_fast = warm_fast  # (warm_decodes_fast: for a split whose hot share is the runtime's default)
        # whether the plans it applies hold generation's room beyond their slots (apply_plan's token_room): off to
        # measure plans as planned (pyzipmoe.runtime.timing, which tools/bench/bench_planner.py compares with
        # predictions)
        self.generation_room = True
        # the run's eviction policy, whose hits the recency model predicts: the runtime read it at load (Llama sets
        # the environment only while it loads, so it passes what it asked for)
        self.policy = policy or os.environ.get(POLICY_ENV) or DEFAULT_POLICY
        # (budget, plan) of every re-plan, for reports and tests; plan None: split by the runtime's shares
        self.replans: list[tuple[int, planner.Plan | None]] = []
        # auto: the last reading, what the model could hold then (memory.model_room) and what the runtime held;
        # the floor's message once even the minimum no longer fits (_check_floor), and whom to tell
        self.last_reading: Any = None
        self.room: int | None = None
        self.resident = 0
        self.floor: str | None = None
        self._below = 0
        self._on_floor = on_floor
        # wake on the kernel's memory signals (pressure.MemoryEvents) as well as every `interval` seconds; which
        # signals it got (empty: polling only), and how many readings they started
        self.events = events
        self.signals: tuple[str, ...] = ()
        self.wakeups = 0
        self._events: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._routed_at_plan = 0.0  # tokens every layer had routed when the routing last shaped the plan

    def target_budget(self) -> int:
        """The budget the model could have now (see the class's docstring)."""
        from . import memory

        reading = self._read()
        self.last_reading = reading
        kept, transient, self._calls = _runtime_bytes(self._lib)
        self._kept = self.planned.need.other_bytes + kept
        held = self._kept + transient
        if not self.fixed:
            # auto: the formula of the load (memory.auto_budget), with what the runtime holds now; the weights
            # that are not experts are in the file cache it counts as room
            room = memory.model_room(reading, kept + transient)
            self.room = room
            self.resident = kept + transient
            target = memory.auto_budget(reading, self.ceiling, kept + transient)
            return target
        room = held + reading.headroom  # what the model could hold now
        keep = memory.safety_margin(reading)  # what stays free
        if self.fixed:
            # all the file cache counts as room, less the weights the model maps (in held, and in that cache while
            # resident): with only the inactive list's, their pages moving between the kernel's lists looked like
            # memory going and coming (a cgroup at its limit: 357 -> 213 MiB of room in a second, and a re-plan)
            cache_room = reading.headroom_with_file_cache - self.planned.need.other_bytes
            # less than nothing: the page cache lacks some of those weights, and every token reads them again (a
            # cyclic read a little larger than its cache misses on every page); step() makes room for them. Not
            # for a prompt's read buffers, which go when it ends
            self.weights_short = max(0, -(cache_room + transient))
            room = held + max(0, cache_room)
            if self.spare is None or self._rebase.is_set():
                spare = max(0, min(keep, room - self.budget))
                self.spare = spare if self.spare is None else min(self.spare, spare)
                self._rebase.clear()
            keep = self.spare
        # less than held when the margin is eaten into: the tiers give memory back
        target = room - keep
        return min(target, self.ceiling) if self.ceiling is not None else target

    def _token_room(self, budget: int) -> int:
        """What a plan's stores may hold in generation under `budget` (apply_plan's token_room)."""
        return budget - self.planned.need.other_bytes if self.generation_room else 0

    def give_generation_room(self) -> None:
        """For a plan the run loaded with (ZIPMOE_PLAN from the planner's trace): the token room every re-plan
        gets, generation's decoded experts beyond the slots."""
        lib = self._lib
        if lib is None:
            from .._native import lib
        lib.zipmoe_cache_set_token_room(self._token_room(self.budget))
        set_read_room(self.planned.plan, lib)

    def note_decode(self) -> None:
        """Called after each decode of the model (pyzipmoe.Llama): the first one makes the next reading measure
        the room beside a fixed budget again, now that llama.cpp's compute buffers are in use."""
        if not self._decoded:
            self._decoded = True
            self._rebase.set()

    def refresh_routing(self, min_tokens: int = ROUTING_MIN_TOKENS) -> planner.Plan | None:
        """Re-plans the current budget from the routing seen so far, once each layer has routed at least
        `min_tokens` tokens since the last time; the new plan, or None. A run's routing is far from the uniform or
        global profile the first plan assumed: a conversation keeps coming back to its own experts. The order
        of the last generated tokens' routing (the recency model) where there is enough of it, else the
        activation counters (the frequency model)."""
        if self.split is not None:
            return None
        g = self.planned.model.geometry
        counts = live_counts(g, self._lib)
        seen = counts[list(g.layers)].sum(axis=1) / g.n_expert_used
        if seen.size == 0 or seen.min() - self._routed_at_plan < min_tokens:
            return None
        self._routed_at_plan = float(seen.min())
        model = planner.cost_model(g, self.planned.model.costs, counts, routing=live_routing(g, self._lib),
                                   policy=self.policy)
        self.planned = Planned(self.planned.need, self.planned.budget, model,
                               planner.plan_tiers(model, self.budget - self.planned.need.minimum),
                               self.planned.costs_source)
        apply_plan(self.planned.plan, self._lib, reserve=self.planned.need.in_flight_bytes,
                   token_room=self._token_room(self.budget))
        self.replans.append((self.budget, self.planned.plan))
        if self._on_change:
            self._on_change(self.planned.plan)
        return self.planned.plan

    def step(self) -> bool:
        """One reading and, past the hysteresis, a re-plan. Whether it re-planned."""
        target = self.target_budget()
        self._check_floor()
        target = max(target, self.planned.need.minimum)
        shrink = target < self.budget * (1 - self.threshold)
        grow = target > self.budget * (1 + 2 * self.threshold)
        weights_rule = self.weights_short > 0
        if self._pending is not None:
            # a shrink for the weights that are not experts: neither that rule nor a grow until the tiers are down
            # to it (the stores evict at their next invocations; readings before that still find the weights short,
            # and acting on them shrank three and four times in a row), for PENDING_STEPS readings while the
            # model runs at most; an idle model waits as long as it is idle
            budget, left, calls = self._pending
            if self._kept > budget + budget // 100:
                left -= self._calls != calls
                self._pending = (budget, left, self._calls) if left > 0 else None
            else:
                self._pending = None
            if self._pending is not None:
                weights_rule = grow = False
        if weights_rule:
            # whatever the hysteresis: room for them, as much again (at least 1% of the budget) so that a reading
            # with them back finds room to spare. The room beside the budget went to the process itself (a long
            # prompt's compute buffers) or to others: keep none of it free any more
            short = self.weights_short
            target = max(self.planned.need.minimum, min(self._kept, self.budget) - short - max(short, self.budget // 100))
            shrink, grow = target < self.budget, False
            self.spare = 0
            if shrink:
                self._pending = (target, PENDING_STEPS, self._calls)
        if not (shrink or grow):
            return False
        tiers = target - self.planned.need.minimum
        plan: planner.Plan | None = None
        if self.split is not None and self.sizes:
            apply_shares(tiers, self.split, self.sizes, self.policy, self._lib, self.warm_fast)
        else:
            plan = planner.plan_tiers(self.planned.model, tiers, self.split)
            apply_plan(plan, self._lib, reserve=self.planned.need.in_flight_bytes, token_room=self._token_room(target))
        self.budget = target
        self.replans.append((target, plan))
        if self._on_change:
            self._on_change(plan)
        return True

    def _check_floor(self) -> None:
        """The floor, for "auto": when even the model's minimum no longer fits in what it could hold now (its
        room, margin not deducted) at FLOOR_READINGS readings in a row, the run cannot go on without the kernel
        killing it; `floor` says so in one line and `on_floor` is called (pyzipmoe.Llama then refuses its next
        decode with OutOfMemoryError, the supervisor of a llama.cpp program stops it)."""
        if self.fixed or self.floor is not None or self.room is None:
            return
        minimum = self.planned.need.minimum
        self._below = self._below + 1 if self.room < minimum else 0
        if self._below >= FLOOR_READINGS:
            mib = 1 << 20
            self.floor = (f"out of memory: the model needs at least {minimum / mib:.0f} MiB and only "
                          f"{self.room / mib:.0f} MiB is left for it (others took the rest); stopped before the "
                          "kernel's OOM killer would")
            if self._on_floor:
                self._on_floor(self.floor)

    def check_floor(self) -> None:
        """Raises OutOfMemoryError once the floor was reached (pyzipmoe.Llama calls it before each decode)."""
        if self.floor is not None:
            raise OutOfMemoryError(self.floor)

    def _run(self) -> None:
        from .pressure import MemoryEvents

        events = MemoryEvents.open(self._events_margin()) if self.events else None
        self._events = events
        self.signals = events.kinds if events is not None else ()
        try:
            while True:
                if events is not None:
                    woke = events.wait(self.interval)  # a kernel's signal, or the interval's end
                    if self._stop.is_set():
                        return
                elif self._stop.wait(self.interval):
                    return
                else:
                    woke = False
                try:
                    replanned = self.step()
                    if events is not None:
                        events.rearm(self._events_margin())
                    if woke:
                        self.wakeups += 1
                    replanned or woke or self.refresh_routing()
                except Exception as e:  # noqa: BLE001 - a monitor must not take the model down; say why it stopped
                    print(f"zipmoe: memory monitor stopped: {e}", file=sys.stderr)
                    return
                if self.floor is not None:
                    return
        finally:
            if events is not None:
                events.close()

    def _events_margin(self) -> int:
        """Where the kernel should wake the monitor: usage within the margin of the cgroup's limit."""
        from . import memory

        reading = self.last_reading
        return memory.safety_margin(reading) if reading is not None else memory.MIN_MARGIN

    def start(self) -> MemoryMonitor:
        self._thread = threading.Thread(target=self._run, name="zipmoe-memory-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._events is not None:
            self._events.interrupt()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def monitor_for(model: ZipmoeFile | str | os.PathLike[str], budget: Budget | str | int, *,
                trace: str | os.PathLike[str] | None = None, mapped: bool = True, **kwargs: Any) -> MemoryMonitor:
    """A monitor for a model loaded with `runtime_settings(model_path, budget=..., ...)`: "auto" may grow up to the
    model's size, a fixed budget is also the ceiling. budget: the Budget the model was loaded with
    (runtime_settings' budget); given as the user wrote it, it is resolved now, by the same rules (what the
    runtime holds now counts as the model's). mapped: as model_memory."""
    from ..file.reader import as_zipmoe

    model = as_zipmoe(model)  # parsed once for everything below
    need = model_memory(model, mapped=mapped)
    resolved = budget if isinstance(budget, Budget) else resolve_budget(budget, need)
    planned = plan_model(model, resolved.nbytes, trace=trace, need=need)
    if kwargs.get("split") is not None:
        kwargs.setdefault("sizes", store_sizes(model))
        kwargs.setdefault("warm_fast", warm_decodes_fast(model))
    return MemoryMonitor(planned, ceiling=need.whole if resolved.automatic else resolved.nbytes,
                         fixed=not resolved.automatic, **kwargs)
