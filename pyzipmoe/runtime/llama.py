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
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import socket
import struct
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import NativeLibraryError, UnsupportedError, ZipmoeError
from ..paths import ZIPMOE_LIB_NAME, bin_dir, llama_lib_dir
from .config import (BUDGET_ENV, CACHE_MODES, MAX_THREADS, PLAN_ENV, RuntimeConfig, check_context, check_threads,
                     split_shares, use_zipmoe_llama)


class ZipmoeLoadError(ZipmoeError, ValueError):
    """A model could not be loaded (llama-cpp-python raises ValueError there, so this is one too)."""


class ZipmoeDecodeError(ZipmoeError, RuntimeError):
    """llama_decode failed on a zipmoe model, typically a damaged expert (llama-cpp-python raises RuntimeError)."""


def _import_llama_cpp() -> Any:
    use_zipmoe_llama()
    try:
        import llama_cpp
    except ModuleNotFoundError as e:
        if e.name != "llama_cpp":
            raise
        raise NativeLibraryError("llama-cpp-python is not installed; `bash tools/setup.sh` installs it "
                                 "(its Python part, which runs zipmoe's libllama)") from None
    except (FileNotFoundError, OSError, RuntimeError) as e:  # libllama missing or not loadable
        where = os.environ.get("LLAMA_CPP_LIB_PATH") or "llama_cpp/lib"
        raise NativeLibraryError(f"llama-cpp-python cannot load libllama from {where} ({e}); build zipmoe's "
                                 f"llama.cpp with `bash tools/setup.sh` (it goes to {bin_dir()}) or "
                                 "point LLAMA_CPP_LIB_PATH at it") from None
    return llama_cpp


llama_cpp = _import_llama_cpp()


# ------------------------------------------------------------------------------------------ the library


def loaded_library() -> Path:
    """The libllama that llama-cpp-python opened in this process."""
    return Path(llama_cpp.llama_cpp._lib._name).resolve()


def _elf_needed(path: Path) -> list[str]:
    """DT_NEEDED entries of a 64-bit little-endian ELF shared library ([] if it is something else)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed = []
    for _name, sh_type, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if sh_type != 6 or not entsize:  # SHT_DYNAMIC
            continue
        strtab = sections[link][4]
        for pos in range(offset, offset + size, entsize):
            tag, val = struct.unpack_from("<qQ", data, pos)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strtab + val)
                needed.append(data[strtab + val:end].decode())
    return needed


def library_supports_zipmoe(path: Path | None = None) -> bool:
    """Whether a libllama (default: the loaded one) is zipmoe's build: it links libggml-zipmoe, or it is the
    library of this checkout's build."""
    path = Path(path).resolve() if path is not None else loaded_library()
    ours = llama_lib_dir()
    if ours is not None and path.parent == ours.resolve():
        return True
    try:
        return ZIPMOE_LIB_NAME in _elf_needed(path)
    except (OSError, ValueError, struct.error, IndexError):
        return False


# ------------------------------------------------------------------------------------------ RPC servers

RPC_CONNECT_TIMEOUT = 10.0  # seconds for an endpoint to accept a connection before it counts as not answering
_rpc_added: set[str] = set()


def rpc_endpoints(servers: str | Sequence[str]) -> list[str]:
    """ "host:port,host:port" (or a list of such) as a list of endpoints; a malformed one raises ZipmoeLoadError."""
    items = servers.split(",") if isinstance(servers, str) else list(servers)
    endpoints = [e.strip() for e in items if e.strip()]
    if not endpoints:
        raise ZipmoeLoadError("rpc_servers names no server (host:port,...)")
    for e in endpoints:
        host, _, port = e.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ZipmoeLoadError(f"RPC server {e!r} is not host:port")
    return endpoints


def add_rpc_servers(servers: str | Sequence[str]) -> list[str]:
    """Adds the devices of ggml-rpc-server endpoints to this process's ggml (what llama.cpp's --rpc does), once
    per endpoint; each must accept a connection first (ggml-rpc ends the process when it cannot connect)."""
    endpoints = rpc_endpoints(servers)
    for e in endpoints:
        host, _, port = e.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=RPC_CONNECT_TIMEOUT).close()
        except OSError as err:
            raise ZipmoeLoadError(f"cannot connect to the RPC server {e} ({err.strerror or err}); start "
                                  "ggml-rpc-server there (docs/rpc.md)") from None
    ggml = ctypes.CDLL(str(loaded_library().parent / "libggml.so"))
    ggml.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    reg = ggml.ggml_backend_reg_by_name(b"RPC")
    add = ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server") if reg else None
    if not add:
        raise UnsupportedError(f"the libllama in use ({loaded_library()}) was built without the RPC backend; "
                               "build it with `bash tools/setup.sh`")
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(add)
    for e in endpoints:
        if e not in _rpc_added:
            ggml.ggml_backend_register(add_server(e.encode()))
            _rpc_added.add(e)
    return endpoints


