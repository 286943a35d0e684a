"""Running zipmoe's llama.cpp programs (build/bin: llama-cli, llama-server, llama-bench, ...) and one-shot completions.

Used by `zipmoe run`, `zipmoe serve` and `zipmoe bench`. Programs run with zipmoe's build directory on
LD_LIBRARY_PATH (their RUNPATH already points there; this is for copies that were moved) and, where asked,
ZIPMOE_CACHE set for the runtime. Expected failures are ZipmoeErrors with one-line messages.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..errors import NativeLibraryError, ZipmoeError
from ..paths import bin_dir
from .completion import is_chat_turn
from .config import RuntimeConfig, openmp_environment

DEFAULT_CONTEXT = 4096  # tokens of a completion's context (at most the model's) where none is given (Ollama's)
PROGRAMS = ("llama-cli", "llama-completion", "llama-server", "llama-bench", "llama-simple")


class ProgramError(ZipmoeError):
    """A llama.cpp program failed; the message carries its last error line."""


def program(name: str) -> Path:
    """The path of one of zipmoe's llama.cpp programs; a one-line error if it was not built."""
    path = bin_dir() / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise NativeLibraryError(f"{name} not found in {bin_dir()}; build zipmoe's llama.cpp with "
                                 "`bash tools/setup.sh` (or set ZIPMOE_BUILD_DIR to the build directory)")
    return path


def library_path(first: str | os.PathLike[str], env: Mapping[str, str]) -> str:
    """env's LD_LIBRARY_PATH with `first` in front (once, empty entries dropped): a program started with it loads
    the libraries of the build in `first` (zipmoe's, stock's, an older one) before any other."""
    parts = [str(first)] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(parts))


def environment(cache: str | None = None, base: Mapping[str, str] | None = None, *,
                memory_budget: str | None = None, policy: str | None = None) -> dict[str, str]:
    """The environment for a program: zipmoe's bin directory first on LD_LIBRARY_PATH, OpenMP's spinning
    (OPENMP_SPIN, unless base sets it), and the runtime's configuration: ZIPMOE_CACHE, the memory budget and the
    cache policy if given."""
    env = dict(os.environ if base is None else base)
    openmp_environment(env)
    config = RuntimeConfig(budget=memory_budget, policy=policy, cache=cache)
    env["LD_LIBRARY_PATH"] = library_path(bin_dir(), env)
    env.update(config.to_env())
    return env


def check_model(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if not p.exists():
        raise ZipmoeError(f"{p}: no such file")
    if not p.is_file():
        raise ZipmoeError(f"{p}: not a file")
    return p


def run_foreground(argv: Sequence[str], env: Mapping[str, str],
                   on_start: Callable[[subprocess.Popen[Any]], None] | None = None) -> int:
    """Runs a program attached to this terminal and returns its exit status (128 + N if killed by signal N).

    Ctrl+C reaches the program through the terminal (it is in our process group), so the program decides
    what it means (llama-cli: stop generating, then exit); here it is only waited for. SIGTERM and SIGHUP
    sent to zipmoe are passed on. on_start: called with the program once it runs (the memory supervisor,
    pyzipmoe.runtime.supervise).
    """
    from .lifetime import die_with_parent

    try:  # the program dies with this process (kill -9 included): none keeps serving unsupervised
        proc = subprocess.Popen(list(argv), env=dict(env), preexec_fn=die_with_parent())
    except OSError as e:
        raise ZipmoeError(f"cannot start {argv[0]}: {e.strerror or e}") from None
    if on_start is not None:
        on_start(proc)
    forwarded = (signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, lambda signum, _frame: proc.send_signal(signum)) for s in forwarded}
    previous_int = signal.signal(signal.SIGINT, lambda signum, _frame: None)
    try:
        rc = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.signal(signal.SIGINT, previous_int)
    return 128 - rc if rc < 0 else rc


def stop_group(proc: subprocess.Popen[Any], grace: float = 10.0) -> None:
    """Stops a program started in a session of its own (start_new_session=True) and all it started: SIGTERM, up to
    `grace` seconds to exit (llama-server finishes its requests), then SIGKILL to the whole group; reaped."""
    if grace > 0 and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def _last_error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "error" in ln.lower() or "failed" in ln.lower():
            return ln
    return lines[-1] if lines else "no error message"


# ------------------------------------------------------------------------------------------ llama-bench


