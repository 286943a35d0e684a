"""llama-cpp-python's ``Llama`` on zipmoe's build of libllama, with zipmoe's options and statistics.

    from pyzipmoe import Llama
    llm = Llama("model.zipmoe.gguf", n_ctx=2048, zipmoe_cache="unbounded")
    print(llm("Once upon a time", max_tokens=32)["choices"][0]["text"])
    print(llm.zipmoe_stats())       # experts decoded, bytes, decode time, ...

Importing ``pyzipmoe`` points llama-cpp-python at ``build/bin/libllama.so`` (``LLAMA_CPP_LIB_PATH``), so plain
``llama_cpp.Llama`` runs zipmoe GGUFs as well; this class adds:

* ``zipmoe_cache``: ``"unbounded"`` (default) keeps every decoded expert, ``"none"`` decodes an expert each time
  it is used (for measurements). The runtime reads it from the environment variable ``ZIPMOE_CACHE`` when a
  model is loaded; the constructor sets it for the duration of the load.
* clear errors: a zipmoe GGUF given to a libllama without zipmoe support, a file llama.cpp refuses (llama.cpp's
  own message is included even with ``verbose=False``), a damaged expert found while decoding (``llama_decode``
  fails; the message names tensor and expert).
* ``zipmoe_stats()``: the runtime's counters (process-wide: every zipmoe model loaded in this process).

The import of llama-cpp-python, the library check and llama.cpp's log are in libllama.py, RPC servers in rpc.py,
the routing recorder (``record_routing``) in routing_recorder.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..errors import NativeLibraryError, UnsupportedError, ZipmoeError
from ..paths import ZIPMOE_LIB_NAME, bin_dir
from .config import (CACHE_MODES, MAX_THREADS, PLAN_ENV, RuntimeConfig, check_context, check_threads,
                     split_shares)
from .libllama import (ZipmoeDecodeError, ZipmoeLoadError, error_log, library_supports_zipmoe, llama_cpp,
                       loaded_library)
from .routing_recorder import RoutingRecorder
from .rpc import add_rpc_servers


# ------------------------------------------------------------------------------------------ statistics


def _check_one_runtime() -> None:
    """Statistics come from the libggml-zipmoe that pyzipmoe opened; libllama must use the same one."""
    seen = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip().endswith("/" + ZIPMOE_LIB_NAME):
                    seen.add((fields[3], fields[4], fields[5].rstrip()))
    except OSError:  # not Linux: nothing to check
        return
    if len({(dev, inode) for dev, inode, _ in seen}) > 1:
        raise NativeLibraryError("two copies of libggml-zipmoe.so are loaded (" +
                                 ", ".join(sorted({p for _, _, p in seen})) + "): statistics would come from the "
                                 "wrong one; unset ZIPMOE_LIB or point it at the library next to libllama.so")


def zipmoe_stats(reset: bool = False) -> dict[str, float]:
    """The zipmoe runtime's counters, summed over every zipmoe model in this process: every field of the C
    struct zipmoe_stats (ggml_zipmoe/include/zipmoe.h: stores, experts_decoded, chunks_decoded, bytes_decoded,
    decode_ns, materialize_calls, ...), plus decode_seconds, and the time ledger (ggml_zipmoe/include/zipmoe-ledger.h)
    as ledger_graphs, ledger_tokens, ledger_wall_ns and its parts ledger_compute_ns, ledger_decode_ns,
    ledger_read_wait_ns, ledger_thread_wait_ns, ledger_other_ns, ledger_between_ns (pyzipmoe.runtime.ledger reads
    them per token). With reset=True the counters (not the experts kept) are zeroed after reading.
    """
    from .._native import ffi, lib

    _check_one_runtime()
    s = ffi.new("zipmoe_stats *")
    lib.zipmoe_stats_get(s)
    out: dict[str, float] = {name: int(getattr(s, name)) for name, _ in ffi.typeof("zipmoe_stats").fields}
    out["decode_seconds"] = out.get("decode_ns", 0) / 1e9
    ledger = ffi.new("zipmoe_ledger *")
    lib.zipmoe_ledger_get(ledger)
    out.update({f"ledger_{name}": int(getattr(ledger, name)) for name, _ in ffi.typeof("zipmoe_ledger").fields})
    if reset:
        lib.zipmoe_stats_reset()
    return out


def last_logits(llm: Any) -> Any:
    """The logits of the last token `llm` evaluated, as a float32 numpy array (a copy), for any llama_cpp.Llama.

    llama-cpp-python fills `scores` only with logits_all=True; without it `scores` stays zero, and a loop that
    takes argmax(scores[n_tokens - 1]) generates token 0 forever (a degenerate text whose experts repeat)."""
    import numpy as np

    ptr = llm._ctx.get_logits_ith(-1)
    if not ptr:
        raise ZipmoeError("no logits: evaluate at least one token first")
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def zipmoe_stats_reset() -> None:
    from .._native import lib

    lib.zipmoe_stats_reset()


# --------------------------------------------------------------------------------------------- Llama


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def is_zipmoe_file(path: str | os.PathLike[str]) -> bool | None:
    """True for a zipmoe GGUF, False for another GGUF, None if the header cannot be read (llama.cpp decides)."""
    from ..file.gguf import read_gguf

    try:
        return read_gguf(path).is_zipmoe
    except (ZipmoeError, OSError):
        return None


def _header_problem(path: str) -> str | None:
    """What pyzipmoe's own reader finds wrong with a file, if anything."""
    from ..file.reader import open_zipmoe
    from ..file.gguf import read_gguf

    try:
        if read_gguf(path).is_zipmoe:
            open_zipmoe(path)
    except (ZipmoeError, OSError) as e:
        return str(e)
    return None


