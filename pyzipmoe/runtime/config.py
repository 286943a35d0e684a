"""The one place where user options become the runtime's configuration.

zipmoe's runtime in libllama reads its settings from ``ZIPMOE_*`` environment variables when a model loads
(ggml_zipmoe/src/op/zipmoe-llama.cpp, the reader and the codec). ``RuntimeConfig`` holds the options a user gives
(the CLI's flags, a Modelfile's parameters, ``pyzipmoe.Llama``'s arguments), checks them, and writes them as that
environment (``to_env``): for bare llama.cpp programs, and for ``Llama`` while its model loads. Every variable the
runtime reads is named here once (``RUNTIME_ENV``).

A hot share that is not given is the runtime's default, which gives way to a given sm share: that rule lives in the
native library (zipmoe_budget_default_hot_share), which the loader and the memory monitor both call.
"""

from __future__ import annotations

import functools
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import NativeLibraryError, ZipmoeError
from ..paths import llama_lib_dir
from .budget import parse_budget

BUDGET_ENV = "ZIPMOE_MEMORY_BUDGET"  # the model's budget in bytes (the runtime also reads 6GiB, 60%)
HOT_SHARE_ENV = "ZIPMOE_HOT_SHARE"  # without a plan: the tiers' share for decoded experts
SM_SHARE_ENV = "ZIPMOE_SM_SHARE"  # without a plan: the tiers' share for sign+mantissa planes
PLAN_ENV = "ZIPMOE_PLAN"  # slots per layer and tier, as `zipmoe plan` prints them
POLICY_ENV = "ZIPMOE_CACHE_POLICY"  # eviction: one of policies()
CACHE_ENV = "ZIPMOE_CACHE"  # one of CACHE_MODES; "none": decode on every use
PREFILL_ENV = "ZIPMOE_PREFILL"  # "0": leave the cache tiers empty at load
DIRECT_IO_ENV = "ZIPMOE_DIRECT_IO"  # "0": read the model file through the page cache instead of O_DIRECT
READ_BUFFER_ENV = "ZIPMOE_READ_BUFFER"  # what each of the reader's buffers keeps between uses (default 16MiB)
PREDICT_ENV = "ZIPMOE_PREDICT"  # "1": read ahead the experts the next layer's router picks on this layer's input
FUSED_ENV = "ZIPMOE_FUSED"  # "0": materialise routed experts and leave the matmul to ggml_mul_mat_id
STREAM_ENV = "ZIPMOE_STREAM"  # "0": decode a warm expert into its place before its matmul
ESC_SIMD_ENV = "ZIPMOE_ESC_SIMD"  # "0": the escape code's portable decoder even where its SIMD one runs
INTEGRITY_ENV = "ZIPMOE_INTEGRITY"  # "skip": load a file without checking its integrity record
CONTROL_ENV = "ZIPMOE_CONTROL"  # the supervisor's control file (pyzipmoe.runtime.supervise); set only by it
PRIOR_ENV = "ZIPMOE_PRIOR"  # a prior file (pyzipmoe.plan.prior): expert popularity the eviction policy starts from
PRIOR_RECORD_ENV = "ZIPMOE_PRIOR_RECORD"  # where the model's unload writes the run's expert uses ("" : nowhere)
# every variable that configures the runtime: what a benchmark or test clears to start from the defaults
RUNTIME_ENV = (CACHE_ENV, BUDGET_ENV, HOT_SHARE_ENV, SM_SHARE_ENV, PLAN_ENV, POLICY_ENV, PREFILL_ENV, DIRECT_IO_ENV,
               READ_BUFFER_ENV, PREDICT_ENV, FUSED_ENV, STREAM_ENV, ESC_SIMD_ENV, INTEGRITY_ENV, CONTROL_ENV,
               PRIOR_ENV, PRIOR_RECORD_ENV)

CACHE_MODES = ("unbounded", "none")  # "none": decode every expert on every use (measurements)

OPENMP_SPIN_ENV = "GOMP_SPINCOUNT"  # libgomp's: how long an OpenMP thread spins before it sleeps

if TYPE_CHECKING:  # read from the native library when first used (__getattr__), so that importing stays cheap
    POLICIES: tuple[str, ...]  # the runtime's eviction policies (policies())
    DEFAULT_POLICY: str  # the runtime's unless ZIPMOE_CACHE_POLICY says otherwise
    OPENMP_SPIN: tuple[str, str]  # (OPENMP_SPIN_ENV, its value: openmp_spin())


