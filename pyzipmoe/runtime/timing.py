"""Timing generation through the engine: a zipmoe model generates greedily in a fresh process, and its speed and
the runtime's counters over the timed tokens come back. What calibration's tier costs and tools/bench/bench_planner.py
measure with: the costs a planner needs are those the engine pays (threads, slots, reads, the matmuls' cache
pressure), which microbenchmarks of the decoder do not show.

    python -m pyzipmoe.runtime.timing '{"model": "m.zipmoe.gguf", "llama": {"memory_budget": "3GiB"}, "warmup": 16,
                                "gen": 24, "threads": 2}'

prints one JSON line: {"tps", "seconds", "stats", "predicted_live", "routing", "tokens", "timed_from", "prompt"}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ZipmoeError
from ..paths import REPO_ROOT, bin_dir
from .config import PRIOR_ENV, PRIOR_RECORD_ENV, RUNTIME_ENV

PROMPT = b"Once upon a time, in a land far away"
# parallel sequences' prompts (`parallel`): different texts, so that the sequences route as different requests do
PARALLEL_PROMPTS = (PROMPT, b"The expert said hello to the world and then", b"Water and time are the two things that",
                    b"In the first chapter of the book, we", b"A recipe for bread begins with",
                    b"The train left the station at dawn, and", b"Three reasons to learn a second language:",
                    b"Under the old bridge the river")
PROMPT_SEED = 1  # of a timed prompt's random tokens (llama-bench's pp test: random tokens of the vocabulary)


class TimingError(ZipmoeError):
    """The timed run failed (the model did not load, or generation failed): exit status 2, as for a model that
    cannot be used."""


def time_generation(model: str | os.PathLike[str], *, llama: Mapping[str, Any] | None = None, warmup: int = 16,
                    gen: int = 24, threads: int = 2, replan: bool = False, routing: bool = False,
                    timeout: float = 600, env: Mapping[str, str] | None = None,
                    record: str | os.PathLike[str] | None = None, prompt: int = 0,
                    parallel: int = 1) -> dict[str, Any]:
    """Runs `model` in a fresh process (pyzipmoe.Llama(model, **llama)): the prompt, `warmup` greedy tokens,
    then `gen` timed tokens. With `replan` (a model run with the planner), the monitor re-plans once from the
    routing of the warm-up, then stops, and `warmup` // 2 more tokens settle the new plan before timing.
    Returns {"tps", "seconds", "stats" (the runtime's counters over the timed tokens), "predicted_live" (the
    re-plan's predicted tokens/s, or None), "routing" (with `routing`: {block: [[experts of a token], ...]} of
    the warm-up's generated tokens, else None), "tokens" (every generated token, warm-up included), "timed_from"}.
    With `record`, the run's routing (every step, the prompt's included: pyzipmoe.plan.trace) is written there, and
    "timed_from" is the first timed step in it (else None). A stored model's kept prior is neither used nor taught:
    a timed run measures the engine, the same whatever earlier runs learned (calibration's lru runs would teach it
    routing forced by their plans).
    With `prompt` N > 0, first a prompt of N random tokens is evaluated twice (llama-bench's pp test: the first
    warms the cache) and the second timed: "prompt" is {"tokens", "tps", "seconds", "stats"} of it (else None).
    With `parallel` N > 1 (at most len(PARALLEL_PROMPTS)), N sequences of different prompts generate in lockstep in
    one context, as llama-server -np N's slots: every step decodes one token of each, `warmup` and `gen` count
    steps, "tps" is every sequence's tokens, "tokens" the first sequence's; not with replan, routing or record."""
    from . import runner

    if not 1 <= parallel <= len(PARALLEL_PROMPTS):
        raise ValueError(f"parallel sequences: 1 to {len(PARALLEL_PROMPTS)}, not {parallel}")
    if parallel > 1 and (replan or routing or record is not None):
        raise ValueError("parallel sequences are timed alone: no replan, routing or record")
    job = {"model": str(model), "llama": dict(llama or {}), "warmup": warmup, "gen": gen, "threads": threads,
           "replan": replan, "routing": routing, "record": None if record is None else str(record),
           "prompt": prompt, "parallel": parallel}
    # the runtime's defaults, except what `llama` asks for; where the build is (ZIPMOE_BUILD_DIR) is kept
    base = {k: v for k, v in (os.environ if env is None else env).items() if k not in RUNTIME_ENV}
    run_env = runner.environment(base=base)
    run_env.update({PRIOR_ENV: "", PRIOR_RECORD_ENV: ""})  # (empty: off, ahead of runtime_settings' choice)
    run_env["LLAMA_CPP_LIB_PATH"] = str(bin_dir())
    run_env.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's BLAS threads must not spin on the cores we time
    run_env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [run_env.get("PYTHONPATH")])])
    try:
        done = subprocess.run([sys.executable, "-m", "pyzipmoe.runtime.timing", json.dumps(job)], env=run_env,
                              capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise TimingError(f"{model}: timing generation took more than {timeout:g} s") from None
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
        raise TimingError(f"{model}: timing generation failed: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _worker(job: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    from .llama import Llama, last_logits

    record = job.get("record")
    n_prompt = int(job.get("prompt", 0))
    llm = Llama(job["model"], n_ctx=max(512, n_prompt + 64), n_threads=job["threads"],
                n_threads_batch=job["threads"], verbose=False, **job["llama"],
                **({"record_routing": True} if record else {}))
    timed_prompt = _timed_prompt(llm, n_prompt) if n_prompt > 0 else None
    if int(job.get("parallel", 1)) > 1:
        return {**_parallel_generation(llm, job), "prompt": timed_prompt}
    llm.reset()
    llm.eval(llm.tokenize(PROMPT))
    tokens: list[int] = []

    def step() -> None:
        tokens.append(int(np.argmax(last_logits(llm))))
        llm.eval([tokens[-1]])

    for _ in range(job["warmup"]):
        step()
    routing = None
    if job["routing"]:
        from .cache_control import live_routing
        from ..plan.inputs import geometry_from_gguf

        routing = {int(b): [np.flatnonzero(row).tolist() for row in log]
                   for b, log in live_routing(geometry_from_gguf(job["model"])).items()}
    predicted = None
    monitor = getattr(llm, "zipmoe_monitor", None)
    if job["replan"] and monitor is not None:
        monitor.generation_room = False  # the plan as planned: what the prediction is for, as the fixed splits run
        plan = monitor.refresh_routing(min_tokens=1)
        predicted = plan.tokens_per_second if plan else None
        monitor.stop()  # nothing else changes while timing
        for _ in range(job["warmup"] // 2):
            step()
    timed_from = llm.recorded_routing().n_steps if record else None
    seconds, stats = _timed(step, job["gen"])
    if record:
        llm.save_routing(record)
    return {"tps": job["gen"] / seconds, "seconds": seconds, "stats": stats, "predicted_live": predicted,
            "routing": routing, "tokens": tokens, "timed_from": timed_from, "prompt": timed_prompt}


def _timed_prompt(llm: Any, n_prompt: int) -> dict[str, Any]:
    """A prompt of n_prompt random tokens evaluated twice, the second timed: its speed and the runtime's counters."""
    import numpy as np

    tokens = np.random.default_rng(PROMPT_SEED).integers(0, llm.n_vocab(), n_prompt).tolist()
    llm.reset()
    llm.eval(tokens)
    llm.reset()
    seconds, stats = _timed(lambda: llm.eval(tokens), 1)
    return {"tokens": n_prompt, "tps": n_prompt / seconds, "seconds": seconds, "stats": stats}


def _timed(step: Callable[[], None], n: int) -> tuple[float, dict[str, Any]]:
    """n calls of step: their seconds, and the runtime's counters over them (zeroed first)."""
    from .llama import zipmoe_stats

    zipmoe_stats(reset=True)
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return time.perf_counter() - t0, zipmoe_stats()


def _parallel_generation(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    """job["parallel"] sequences generated greedily in lockstep in a context of their own (llama.cpp's C API:
    llama-cpp-python's contexts hold one sequence): each its prompt, then steps of one token of each."""
    import llama_cpp
    import numpy as np

    n = int(job["parallel"])
    prompts = [llm.tokenize(p) for p in PARALLEL_PROMPTS[:n]]
    per_sequence = max(len(p) for p in prompts) + job["warmup"] + job["gen"] + 1
    params = llama_cpp.llama_context_default_params()
    params.n_seq_max = n
    params.n_ctx = n * (-(-per_sequence // 256) * 256)  # (llama.cpp pads a sequence's context to 256)
    params.n_batch = params.n_ubatch = max(n, max(len(p) for p in prompts))
    params.n_threads = params.n_threads_batch = job["threads"]
    params.no_perf = True
    ctx = llama_cpp.llama_init_from_model(llm.model, params)
    if not ctx:
        raise RuntimeError(f"no context for {n} parallel sequences")
    batch = llama_cpp.llama_batch_init(params.n_batch, 0, n)
    n_vocab = llm.n_vocab()

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, logits wanted)
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, out) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, out
            batch.seq_id[i][0] = seq
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def greedy(i: int) -> int:
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))

    try:
        following = []
        for seq, tokens in enumerate(prompts):
            decode([(t, pos, seq, pos == len(tokens) - 1) for pos, t in enumerate(tokens)])
            following.append(greedy(len(tokens) - 1))
        positions = [len(p) for p in prompts]
        generated: list[list[int]] = [[] for _ in range(n)]

        def step() -> None:
            decode([(following[s], positions[s], s, True) for s in range(n)])
            for s in range(n):
                generated[s].append(following[s])
                positions[s] += 1
                following[s] = greedy(s)

        for _ in range(job["warmup"]):
            step()
        seconds, stats = _timed(step, job["gen"])
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
    return {"tps": n * job["gen"] / seconds, "seconds": seconds, "stats": stats, "predicted_live": None,
            "routing": None, "tokens": generated[0], "timed_from": None}


if __name__ == "__main__":
    print(json.dumps(_worker(json.loads(sys.argv[1]))))
