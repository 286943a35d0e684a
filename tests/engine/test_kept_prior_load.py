"""pyzipmoe.Llama on a stored model loads with the model's kept prior under a memory budget (the store's
priors/, `zipmoe calibrate NAME --routing`): the cache starts from it, and a damaged one fails the load with one line
that names it (docs/cache-and-planner.md, "Priors across prompts")."""

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

TIMEOUT = 600
N_LAYER, N_EXPERT = 2, 8  # the tiny preset's

CHILD = r"""
import json, sys
import numpy as np
from pyzipmoe.models.directory import llama_from_store
from pyzipmoe.runtime.llama import zipmoe_stats_reset
job = json.loads(sys.argv[1])
try:
    llm = llama_from_store("tiny", n_ctx=128, n_threads=2, n_threads_batch=2, n_batch=1, n_ubatch=1, seed=0,
                           verbose=False, memory_budget=job["budget"], hot_share=1.0, prefill=True, adapt=False)
except Exception as e:
    print(json.dumps({"load_error": str(e)}))
    sys.exit(0)
zipmoe_stats_reset()
tokens = llm.tokenize(b"the expert model said hello to the world of water and time, and then the people said")
for t in tokens:
    llm.eval([t])
print(json.dumps({"stats": llm.zipmoe_stats()}))
llm.close()
"""


def run(store: ModelDirectory, budget: int) -> dict[str, Any]:
    env = worker_env(llama_bin_dir())
    env["ZIPMOE_MODELS"] = str(store.root)
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps({"budget": str(budget)})], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert done.returncode == 0, f"the worker died (exit status {done.returncode}):\n{stderr_tail(done.stderr)}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def store(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> ModelDirectory:
    root = tmp_path_factory.mktemp("kept-prior")
    store = ModelDirectory(root / "models")
    store.create("tiny", f"FROM {tiny_model}\n", base_dir=root)
    return store


@pytest.fixture(scope="module")
def tight(store: ModelDirectory) -> int:
    """A budget whose tiers hold about 3 of each store's 8 experts: the policy chooses."""
    from pyzipmoe.runtime.budget import model_memory

    return model_memory(store.open("tiny").model_path).minimum + (96 << 10)


def test_a_stored_models_kept_prior_seeds_its_cache_and_a_damaged_one_fails_the_load(
        store: ModelDirectory, tight: int) -> None:
    path = store.prior_path(store.open("tiny"))
    path.unlink(missing_ok=True)
    without = run(store, tight)
    # the other end of the ids from the fill without a prior
    store.keep_prior("tiny", np.tile(np.arange(1, N_EXPERT + 1, dtype=np.uint64) ** 3, (N_LAYER, 1)))
    with_prior = run(store, tight)
    assert "load_error" not in without and "load_error" not in with_prior, (without, with_prior)
    s, t = without["stats"], with_prior["stats"]
    assert s["misses"] > 0 and (s["hits_hot"], s["misses"]) != (t["hits_hot"], t["misses"]), (s, t)
    path.write_bytes(path.read_bytes()[:-3])
    message = run(store, tight).get("load_error", "")
    assert "damaged" in message and f"ZIPMOE_PRIOR={path}" in message and "Traceback" not in message, message