def _check_limits(kwargs: dict[str, Any]) -> None:
    """n_ctx and the thread counts checked (config.check_context, check_threads) before llama-cpp-python stores
    them in 32-bit fields, where a larger value wraps around or overruns ggml's per-thread arrays; its default
    thread counts (half the CPUs, all of them) capped at ggml's maximum too."""
    if "n_ctx" in kwargs:
        kwargs["n_ctx"] = check_context("n_ctx", kwargs["n_ctx"])
    cpus = os.cpu_count() or 1
    for name, default in (("n_threads", max(cpus // 2, 1)), ("n_threads_batch", cpus)):
        n = check_threads(name, kwargs.get(name), default_ok=True)
        if n is not None or default > MAX_THREADS:
            kwargs[name] = n if n is not None else MAX_THREADS


class Llama(llama_cpp.Llama):  # type: ignore[misc,name-defined]
    """``llama_cpp.Llama`` that runs zipmoe GGUFs (and plain ones). Same arguments, plus:

    zipmoe_cache: "unbounded" (default) keeps decoded experts in memory; "none" decodes an expert on every
        use (slow; for measurements and tests).
    memory_budget: everything the model may keep resident ("6GiB", "60%", bytes, or "auto": what the machine or
        container has free, less a margin): its weights that are not experts, one expert tensor's experts in flight and
        the expert cache, which gets the rest. None: unbounded. Too small a budget raises ZipmoeError saying the
        minimum. The runtime's budget is per process: the last model loaded sets it.
    cache_policy: eviction under a budget: "lfuda" (default, LFU with dynamic ageing), "tlfu" (token-weighted LFU),
        "lru", "lfu" or "fifo".
    hot_share, sm_share: shares of the cache for decoded experts and sign+mantissa planes (default 0); the rest keeps
        whole compressed experts. The default hot share is the runtime's: 0 where nearly every expert fits
        compressed but not decoded and the model's escape code decodes with SIMD here, else 1.
    planner: let the planner split the cache per layer (pyzipmoe/plan/), from this machine's calibration
        (`zipmoe calibrate`) and the routing (`trace`, then the order in which the run's tokens routed). None
        (default): on under a budget without shares or a plan, once the model has a calibration measured through
        the engine; else the cache keeps decoded experts (docs/cache-and-planner.md). A plain GGUF under a budget
        (its experts stored raw: hot or read from the file) gets the planner's hot slots per layer at load, from
        `trace` (on when a trace is given) or uniform routing; nothing re-plans it while it runs.
    trace: activation counts for the planner (.npz with "counts" [prompts, layers, experts]); default uniform.
    plan: slots per tier per layer, as `zipmoe plan` prints them ("0:12,4,0;1:..."), instead of planning.
    adapt: re-plan while running (pyzipmoe.runtime.controller.MemoryMonitor): when the memory available changes ("auto"
        grows up to the model's size, a fixed budget is a ceiling), and from the routing the run has seen. Default:
        on whenever the planner splits the budget.
    prefill: fill the cache at load, on every core, so that the first tokens find their experts decoded (as
        llama.cpp's read-ahead fills the page cache for a plain model). None (default): as ZIPMOE_PREFILL says
        (on unless "0").
    rpc_servers: ggml-rpc-server endpoints, "host:port,host:port" or a list (llama.cpp's --rpc): their devices join
        this process (for every model it loads from then on, as --rpc does) and the model's layers are split across
        them by tensor_split (default: by their free memory); n_gpu_layers defaults to all layers then. A zipmoe
        model's experts run on a server started with --zipmoe-model and a copy of the file, under its own budget;
        on a stock server they stay in this process and run on its CPU under its budget (docs/rpc.md). An endpoint
        that does not answer, or a zipmoe server of another file, raises ZipmoeLoadError before anything is
        uploaded.
    n_ctx, n_threads, n_threads_batch (llama_cpp.Llama's): checked before they reach llama.cpp's 32-bit fields, a
        context from 0 (the model's) to config.MAX_CONTEXT tokens, threads from 1 to config.MAX_THREADS (ggml's
        maximum; None or 0: llama-cpp-python's default, at most that); a ValueError (ZipmoeError) says which.
    record_routing: keep the experts every step routed to, per MoE layer (one step a generated token, or a prompt's
        batch of n_ubatch tokens), for `recorded_routing()` / `save_routing(path)`: a recorded-routing file that
        `zipmoe plan --trace` and tools/bench/bench_replay.py read (docs/FORMAT.md). Default off.
    """

    def __init__(self, model_path: str, *args: Any, zipmoe_cache: str = "unbounded",
                 memory_budget: str | int | None = None, cache_policy: str | None = None,
                 hot_share: float | None = None, sm_share: float | None = None, trace: str | None = None,
                 plan: str | None = None, planner: bool | None = None, adapt: bool | None = None,
                 prefill: bool | None = None, record_routing: bool = False,
                 rpc_servers: str | Sequence[str] | None = None, **kwargs: Any) -> None:
        self._stack = contextlib.ExitStack()  # llama_cpp.Llama.__del__ closes it, also after a failed __init__
        self.zipmoe_monitor = None
        _check_limits(kwargs)
        if rpc_servers:
            add_rpc_servers(rpc_servers)
            kwargs.setdefault("n_gpu_layers", -1)  # (llama-cpp-python's default, 0, would leave them unused)
        if zipmoe_cache not in CACHE_MODES:
            raise ValueError(f"zipmoe_cache must be one of {', '.join(CACHE_MODES)}, not {zipmoe_cache!r}")
        self.zipmoe_cache = zipmoe_cache
        model_path = os.fspath(model_path)
        self.is_zipmoe = bool(is_zipmoe_file(model_path))
        if self.is_zipmoe and not library_supports_zipmoe():
            raise UnsupportedError(
                f"{model_path} is a zipmoe GGUF, but the libllama in use ({loaded_library()}) was not built with "
                f"zipmoe; build it with `bash tools/setup.sh` and make sure LLAMA_CPP_LIB_PATH is unset or points "
                f"at {bin_dir()} before llama_cpp is first imported (import pyzipmoe first)")
        from .controller import monitor_for, planner_by_default, runtime_settings

        # a plain GGUF under a budget: the runtime serves its expert tensors from the cache, as stored
        self.zipmoe_served = self.is_zipmoe
        if not self.is_zipmoe and memory_budget is not None:
            self.zipmoe_served = self._check_plain_budget(model_path, planner, trace, adapt)

        # the file's structure, parsed once for the budget, the planner and the monitor (the loader parses it again)
        model: Any = model_path
        if self.is_zipmoe and memory_budget is not None:
            from ..file.reader import open_zipmoe

            model = open_zipmoe(model_path)
        if planner is None and self.zipmoe_served and not self.is_zipmoe:
            planner = trace is not None  # a plain GGUF plans its hot slots from a trace given (nothing re-plans it)
        if planner is None:
            planner = planner_by_default(model_path, budget=memory_budget, hot_share=hot_share, sm_share=sm_share,
                                         plan=plan, is_zipmoe=self.is_zipmoe)
        # llama-cpp-python maps the file unless told otherwise (or given a LoRA): the runtime's accounting differs
        mapped = kwargs.get("use_mmap", True) and not kwargs.get("use_mlock", False) and not kwargs.get("lora_path")
        settings = runtime_settings(model, budget=memory_budget, policy=cache_policy, hot_share=hot_share,
                                    sm_share=sm_share, trace=trace, is_zipmoe=self.is_zipmoe, plan=plan,
                                    use_planner=planner, mapped=mapped)
        budget, cache_env = settings.budget, settings.env
        cache_env.update(RuntimeConfig(cache=zipmoe_cache, prefill=prefill).to_env())
        mark = error_log.mark()
        try:
            with contextlib.ExitStack() as env:  # what is not given stays as the environment says
                for name, value in cache_env.items():
                    env.enter_context(_env(name, value))
                super().__init__(model_path, *args, **kwargs)
        except ValueError as e:
            if "does not exist" in str(e):
                raise
            raise self._load_error(model_path, e, error_log.since(mark), kwargs.get("n_ctx", 512)) from e
        before_decode, after_decode, counted = self._wrap_decode(model_path)
        self._recorder: RoutingRecorder | None = None
        if record_routing:
            if not self.is_zipmoe:
                raise ValueError(f"record_routing needs a zipmoe GGUF; {model_path} is not one")
            self._recorder = RoutingRecorder(model_path, self.context_params.n_ubatch)
            counted.append(self._recorder.note_decode)
        if not self.is_zipmoe and self.zipmoe_served and planner and plan is None and budget is not None:
            self._give_generation_room(model_path, budget.nbytes, mapped)
        if adapt is None:
            adapt = memory_budget is not None
        if adapt and self.is_zipmoe and budget is not None and plan is None:  # (not for a plain GGUF yet)
            use_planner = planner and hot_share is None and sm_share is None
            # no shares given: the runtime's default hot share, for whatever budget the monitor sets (apply_shares)
            split = None if use_planner else split_shares(hot_share, sm_share)
            self.zipmoe_monitor = monitor_for(model, budget, trace=trace, split=split, policy=cache_policy,
                                              mapped=mapped)
            if PLAN_ENV in cache_env:  # the planner's first plan, from the trace
                self.zipmoe_monitor.give_generation_room()
            self.zipmoe_monitor.start()
            self._stack.callback(self.zipmoe_monitor.stop)
            after_decode.append(self.zipmoe_monitor.note_decode)
            # the floor: once even the minimum no longer fits, the next decode stops the run with one line
            before_decode.append(self.zipmoe_monitor.check_floor)

    @staticmethod
    def _give_generation_room(path: str, budget: int, mapped: bool) -> None:
        """A plain GGUF's planned slots get generation's room beyond them, as a zipmoe model's monitor gives a
        planned run (controller.MemoryMonitor.give_generation_room): a token's misses need neither the allowance
        for the tensor in flight nor a prompt's read buffers, which then hold decoded experts too."""
        from .._native import lib
        from .budget import model_memory

        lib.zipmoe_cache_set_token_room(budget - model_memory(path, mapped=mapped).other_bytes)

    @staticmethod
    def _check_plain_budget(path: str, planner: bool | None, trace: str | None, adapt: bool | None) -> bool:
        """Whether the runtime serves a plain GGUF's experts under its budget (it has some): what it cannot do for
        one is refused here, never ignored."""
        from .budget import plain_experts

        try:
            experts = plain_experts(path)
        except (ZipmoeError, OSError):
            return False  # (llama.cpp says what is wrong with it)
        if not experts:
            return False  # a model without experts: the runtime warns that the budget does not apply
        if not library_supports_zipmoe():
            raise UnsupportedError(
                f"a memory budget on {path} needs zipmoe's libllama, and the one in use ({loaded_library()}) was not "
                f"built with zipmoe; build it with `bash tools/setup.sh`, or load the model without a budget")
        if adapt:
            raise UnsupportedError(
                f"{path} is a plain GGUF: under a memory budget its experts are served as stored, with the budget "
                f"fixed for the run; adaptation (re-planning while running) needs a zipmoe GGUF (`zipmoe convert`)")
        if trace is not None and planner is False:
            raise UnsupportedError(f"a routing trace is what the planner plans from: {path} was given one with "
                                   "planner=False")
        return True

    def _load_error(self, path: str, e: Exception, logged: str, n_ctx: int) -> ZipmoeLoadError:
        if "llama_context" in str(e):  # the model loaded; its context (n_ctx's KV cache, buffers) did not
            size = f"{n_ctx} tokens" if n_ctx else "the model's length"
            return ZipmoeLoadError(f"{path}: llama.cpp could not make a context of {size}"
                                   + (f" ({logged})" if logged else "") + "; a smaller n_ctx needs less memory")
        what = f"{path}: llama.cpp could not load the model"
        if logged:
            what += f" ({logged})"
        problem = _header_problem(path)
        if problem:
            what += f"; zipmoe's reader says: {problem}"
        elif self.is_zipmoe:
            what += "; check the file with `zipmoe verify`"
        return ZipmoeLoadError(what)

    def _wrap_decode(self, path: str) -> tuple[list[Callable[[], None]], list[Callable[[], None]],
                                                list[Callable[[int], None]]]:
        """Turn llama-cpp-python's bare "llama_decode returned N" into a message that says what failed.

        Wraps the context's decode (used by eval, generation and embeddings) on this instance only; the
        closure holds no reference to self, so no reference cycle keeps the model alive. Returns the lists of
        what to call before each decode (the memory monitor's check_floor, which may raise) and after each decode
        that succeeded (its note_decode), empty until filled; and what to call with the batch's tokens after each
        decode that succeeded (the routing recorder's note_decode).
        """
        ctx = self._ctx
        decode = ctx.decode
        before: list[Callable[[], None]] = []
        after: list[Callable[[], None]] = []
        counted: list[Callable[[int], None]] = []

        def checked_decode(batch: Any) -> None:
            for call in before:
                call()
            mark = error_log.mark()
            try:
                decode(batch)
            except RuntimeError as e:
                details = [m for m in (error_log.since(mark),) if m]  # libllama logged the zipmoe error
                if not details:
                    raise
                raise ZipmoeDecodeError(f"{path}: {e}: {'; '.join(details)}") from e
            for call in after:
                call()
            for count in counted:
                count(batch.n_tokens())

        ctx.decode = checked_decode
        return before, after, counted

    def zipmoe_stats(self, reset: bool = False) -> dict[str, float]:
        """The runtime's counters (process-wide); see pyzipmoe.runtime.llama.zipmoe_stats."""
        return zipmoe_stats(reset)

    def recorded_routing(self) -> Any:
        """The routing of every step since load (pyzipmoe.plan.trace.Routing); needs record_routing=True."""
        if self._recorder is None:
            raise ValueError("this model was loaded without record_routing=True")
        return self._recorder.routing()

    def save_routing(self, path: str | os.PathLike[str]) -> None:
        """Writes recorded_routing() to `path` (an .npz, atomically)."""
        from ..plan import trace

        trace.save(path, self.recorded_routing())


__all__ = ["CACHE_MODES", "Llama", "ZipmoeDecodeError", "ZipmoeLoadError", "is_zipmoe_file", "library_supports_zipmoe",
           "loaded_library", "zipmoe_stats", "zipmoe_stats_reset"]


if __name__ == "__main__":  # pragma: no cover - a quick look: python -m pyzipmoe.runtime.llama MODEL [PROMPT]
    llm = Llama(sys.argv[1], verbose=False)
    print(llm(sys.argv[2] if len(sys.argv) > 2 else "hello", max_tokens=16, temperature=0)["choices"][0]["text"])
    print(llm.zipmoe_stats())
