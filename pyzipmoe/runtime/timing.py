"""Timing generation through the engine: a zipmoe model generates greedily in a fresh process, and its speed and
the runtime's counters over the timed tokens come back. What calibration's tier costs and tools/bench/bench_planner.py
measure with: the costs a planner needs are those the engine pays (threads, slots, reads, the matmuls' cache
pressure), which microbenchmarks of the decoder do not show.

    python -m pyzipmoe.runtime.timing '{"model": "m.zipmoe.gguf", "llama": {"memory_budget": "3GiB"}, "warmup": 16,
                                "gen": 24, "threads": 2}'

prints one JSON line: {"tps", "seconds", "stats", "predicted_live", "routing", "tokens"}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

from ..errors import ZipmoeError
from ..paths import REPO_ROOT, bin_dir
from .config import PRIOR_ENV, PRIOR_RECORD_ENV, RUNTIME_ENV

PROMPT = b"Once upon a time, in a land far away"


class TimingError(ZipmoeError):
    """The timed run failed (the model did not load, or generation failed): exit status 2, as for a model that
    cannot be used."""


def time_generation(model: str | os.PathLike[str], *, llama: Mapping[str, Any] | None = None, warmup: int = 16,
                    gen: int = 24, threads: int = 2, replan: bool = False, routing: bool = False,
                    timeout: float = 600, env: Mapping[str, str] | None = None,
                    record: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Runs `model` in a fresh process (pyzipmoe.Llama(model, **llama)): the prompt, `warmup` greedy tokens,
    then `gen` timed tokens. With `replan` (a model run with the planner), the monitor re-plans once from the
    routing of the warm-up, then stops, and `warmup` // 2 more tokens settle the new plan before timing.
    Returns {"tps", "seconds", "stats" (the runtime's counters over the timed tokens), "predicted_live" (the
    re-plan's predicted tokens/s, or None), "routing" (with `routing`: {block: [[experts of a token], ...]} of
    the warm-up's generated tokens, else None), "tokens" (every generated token, warm-up included), "timed_from"}.
    With `record`, the run's routing (every step, the prompt's included: pyzipmoe.plan.trace) is written there, and
    "timed_from" is the first timed step in it (else None). A stored model's kept prior is neither used nor taught:
    a timed run measures the engine, the same whatever earlier runs learned (calibration's lru runs would teach it
    routing forced by their plans)."""
    from . import runner

    job = {"model": str(model), "llama": dict(llama or {}), "warmup": warmup, "gen": gen, "threads": threads,
           "replan": replan, "routing": routing, "record": None if record is None else str(record)}
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

    from .llama import Llama, last_logits, zipmoe_stats

    record = job.get("record")
    llm = Llama(job["model"], n_ctx=512, n_threads=job["threads"], n_threads_batch=job["threads"], verbose=False,
                **job["llama"], **({"record_routing": True} if record else {}))
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
    zipmoe_stats(reset=True)
    t0 = time.perf_counter()
    for _ in range(job["gen"]):
        step()
    seconds = time.perf_counter() - t0
    stats = zipmoe_stats()
    if record:
        llm.save_routing(record)
    return {"tps": job["gen"] / seconds, "seconds": seconds, "stats": stats, "predicted_live": predicted,
            "routing": routing, "tokens": tokens, "timed_from": timed_from}


if __name__ == "__main__":
    print(json.dumps(_worker(json.loads(sys.argv[1]))))
