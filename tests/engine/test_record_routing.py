"""pyzipmoe.Llama(record_routing=True): the routing of every step of a run, written as a recorded-routing file
(pyzipmoe.plan.trace) that `zipmoe plan --trace` and the replay read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import llama_bin_dir, stderr_tail, worker_env

from pyzipmoe.plan import trace

TIMEOUT = 600

CHILD = """
import json, sys
import numpy as np
from pyzipmoe import Llama
from pyzipmoe._native import ffi, lib
job = json.loads(sys.argv[1])
llm = Llama(job["model"], n_ctx=256, n_threads=2, n_batch=job["n_batch"], n_ubatch=job["n_ubatch"], verbose=False,
            record_routing=True)
before = {}
for layer in range(2):
    buf = ffi.new("uint64_t[]", 8)
    lib.zipmoe_cache_activations(f"blk.{layer}.".encode(), buf, 8)
    before[layer] = list(buf)
text = llm("the expert cache keeps the experts a token routes to, and", max_tokens=12, temperature=0)
llm.save_routing(job["out"])
activations = []
for layer in range(2):
    buf = ffi.new("uint64_t[]", 8)
    lib.zipmoe_cache_activations(f"blk.{layer}.".encode(), buf, 8)
    activations.append([a - b for a, b in zip(buf, before[layer])])
print(json.dumps({"n_tokens": llm.n_tokens, "activations": activations, "text": text["choices"][0]["text"]}))
"""


def record(model: Path, out: Path, n_batch: int, n_ubatch: int) -> dict:
    job = {"model": str(model), "out": str(out), "n_batch": n_batch, "n_ubatch": n_ubatch}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(job)], env=worker_env(llama_bin_dir()),
                          capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert done.returncode == 0, stderr_tail(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_run_token_by_token_records_what_the_activation_counters_count(zipmoe_model: Path, tmp_path: Path):
    """One token a decode: every step routes exactly k experts in each layer, and the recording's counts are the
    runtime's activation counters over the run (counted independently, per routed row)."""
    got = record(zipmoe_model, tmp_path / "r.npz", n_batch=1, n_ubatch=1)
    r = trace.load(tmp_path / "r.npz")
    assert r.layers.tolist() == [0, 1] and r.n_expert == 8 and r.k == 2
    assert r.n_steps == got["n_tokens"] and r.tokens.tolist() == [1] * r.n_steps
    assert (r.routed.sum(axis=2) == 2).all()
    assert r.routed.sum(axis=0).tolist() == got["activations"]


def test_a_prompt_s_batch_is_one_step_a_ubatch(zipmoe_model: Path, tmp_path: Path):
    got = record(zipmoe_model, tmp_path / "r.npz", n_batch=16, n_ubatch=8)
    r = trace.load(tmp_path / "r.npz")
    assert int(r.tokens.sum()) == got["n_tokens"] and r.tokens.max() == 8
    prompt_steps = int((r.tokens > 1).sum())
    assert prompt_steps >= 2 and r.n_steps < got["n_tokens"]
    assert (r.routed[r.tokens == 1].sum(axis=2) == 2).all()
    assert (r.routed[r.tokens > 1, 0].sum(axis=1) >= 2).all()
    # the last block computes only the rows whose logits are wanted (a decode's last token): a prompt's step routes
    # one token's experts there or none, and the recording counts exactly what the runtime's counters count
    last = r.routed[:, 1].sum(axis=1)
    assert set(last[r.tokens > 1].tolist()) == {0, 2}
    assert r.routed[:, 1].sum(axis=0).tolist() == got["activations"][1]
    # the runtime counts each row of a batch: at least the union's experts
    assert (np.array(got["activations"]) >= r.routed.sum(axis=0)).all()


def test_recording_needs_a_zipmoe_model(tiny_model: Path):
    from pyzipmoe import Llama

    with pytest.raises(ValueError, match="record_routing needs a zipmoe GGUF"):
        Llama(str(tiny_model), n_ctx=64, verbose=False, record_routing=True)