@functools.cache
def policies() -> tuple[str, ...]:
    """The runtime's eviction policies, its default first: the native library's one list (zipmoe_policy_name), which
    ZIPMOE_CACHE_POLICY and llama.cpp's --cache-policy take too. lfuda: LFU with dynamic ageing and the counts of
    evicted experts kept; tlfu: the paper's token-weighted LFU (docs/cache-and-planner.md)."""
    from .._native import ffi, lib

    names: list[str] = []
    while (name := lib.zipmoe_policy_name(len(names))) != ffi.NULL:
        names.append(ffi.string(name).decode())
    return tuple(names)


@functools.cache
def openmp_spin() -> tuple[str, str]:
    """(OPENMP_SPIN_ENV, value): how long an OpenMP thread spins before it sleeps, for zipmoe's own process and the
    llama.cpp programs it starts; the native library's value (zipmoe_openmp_spincount, which says what it was
    measured against), the one zipmoe's llama.cpp programs set themselves under a budget (executing themselves
    again, as libgomp reads it only as it loads). Setting it here spares the programs zipmoe starts that restart,
    and is the only way for this process, whose libgomp loads with libllama. A value of the user's (or an
    OMP_WAIT_POLICY) is kept."""
    from .._native import ffi, lib

    return OPENMP_SPIN_ENV, ffi.string(lib.zipmoe_openmp_spincount()).decode()


