"""A stored model's run under a memory budget teaches its kept prior (docs/cache-and-planner.md, "Priors across
prompts"): pyzipmoe.Llama on the stored model gets a ZIPMOE_PRIOR_RECORD, the model's unload writes the run's expert
uses there (zipmoe-llama.cpp, zipmoe_prior_record), and the next run's settings merge them in; an empty
ZIPMOE_PRIOR_RECORD records nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import llama_bin_dir, stderr_tail, worker_env

from pyzipmoe.models.directory import ModelDirectory
from pyzipmoe.plan import prior

TIMEOUT = 600
N_LAYER, N_EXPERT = 2, 8  # the tiny preset's

CHILD = r"""
import json, sys
from pyzipmoe._native import ffi, lib
from pyzipmoe.models.directory import llama_from_store
job = json.loads(sys.argv[1])
llm = llama_from_store("tiny", n_ctx=128, n_threads=2, n_threads_batch=2, n_batch=1, n_ubatch=1, seed=0,
                       verbose=False, memory_budget=job["budget"], adapt=False)
for t in llm.tokenize(b"the expert model said hello to the world of water and time"):
    llm.eval([t])
uses = []
for layer in range(2):
    buf = ffi.new("uint64_t[]", 8)
    lib.zipmoe_cache_activations(f"blk.{layer}.".encode(), buf, 8)
    uses.append(list(buf))
llm.close()
print(json.dumps({"uses": uses, "tokens": llm.n_tokens}))
"""


@pytest.fixture(scope="module")
def store(zipmoe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> ModelDirectory:
    root = tmp_path_factory.mktemp("learned-prior")
    store = ModelDirectory(root / "models")
    store.create("tiny", f"FROM {zipmoe_model}\n", base_dir=root)
    return store


def run(store: ModelDirectory, record: str | None = None) -> dict[str, Any]:
    from pyzipmoe.runtime.budget import model_memory

    env = worker_env(llama_bin_dir())
    env["ZIPMOE_MODELS"] = str(store.root)
    if record is not None:
        env["ZIPMOE_PRIOR_RECORD"] = record
    budget = model_memory(store.open("tiny").model_path).minimum + (96 << 10)  # about 3 of 8 experts a store
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps({"budget": str(budget)})], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert done.returncode == 0, f"the worker died (exit status {done.returncode}):\n{stderr_tail(done.stderr)}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def records(store: ModelDirectory) -> list[Path]:
    return sorted(p for p in store.priors_dir.glob("*.run-*")) if store.priors_dir.is_dir() else []


def test_a_runs_unload_records_its_expert_uses_and_the_next_run_learns_them(store: ModelDirectory) -> None:
    blob = store.open("tiny").model_path
    got = run(store)
    left = records(store)
    assert len(left) == 1, left
    uses = np.array(got["uses"], np.uint64)
    assert uses.shape == (N_LAYER, N_EXPERT) and (uses.sum(axis=1) > 0).all(), uses
    np.testing.assert_array_equal(prior.load(left[0]), uses)  # a block's count: its busiest store's
    kept = prior.learn(blob)
    assert kept is not None and records(store) == []
    np.testing.assert_array_equal(prior.load(kept), uses)
    assert store.open("tiny").prior()["runs"] == 1
    run(store, record="")  # the opt-out: nothing recorded
    assert records(store) == [] and prior.kept_runs(kept) == 1