# -------------------------------------------------------------------------------- llama.cpp's error log


class _ErrorLog:
    """llama.cpp's log callback: prints as llama-cpp-python means to, and remembers recent error messages.

    llama-cpp-python 0.3.36's own callback maps an older ggml enum, so with verbose=False it prints llama.cpp's
    warnings and hides its errors; this one maps this llama.cpp's levels (ggml.h: NONE 0, DEBUG 1, INFO 2, WARN 3,
    ERROR 4, CONT 5), still honouring llama-cpp-python's verbose switch (its logger's level). Errors are also
    kept, so that exceptions can say what llama.cpp said. `quiet` stops all printing (the zipmoe command, whose
    errors are one line).
    """

    GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT = 4, 5
    LEVELS = (logging.CRITICAL, logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR)  # by ggml level

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lines: deque[tuple[int, str]] = deque(maxlen=64)  # (serial number, text)
        self.serial = 0
        self.last_level = 0
        self.quiet = False
        self.logger = logging.getLogger("llama-cpp-python")  # set_verbose() sets its level
        self.callback = llama_cpp.llama_log_callback(self._log)  # kept alive by self
        llama_cpp.llama_log_set(self.callback, ctypes.c_void_p(0))

    def _log(self, level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        if level != self.GGML_LOG_LEVEL_CONT:
            self.last_level = level
        msg = text.decode("utf-8", "replace")
        if self.last_level == self.GGML_LOG_LEVEL_ERROR:
            with self.lock:
                self.serial += 1
                self.lines.append((self.serial, msg))
        if not self.quiet and self.logger.level <= (self.LEVELS[self.last_level] if 0 <= self.last_level < 5
                                                            else logging.DEBUG):
            print(msg, end="", flush=True, file=sys.stderr)

    def mark(self) -> int:
        with self.lock:
            return self.serial

    def since(self, mark: int) -> str:
        """The error text logged after mark(), on one line."""
        with self.lock:
            text = "".join(t for serial, t in self.lines if serial > mark)
        return " ".join(text.split())


_error_log = _ErrorLog()


def quiet_llama_log(quiet: bool = True) -> None:
    """Stop (or resume) printing llama.cpp's log; errors still reach the exceptions' messages."""
    _error_log.quiet = quiet


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
        model's experts stay in this process and run on its CPU under its budget (docs/rpc.md). An endpoint that
        does not answer raises ZipmoeLoadError before anything is loaded.
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
        from .controller import monitor_for, planner_by_default, runtime_environment

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
        cache_env = runtime_environment(model, budget=memory_budget, policy=cache_policy, hot_share=hot_share,
                                        sm_share=sm_share, trace=trace, is_zipmoe=self.is_zipmoe, plan=plan,
                                        use_planner=planner, mapped=mapped)
        cache_env.update(RuntimeConfig(cache=zipmoe_cache, prefill=prefill).to_env())
        mark = _error_log.mark()
        try:
            with contextlib.ExitStack() as env:  # what is not given stays as the environment says
                for name, value in cache_env.items():
                    env.enter_context(_env(name, value))
                super().__init__(model_path, *args, **kwargs)
        except ValueError as e:
            if "does not exist" in str(e):
                raise
            raise self._load_error(model_path, e, _error_log.since(mark), kwargs.get("n_ctx", 512)) from e
        before_decode, after_decode, counted = self._wrap_decode(model_path)
        self._recorder: RoutingRecorder | None = None
        if record_routing:
            if not self.is_zipmoe:
                raise ValueError(f"record_routing needs a zipmoe GGUF; {model_path} is not one")
            self._recorder = RoutingRecorder(model_path, self.context_params.n_ubatch)
            counted.append(self._recorder.note_decode)
        if not self.is_zipmoe and self.zipmoe_served and planner and plan is None:
            self._give_generation_room(model_path, int(cache_env[BUDGET_ENV]), mapped)
        if adapt is None:
            adapt = memory_budget is not None
        if adapt and self.is_zipmoe and memory_budget is not None and plan is None:  # (not for a plain GGUF yet)
            use_planner = planner and hot_share is None and sm_share is None
            # no shares given: the runtime's default hot share, for whatever budget the monitor sets (apply_shares)
            split = None if use_planner else split_shares(hot_share, sm_share)
            loaded = int(cache_env[BUDGET_ENV]) if BUDGET_ENV in cache_env else None
            self.zipmoe_monitor = monitor_for(model, memory_budget, trace=trace, split=split,
                                              policy=cache_policy, mapped=mapped, loaded=loaded)
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
            mark = _error_log.mark()
            try:
                decode(batch)
            except RuntimeError as e:
                details = [m for m in (_error_log.since(mark),) if m]  # libllama logged the zipmoe error
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


class RoutingRecorder:
    """Collects the runtime's routing log (zipmoe_cache_routing) of every MoE block after each decode: the log keeps
    the last 512 invocations of a store, one per ubatch (a graph computed), so each decode's entries are read before
    the next can push them out. How many a block logged comes from its activation counters (rows routed): llama.cpp
    computes the last block only for the rows whose logits are wanted (a prompt's last token), so a prompt's other
    ubatches route nothing there, and their steps record no expert in that block."""

    def __init__(self, model_path: str, n_ubatch: int) -> None:
        from ..plan.inputs import geometry_from_gguf

        g = geometry_from_gguf(model_path)
        self.layers, self.n_expert, self.k = g.layers, g.n_expert, g.n_expert_used
        self.n_ubatch = max(1, int(n_ubatch))
        self.words = (self.n_expert + 63) // 64
        self.steps: list[np.ndarray] = []  # bool [n_layer, n_expert] each
        self.tokens: list[int] = []
        self.rows = [self._activations(layer).sum() for layer in self.layers]

    def _activations(self, layer: int) -> np.ndarray:
        from .._native import ffi, lib

        buf = np.zeros(self.n_expert, np.uint64)
        lib.zipmoe_cache_activations(f"blk.{layer}.".encode(), ffi.cast("uint64_t *", ffi.from_buffer(buf)),
                                     self.n_expert)
        return buf

    def note_decode(self, n_tokens: int) -> None:
        from .._native import ffi, lib

        sizes = [min(self.n_ubatch, n_tokens - i) for i in range(0, n_tokens, self.n_ubatch)]
        if not sizes:
            return
        n = len(sizes)
        masks = np.zeros(n * self.words, np.uint64)
        step = np.zeros((n, len(self.layers), self.n_expert), bool)
        for i, layer in enumerate(self.layers):
            total = int(self._activations(layer).sum())
            rows, self.rows[i] = (total - int(self.rows[i])) // self.k, total
            # the ubatches holding the decode's last `rows` tokens (all of them, or those whose logits are wanted)
            first = n_tokens - min(rows, n_tokens)
            logged = n - first // self.n_ubatch if rows else 0
            if logged == 0:
                continue
            got = lib.zipmoe_cache_routing(f"blk.{layer}.".encode(), ffi.cast("uint64_t *", ffi.from_buffer(masks)),
                                           self.words, logged)
            if got != logged:
                raise ZipmoeError(f"routing recorder: block {layer} logged {got} step(s) of a decode of {n_tokens} "
                                  f"token(s) ({logged} expected)")
            bits = np.unpackbits(masks[: logged * self.words].view(np.uint8), bitorder="little")
            step[n - logged:, i] = bits.reshape(logged, self.words * 64)[:, : self.n_expert].astype(bool)
        self.steps.extend(step)
        self.tokens.extend(sizes)

    def routing(self) -> Any:
        from ..plan import trace

        routed = np.stack(self.steps) if self.steps else np.zeros((0, len(self.layers), self.n_expert), bool)
        return trace.Routing(routed=routed, layers=np.asarray(self.layers, np.int32),
                             tokens=np.asarray(self.tokens, np.int32), k=self.k)


__all__ = ["CACHE_MODES", "Llama", "ZipmoeDecodeError", "ZipmoeLoadError", "is_zipmoe_file", "library_supports_zipmoe",
           "loaded_library", "quiet_llama_log", "zipmoe_stats", "zipmoe_stats_reset"]


if __name__ == "__main__":  # pragma: no cover - a quick look: python -m pyzipmoe.runtime.llama MODEL [PROMPT]
    llm = Llama(sys.argv[1], verbose=False)
    print(llm(sys.argv[2] if len(sys.argv) > 2 else "hello", max_tokens=16, temperature=0)["choices"][0]["text"])
    print(llm.zipmoe_stats())