def __getattr__(name: str) -> Any:
    if name == "POLICIES":
        return policies()
    if name == "DEFAULT_POLICY":
        return policies()[0]
    if name == "OPENMP_SPIN":
        return openmp_spin()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def openmp_environment(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """env (a dict, or os.environ) with OpenMP's short spinning (openmp_spin) added, unless it already says how
    OpenMP threads wait, or no zipmoe library can be loaded (whose runtime the spinning would starve)."""
    if OPENMP_SPIN_ENV in env or "OMP_WAIT_POLICY" in env:
        return env
    try:
        name, value = openmp_spin()
    except (NativeLibraryError, AttributeError):  # (not built, or built before it had the value: nothing to spare)
        return env
    env[name] = value
    return env


def use_zipmoe_llama(env: MutableMapping[str, str] | None = None) -> None:
    """Points llama-cpp-python at zipmoe's build of libllama: sets ``LLAMA_CPP_LIB_PATH`` (and OpenMP's spinning,
    openmp_spin, which libgomp reads when libllama loads) in `env`, default ``os.environ``, so that
    ``llama_cpp.Llama`` runs zipmoe GGUFs.

    llama-cpp-python reads the variable once, when ``llama_cpp`` is first imported: once it is imported, nothing is
    changed. A value already set is kept, and nothing is set when zipmoe's libllama has not been built (a
    llama-cpp-python that bundles its own library then keeps working for plain GGUFs). ``import pyzipmoe`` calls it.
    """
    import sys

    env = os.environ if env is None else env
    if "llama_cpp" in sys.modules:
        return
    openmp_environment(env)
    if env.get("LLAMA_CPP_LIB_PATH"):
        return
    found = llama_lib_dir()
    if found is not None:
        env["LLAMA_CPP_LIB_PATH"] = str(found)


MAX_THREADS = 512
"""The most threads a llama.cpp computation takes: ggml's GGML_MAX_N_THREADS (ggml.h), the size of its per-thread
arrays; more, and ggml (and libgomp under it) writes past them. Every thread count zipmoe passes on is checked
against it (check_threads): pyzipmoe.Llama's, a Modelfile's or an imported package's num_thread."""

MAX_CONTEXT = 2**24
"""The largest context zipmoe asks of llama.cpp, in tokens: 16777216, above the longest context models are trained
for (10M tokens). llama.cpp keeps n_ctx in 32 bits, so a larger value wraps around (2**32 + 16 ran, without a word,
with a context of 256 tokens), and a context far beyond memory ends in std::bad_alloc; a context below this bound
but beyond memory still fails, with a message that says it was the context (pyzipmoe.Llama)."""


class ConfigError(ZipmoeError, ValueError):
    """A value out of range for the runtime (a ValueError, as llama-cpp-python raises for bad arguments)."""


def check_threads(name: str, value: object, *, default_ok: bool = False) -> int | None:
    """A thread count as llama.cpp may take it: a whole number from 1 to MAX_THREADS (0 or None: the default,
    where `default_ok`). One-line ConfigError otherwise."""
    if value is None and default_ok:
        return None
    n = _whole(name, value)
    if n == 0 and default_ok:
        return None
    if not 1 <= n <= MAX_THREADS:
        raise ConfigError(f"{name} {n} is out of range: threads go from 1 to {MAX_THREADS} (ggml's maximum)")
    return n


def check_context(name: str, value: object) -> int:
    """A context size in tokens as llama.cpp may take it: 0 (the model's own) to MAX_CONTEXT. One-line ConfigError
    otherwise."""
    n = _whole(name, value)
    if not 0 <= n <= MAX_CONTEXT:
        raise ConfigError(f"{name} {n} is out of range: a context goes from 1 to {MAX_CONTEXT} tokens (0: the "
                          "model's own)")
    return n


def _whole(name: str, value: object) -> int:
    import operator

    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a whole number, not {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"{name} must be a whole number, not {value!r}") from None


def check_share(name: str, share: float | None) -> None:
    if share is not None and not 0 <= share <= 1:
        raise ZipmoeError(f"{name} {share} is not a fraction between 0 and 1")


def split_shares(hot_share: float | None, sm_share: float | None) -> tuple[float | None, float | None, float]:
    """(hot, warm, sm) shares of the cache tiers from the shares a user gave: the rest of hot and sm keeps
    compressed experts. A hot share not given is None: the runtime's default for the tiers at hand, which gives
    way to the sm share (zipmoe_budget_default_hot_share, the rule's one place)."""
    sm = sm_share or 0.0
    return hot_share, (None if hot_share is None else max(0.0, 1.0 - hot_share - sm)), sm


def _flag(value: bool) -> str:
    return "1" if value else "0"


@dataclass(frozen=True)
class RuntimeConfig:
    """What a user asks of the runtime for one model; None everywhere: the runtime's defaults (or what the
    environment already says, which to_env leaves alone).

    budget: the model's memory budget, bytes or as people write it ("6GiB", "60%"; "auto" is resolved by the
        caller, which knows the model). policy: eviction, one of policies(). hot_share, sm_share: without a plan, the
        tiers' shares for decoded experts and for sign+mantissa planes. plan: slots per layer and tier, as
        `zipmoe plan` prints them. cache: one of CACHE_MODES. prefill, direct_io, predict, fused, stream: the
        runtime's switches (README). read_buffer: bytes each of the reader's buffers keeps between uses.
    """

    budget: str | int | None = None
    policy: str | None = None
    hot_share: float | None = None
    sm_share: float | None = None
    plan: str | None = None
    cache: str | None = None
    prefill: bool | None = None
    direct_io: bool | None = None
    read_buffer: str | int | None = None
    predict: bool | None = None
    fused: bool | None = None
    stream: bool | None = None

    def __post_init__(self) -> None:
        if self.policy is not None and self.policy not in policies():
            raise ZipmoeError(f"cache policy {self.policy!r} is not one of {', '.join(policies())}")
        if self.cache is not None and self.cache not in CACHE_MODES:
            raise ZipmoeError(f"cache mode must be one of {', '.join(CACHE_MODES)}, not {self.cache!r}")
        check_share("hot share", self.hot_share)
        check_share("sm share", self.sm_share)
        if (self.hot_share or 0) + (self.sm_share or 0) > 1 + 1e-9:
            raise ZipmoeError(f"hot share {self.hot_share} and sm share {self.sm_share} add up to more than 1")

    def to_env(self) -> dict[str, str]:
        """The ZIPMOE_* variables for what is set; empty for the defaults."""
        env: dict[str, str] = {}
        if self.budget is not None:
            env[BUDGET_ENV] = str(parse_budget(self.budget))
        if self.policy is not None:
            env[POLICY_ENV] = self.policy
        if self.hot_share is not None:
            env[HOT_SHARE_ENV] = repr(float(self.hot_share))
        if self.sm_share is not None:
            env[SM_SHARE_ENV] = repr(float(self.sm_share))
        if self.plan is not None:
            env[PLAN_ENV] = self.plan
        if self.cache is not None:
            env[CACHE_ENV] = self.cache
        if self.read_buffer is not None:
            env[READ_BUFFER_ENV] = str(self.read_buffer)
        for name, value in ((PREFILL_ENV, self.prefill), (DIRECT_IO_ENV, self.direct_io),
                            (PREDICT_ENV, self.predict), (FUSED_ENV, self.fused), (STREAM_ENV, self.stream)):
            if value is not None:
                env[name] = _flag(value)
        return env