@dataclass(frozen=True)
class BenchResult:
    model: str
    test: str  # pp512, tg128, pp512+tg128
    n_prompt: int
    n_gen: int
    n_threads: int
    n_batch: int
    n_ubatch: int
    tokens_per_second: float
    stddev: float
    samples: tuple[float, ...]
    model_size: int
    model_n_params: int

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "test": self.test, "n_prompt": self.n_prompt, "n_gen": self.n_gen,
                "n_threads": self.n_threads, "n_batch": self.n_batch, "n_ubatch": self.n_ubatch,
                "tokens_per_second": self.tokens_per_second, "stddev": self.stddev,
                "samples": list(self.samples), "model_size": self.model_size, "model_n_params": self.model_n_params}


def _test_name(n_prompt: int, n_gen: int) -> str:
    if n_prompt and n_gen:
        return f"pp{n_prompt}+tg{n_gen}"
    return f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"


def llama_bench(models: Sequence[str | os.PathLike[str]], args: Sequence[str], *, cache: str | None = None,
                timeout: float | None = None) -> tuple[list[BenchResult], list[dict[str, Any]]]:
    """Runs llama-bench -o json on models with extra args; returns the results and llama-bench's raw records."""
    argv = [str(program("llama-bench"))]
    for m in models:
        argv += ["-m", str(check_model(m))]
    argv += [*args, "-o", "json"]
    try:
        done = subprocess.run(argv, env=environment(cache), capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        raise ProgramError(f"llama-bench did not finish within {timeout:.0f} s") from None
    if done.returncode != 0:
        raise ProgramError(f"llama-bench failed (exit status {done.returncode}): {_last_error_line(done.stderr)}")
    try:
        records = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise ProgramError("llama-bench printed no JSON results: " + _last_error_line(done.stderr)) from None
    results = [BenchResult(model=r["model_filename"], test=_test_name(r["n_prompt"], r["n_gen"]),
                           n_prompt=r["n_prompt"], n_gen=r["n_gen"], n_threads=r["n_threads"],
                           n_batch=r["n_batch"], n_ubatch=r["n_ubatch"],
                           tokens_per_second=float(r["avg_ts"]), stddev=float(r["stddev_ts"]),
                           samples=tuple(float(x) for x in r.get("samples_ts", [])), model_size=r["model_size"],
                           model_n_params=r["model_n_params"]) for r in records]
    return results, records


# ------------------------------------------------------------------------------------ one-shot completion


@dataclass(frozen=True)
class Completion:
    text: str
    prompt_tokens: int
    generated_tokens: int
    load_seconds: float
    seconds: float  # prompt processing and generation
    stats: dict[str, float] | None  # zipmoe runtime counters (None for a plain GGUF without a budget)


def _context_length(model: Path) -> int | None:
    from ..file.gguf import read_gguf

    try:
        g = read_gguf(model)
        arch = g.kv["general.architecture"].value
        return int(g.kv[f"{arch}.context_length"].value)
    except (ZipmoeError, OSError, KeyError, TypeError, ValueError):
        return None


def _prepare(llm: Any, n_ctx: int, package: Any, counts: _Tokens, *, dry: bool, what: str | None = None) -> None:
    """Makes llm run as the package says (its SYSTEM and MESSAGE in front of a chat turn, its TEMPLATE formatting
    it, its sampling parameters such as stop the defaults of either kind of completion) and check the prompt as
    sent against the context (_within_context; `what` names the prompt in its message). Once per instance."""
    import inspect

    signature = inspect.signature(llm.create_completion)  # llama-cpp-python's, before any wrapper
    if package is not None:
        from .completion import apply_package

        apply_package(llm, package)  # (it reads the signature of what it wraps: llama-cpp-python's)
    _within_context(llm, n_ctx, package, counts, signature, dry=dry, what=what)


def _stream(llm: Any, prompt: str, package: Any, **kw: Any) -> Any:
    """(text, is the last chunk) of a raw completion, or of a chat turn where the package gives one its roles (llm
    prepared by _prepare)."""
    if not is_chat_turn(package):
        for chunk in llm.create_completion(prompt, stream=True, **kw):
            yield chunk["choices"][0]["text"], chunk["choices"][0]["finish_reason"] is not None
        return
    for chunk in llm.create_chat_completion([{"role": "user", "content": prompt}], stream=True, **kw):
        choice = chunk["choices"][0]
        yield choice["delta"].get("content") or "", choice["finish_reason"] is not None


class _Counted(Exception):
    """What stops a dry run of the prompt (prompt_tokens) once its tokens are known."""


@dataclass
class _Tokens:
    """The tokens of a completion as sent and generated (what --stats prints)."""

    prompt: int = 0
    generated: int = 0


def _within_context(llm: Any, n_ctx: int, package: Any, counts: _Tokens, signature: Any, *, dry: bool,
                    what: str | None = None) -> None:
    """Makes llm's completions (the raw one, and the one a chat turn ends in, with the template, SYSTEM and MESSAGE
    applied) check the prompt as it is sent: more tokens than the context holds is a ZipmoeError; generation stops
    where the context ends; `counts` gets the prompt's tokens and each token sampled. dry: stop (_Counted) once
    the prompt is counted. signature: llama-cpp-python's create_completion's, which the call is bound to.

    The context is the one asked for, n_ctx: llama.cpp pads its own to a multiple of 256, and llama-cpp-python
    allows generating into that padding but keeps the tokens in an array of n_ctx (a ValueError "could not
    broadcast" where they run past it)."""
    from llama_cpp import StoppingCriteriaList

    complete = llm.create_completion

    def count(tokens: Any, _logits: Any) -> bool:
        """Called with the tokens up to each sampled one (llama-cpp-python may sample past max_tokens to complete
        a character): counts them, and stops a token that would not fit in the context's array."""
        counts.generated = max(counts.generated, len(tokens) - counts.prompt)
        return len(tokens) >= n_ctx

    def create_completion(*args: Any, **kw: Any) -> Any:
        bound = signature.bind_partial(*args, **kw).arguments
        given = bound.pop("prompt")
        tokens = list(given) if not isinstance(given, str) else llm.tokenize(given.encode(), add_bos=True,
                                                                               special=True)
        counts.prompt = len(tokens)
        if len(tokens) >= n_ctx:
            said = what or ("the prompt as sent (your text in the model's chat template, after its SYSTEM and MESSAGE "
                            "lines)" if is_chat_turn(package) else "the prompt")
            raise ZipmoeError(f"{said} is {len(tokens)} tokens, too many for a context of {n_ctx} (it must leave "
                              "room for a token to generate): raise the context with -c (or the model's PARAMETER "
                              "num_ctx), or shorten the prompt")
        if dry:
            raise _Counted
        room = n_ctx - len(tokens)
        wanted = bound.get("max_tokens")
        bound["max_tokens"] = room if wanted is None or wanted <= 0 else min(wanted, room)
        bound["stopping_criteria"] = StoppingCriteriaList([count, *(bound.get("stopping_criteria") or [])])
        return complete(tokens, **bound)

    llm.create_completion = create_completion


def prompt_tokens(model: str | os.PathLike[str], prompt: str, package: Any, n_ctx: int,
                  what: str | None = None) -> int | None:
    """The tokens of `prompt` as a completion sends it (in the package's chat template, after its SYSTEM and MESSAGE
    lines, where it has them), counted with the model's vocabulary alone, before the model loads; a ZipmoeError
    (exit status 2) when they do not fit in n_ctx. None where the vocabulary does not load: the model's own load
    then says what is wrong with the file (pyzipmoe.Llama), and the completion checks the prompt as sent. what:
    how the message names the prompt (default: the prompt, or the prompt as sent)."""
    import llama_cpp

    try:
        vocab = llama_cpp.Llama(os.fspath(model), vocab_only=True, n_ctx=n_ctx, verbose=False)
    except ValueError:  # llama-cpp-python's "Failed to load model from file"
        return None
    counts = _Tokens()
    try:
        _prepare(vocab, n_ctx, package, counts, dry=True, what=what)
        try:
            for _ in _stream(vocab, prompt, package, max_tokens=1):
                break
        except _Counted:
            pass
    finally:
        vocab.close()
    return counts.prompt


def complete(model: str | os.PathLike[str], prompt: str, *, n_predict: int = 128, threads: int | None = None,
             n_ctx: int | None = None, temperature: float = 0.8, seed: int | None = None, cache: str = "unbounded",
             out: TextIO | None = None, on_text: Callable[[str], None] | None = None,
             options: dict[str, Any] | None = None, package: Any = None) -> Completion:
    """Raw text completion of prompt with zipmoe's libllama through llama-cpp-python, streamed to `out`.
    options: pyzipmoe.Llama's memory_budget, cache_policy, hot_share, sm_share, trace, adapt (None: not given).
    package: a stored model's (pyzipmoe.models.package.ModelPackage); where it has a TEMPLATE, SYSTEM or MESSAGE
    lines, prompt is one chat turn after its SYSTEM and MESSAGE history, in its template, as `ollama run` answers.

    (llama-completion, the llama.cpp program for this, loses the end of its output in this llama.cpp version:
    its logger is never flushed at exit, so redirected output comes out truncated or empty.)
    """
    from .libllama import quiet_llama_log
    from .llama import Llama

    quiet_llama_log()  # llama.cpp's errors are in the exceptions' messages
    path = check_model(model)
    if n_ctx is None:
        n_ctx = min(DEFAULT_CONTEXT, _context_length(path) or DEFAULT_CONTEXT)
    prompt_tokens(path, prompt, package, n_ctx)  # a prompt too long for the context: refused before the model loads
    kwargs: dict[str, Any] = {"n_ctx": n_ctx, "verbose": False, "zipmoe_cache": cache,
                              **{k: v for k, v in (options or {}).items() if v is not None}}
    if threads is not None:
        kwargs.update(n_threads=threads, n_threads_batch=threads)
    if seed is not None:
        kwargs["seed"] = seed
    t0 = time.perf_counter()
    llm = Llama(str(path), **kwargs)
    try:
        t1 = time.perf_counter()
        if llm.zipmoe_served:
            llm.zipmoe_stats(reset=True)
        counts = _Tokens()
        _prepare(llm, n_ctx, package, counts, dry=False)
        pieces = []
        for text, _ in _stream(llm, prompt, package, max_tokens=n_predict, temperature=temperature):
            pieces.append(text)
            if out is not None:
                out.write(text)
                out.flush()
            if on_text is not None:
                on_text(text)
        t2 = time.perf_counter()
        stats = llm.zipmoe_stats() if llm.zipmoe_served else None
    finally:
        llm.close()
    return Completion("".join(pieces), counts.prompt, counts.generated, t1 - t0, t2 - t1, stats)


def print_completion_stats(c: Completion, err: TextIO = sys.stderr) -> None:
    rate = c.generated_tokens / c.seconds if c.seconds > 0 else 0.0
    print(f"\n[{c.prompt_tokens} prompt tokens, {c.generated_tokens} generated in {c.seconds:.2f} s "
          f"({rate:.1f} tokens/s); model loaded in {c.load_seconds:.2f} s]", file=err)
    if c.stats is not None:
        s = c.stats
        mib = 2**20
        print(f"[zipmoe: {s['stores']} expert tensors, {s['experts_decoded']} expert decodes "
              f"({s['bytes_decoded'] / mib:.1f} MiB BF16, {s['decode_seconds']:.3f} s summed over threads)]", file=err)
        routed = s["hits_hot"] + s["hits_warm"] + s["hits_sm"] + s["misses"]
        if routed:
            share = {name: 100 * s[key] / routed for name, key in
                     (("hot", "hits_hot"), ("warm", "hits_warm"), ("sm", "hits_sm"), ("cold", "misses"))}
            stall = s["stall_ns"] / 1e9 / max(1, c.prompt_tokens + c.generated_tokens)
            streamed = (f" ({100 * s['experts_streamed'] / routed:.0f}% of routed streamed through the cores' "
                        "caches, not kept)" if s.get("experts_streamed") else "")
            print(f"[zipmoe cache: routed experts found {', '.join(f'{k} {v:.0f}%' for k, v in share.items())}"
                  f"{streamed}; "
                  f"{s['bytes_read'] / mib:.1f} MiB read from disk; stalled {stall * 1000:.1f} ms per token; "
                  f"resident now {s['hot_bytes'] / mib:.1f} MiB decoded, {s['warm_bytes'] / mib:.1f} MiB compressed, "
                  f"{s['sm_bytes'] / mib:.1f} MiB sign+mantissa (peak {s['peak_resident_bytes'] / mib:.1f} MiB); "
                  f"{s['evictions']} evictions]", file=err)
        if s.get("bytes_read_guessed"):
            print(f"[zipmoe read-ahead: {s['bytes_read_ahead'] / mib:.1f} MiB of the reads ahead of need, "
                  f"{s['bytes_read_guessed'] / mib:.1f} MiB of them on the next layer's guessed routing "
                  f"(ZIPMOE_PREDICT), {s['guesses_used']} experts decoded from those]", file=err)
