"""Concurrent use of zipmoe models: several llama_cpp.Llama instances in one process, threads, processes.

Two instances of one zipmoe model in one process, used one after the other and from two threads at once, and
two processes sharing the file, must generate exactly what a single instance generates (tokens and every
logit), and the runtime's bookkeeping must stay consistent (each instance's stores decode the same experts).
Every run is a child process (tests/native/mutation_worker.py's approach: a crash fails one test, not pytest).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


TIMEOUT = 300

WORKER = r'''
import hashlib, json, sys, threading
import numpy as np
from llama_cpp import Llama
from pyzipmoe._native import ffi, lib

job = json.loads(sys.argv[1])
PROMPT = b"the expert model said hello to the world of water and time, and then the people said hello"

def load(path):
    return Llama(model_path=path, n_ctx=128, n_threads=job["threads"], n_threads_batch=job["threads"],
                 logits_all=True, seed=0, verbose=False)

def generate(llm, n_gen=6):
    llm.reset()
    tokens = llm.tokenize(PROMPT)
    llm.eval(tokens)
    out = []
    for _ in range(n_gen):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(nxt)
        llm.eval([nxt])
    scores = np.ascontiguousarray(llm.scores[: llm.n_tokens], dtype=np.float32)
    return {"generated": out, "logits": hashlib.sha256(scores.tobytes()).hexdigest()}

def stats():
    s = ffi.new("zipmoe_stats *")
    lib.zipmoe_stats_get(s)
    # the counters of resident experts have had several names while the cache evolved
    resident = next((getattr(s, f) for f in ("hot_bytes", "experts_resident") if hasattr(s, f)), None)
    return {"stores": s.stores, "resident": resident}

def guarded(fn, *args):
    try:
        return fn(*args)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}

res = {}
if job["mode"] == "single":
    llm = load(job["model"])
    res["runs"] = [generate(llm)]
    res["stats"] = stats()
elif job["mode"] == "two":
    a, b = load(job["model"]), load(job["model"])
    res["loaded"] = stats()
    res["runs"] = [generate(a), generate(b), generate(a)]
    for _ in range(job["rounds"]):  # both instances at once, from two threads
        out = [None, None]
        def work(i, llm):
            out[i] = guarded(generate, llm)
        ts = [threading.Thread(target=work, args=(i, m)) for i, m in enumerate((a, b))]
        for t in ts: t.start()
        for t in ts: t.join()
        res["runs"] += out
    res["stats"] = stats()
elif job["mode"] == "good-and-damaged":
    good, bad = load(job["model"]), load(job["damaged"])
    res["good"], res["bad"] = [], []
    for _ in range(job["rounds"]):
        out = [None, None]
        def work(i, llm):
            out[i] = guarded(generate, llm)
        ts = [threading.Thread(target=work, args=(i, m)) for i, m in enumerate((good, bad))]
        for t in ts: t.start()
        for t in ts: t.join()
        res["good"].append(out[0])
        res["bad"].append(out[1])
print(json.dumps(res))
'''


@pytest.fixture(scope="module")
def lib_dir(llama_lib_dir: Path) -> Path:
    return llama_lib_dir


def _start(lib_dir: Path, env: dict[str, str] | None = None, **job: object) -> subprocess.Popen:
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(lib_dir), OMP_NUM_THREADS=str(job.get("threads", 1)), **(env or {}))
    return subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(job)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, f"the worker died ({proc.returncode}):\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def single(lib_dir: Path, zipmoe_model: Path) -> dict:
    return _result(_start(lib_dir, mode="single", model=str(zipmoe_model), threads=2))


def test_two_instances_and_threads_match_one_instance(lib_dir: Path, zipmoe_model: Path, single: dict) -> None:
    res = _result(_start(lib_dir, mode="two", model=str(zipmoe_model), threads=2, rounds=4))
    (expected,) = single["runs"]
    assert len(res["runs"]) == 3 + 2 * 4
    for i, run in enumerate(res["runs"]):
        assert run == expected, f"run {i} differs from a single instance's"
    # each instance has its own stores, and decoded exactly the experts a single instance decodes
    assert res["loaded"]["stores"] == 2 * single["stats"]["stores"]
    assert res["stats"]["resident"] == 2 * single["stats"]["resident"]


def test_two_instances_under_a_budget_take_turns(lib_dir: Path, zipmoe_model: Path, single: dict) -> None:
    """Under a budget a store's plan evicts what the other stores decoded beyond their limits, another model's too,
    and decodes over their places. Two instances computing from two threads at once take turns a graph at a time
    (zipmoe_llama_compute_turn), so every matmul reads what its own op decoded: the tokens and logits of one
    instance without a budget."""
    from pyzipmoe.runtime.budget import model_memory

    budget = model_memory(zipmoe_model).minimum + (16 << 10)  # tiers of a few experts: every token evicts
    res = _result(_start(lib_dir, env={"ZIPMOE_MEMORY_BUDGET": str(budget), "ZIPMOE_PREFILL": "0"}, mode="two",
                         model=str(zipmoe_model), threads=2, rounds=8))
    (expected,) = single["runs"]
    for i, run in enumerate(res["runs"]):
        assert run == expected, f"run {i} differs from a single instance's"


def test_two_processes_sharing_the_file_match_one(lib_dir: Path, zipmoe_model: Path, single: dict) -> None:
    procs = [_start(lib_dir, mode="single", model=str(zipmoe_model), threads=1) for _ in range(2)]
    for p in procs:
        assert _result(p)["runs"] == single["runs"]


def test_a_damaged_model_does_not_disturb_another(lib_dir: Path, zipmoe_model: Path, single: dict,
                                                  tmp_path: Path) -> None:
    """One process, two models, one of them with a damaged expert chunk, decoding at the same time from two
    threads: the damaged one fails, the good one always gives exactly the single instance's output.

    Decode errors are recorded per store and taken by the graph compute whose ops materialised that store, so
    a compute never reports another model's error, nor misses its own (which once happened with one
    process-wide error slot)."""
    from pyzipmoe.file import gguf as format
    from pyzipmoe.file import reader

    damaged = tmp_path / "damaged.gguf"
    raw = bytearray(zipmoe_model.read_bytes())
    g = format.read_gguf(zipmoe_model)
    for name in ("blk.0.ffn_up_exps.zipmoe_data", "blk.1.ffn_down_exps.zipmoe_data"):
        zf = reader.open_zipmoe(zipmoe_model).compressed_by_name[name.replace(".zipmoe_data", ".weight")]
        for e in range(zf.expert.info.n_expert):  # every expert: whatever the router picks is damaged
            raw[g.by_name[name].file_offset + zf.expert.span(e).offset + 3] ^= 0x40
    damaged.write_bytes(bytes(raw))
    res = _result(_start(lib_dir, mode="good-and-damaged", model=str(zipmoe_model), damaged=str(damaged),
                         threads=2, rounds=60))
    (expected,) = single["runs"]
    assert all("error" in r for r in res["bad"]), "the damaged model produced output"
    assert all(r == expected for r in res["good"]), [r for r in res["good"] if r != expected][:2]
