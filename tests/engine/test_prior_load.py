"""ZIPMOE_PRIOR: a prior file seeds every store of the model at load (docs/FORMAT.md, "Priors"). It changes what the
cache keeps and the order a prompt's read-ahead takes experts in, never what is computed: under a budget that holds
a few experts, the logits with a prior are those without, bit for bit; a prior of another model, or a damaged one,
fails the load with one line saying why."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import assert_bit_identical, llama_bin_dir, stderr_tail, worker_env

from pyzipmoe.plan import prior

TIMEOUT = 600
N_LAYER, N_EXPERT = 2, 8  # the tiny preset's

CHILD = r"""
import json, sys
import numpy as np
from pyzipmoe.runtime.llama import Llama, zipmoe_stats_reset
job = json.loads(sys.argv[1])
try:
    llm = Llama(job["model"], n_ctx=128, n_threads=2, n_threads_batch=2, n_batch=job["n_batch"],
                n_ubatch=job["n_batch"], logits_all=True, seed=0, verbose=False, memory_budget=job["budget"],
                hot_share=1.0, prefill=True)
except Exception as e:
    print(json.dumps({"load_error": str(e)}))
    sys.exit(0)
zipmoe_stats_reset()
tokens = llm.tokenize(b"the expert model said hello to the world of water and time, and then the people said")
llm.eval(tokens)
for _ in range(8):
    llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
np.save(job["out"], np.array(llm.scores[: llm.n_tokens], dtype=np.float32))
print(json.dumps({"stats": llm.zipmoe_stats()}))
llm.close()
"""


def run(model: Path, budget: int, n_batch: int, out: Path, prior_path: Path | None) -> dict[str, Any]:
    env = worker_env(llama_bin_dir())
    if prior_path is not None:
        env["ZIPMOE_PRIOR"] = str(prior_path)
    job = {"model": str(model), "budget": str(budget), "n_batch": n_batch, "out": str(out)}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(job)], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT, check=False)
    assert done.returncode == 0, f"the worker died (exit status {done.returncode}):\n{stderr_tail(done.stderr)}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tight(zipmoe_model: Path) -> int:
    """A budget whose tiers hold about 3 of each store's 8 experts (of 4 KiB): the policy chooses."""
    from pyzipmoe.runtime.budget import model_memory

    return model_memory(zipmoe_model).minimum + (96 << 10)


def skewed() -> np.ndarray:
    """A prior that ranks the experts the other way round from their ids (the fill without one)."""
    return np.tile(np.arange(1, N_EXPERT + 1, dtype=np.uint64) ** 3, (N_LAYER, 1))


@pytest.mark.parametrize("n_batch", [1, 64], ids=["token by token", "prompt in one batch"])
def test_a_prior_changes_what_is_cached_never_the_logits(zipmoe_model: Path, tight: int, n_batch: int,
                                                         tmp_path: Path) -> None:
    path = tmp_path / "model.prior"
    prior.save(path, skewed())
    without = run(zipmoe_model, tight, n_batch, tmp_path / "without.npy", None)
    with_prior = run(zipmoe_model, tight, n_batch, tmp_path / "with.npy", path)
    assert "load_error" not in without and "load_error" not in with_prior, (without, with_prior)
    a, b = np.load(tmp_path / "without.npy"), np.load(tmp_path / "with.npy")
    assert np.ptp(a, axis=1).min() > 0, "degenerate logits"
    assert_bit_identical(b, a, f"logits with a prior, n_batch {n_batch}")
    s, t = without["stats"], with_prior["stats"]
    assert s["misses"] > 0 and t["misses"] > 0, (s, t)  # the budget evicts: the cache had a choice to make
    if n_batch == 64:
        # the prompt's batch read each next store ahead, in the prior's order with one (readahead.c): reads moved,
        # the logits did not
        assert s["bytes_read_ahead"] > 0 and t["bytes_read_ahead"] > 0, (s, t)
    if n_batch == 1:
        # token by token the prior made it differently (the fill at load takes the other end of the ids); a prompt
        # in one batch routes to every expert at once, finding as many decoded whichever they are
        assert (s["hits_hot"], s["misses"]) != (t["hits_hot"], t["misses"]), (s, t)


@pytest.mark.parametrize("case, words", [
    ("layers", "ZIPMOE_PRIOR="), ("experts", "a model of 9 experts a layer"), ("truncated", "damaged"),
    ("not a prior", "not a prior file"), ("missing", "cannot be read"),
])
def test_a_prior_of_another_model_or_a_damaged_one_fails_the_load_saying_why(zipmoe_model: Path, tight: int,
                                                                            tmp_path: Path, case: str,
                                                                            words: str) -> None:
    path = tmp_path / "model.prior"
    good = prior.encode(skewed())
    data = {"layers": prior.encode(np.ones((N_LAYER + 1, N_EXPERT), np.uint64)),
            "experts": prior.encode(np.ones((N_LAYER, N_EXPERT + 1), np.uint64)),
            "truncated": good[:-3], "not a prior": b"GGUF" + good[4:]}.get(case)
    if data is not None:
        path.write_bytes(data)
    report = run(zipmoe_model, tight, 1, tmp_path / "out.npy", path)
    message = report.get("load_error", "")
    assert words in message and "ZIPMOE_PRIOR=" in message, report
    if case == "layers":
        assert f"a model of {N_LAYER + 1} layers; this one's experts are in {N_LAYER}" in message, message
