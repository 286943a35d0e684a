"""A prompt's micro-batch decodes each routed expert of a store once (issue 47, item 5): under the minimum budget
and a larger one, where a store keeps some of its experts decoded and a batch routes most of them, the experts
decoded while the prompt is evaluated are at most the (store, expert) pairs its micro-batches route, and each pair
is met once, as a hit or a miss. The pairs are counted from the recorded routing of those batches (three expert
tensors a layer: gate, up and down share the layer's router)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import llama_bin_dir, stderr_tail, worker_env

TIMEOUT = 600
TENSORS_PER_LAYER = 3  # ffn_gate_exps, ffn_up_exps, ffn_down_exps

CHILD = """
import json, sys
from pyzipmoe import Llama
from pyzipmoe.runtime.llama import zipmoe_stats
job = json.loads(sys.argv[1])
llm = Llama(job["model"], n_ctx=256, n_threads=2, n_batch=job["n_ubatch"], n_ubatch=job["n_ubatch"], verbose=False,
            memory_budget=job["budget"], record_routing=True)
tokens = llm.tokenize(b"the expert cache keeps the experts a token routes to, and decodes the others once " * 2)
zipmoe_stats(reset=True)
llm.eval(tokens)
stats = zipmoe_stats()
routing = llm.recorded_routing()
print(json.dumps({"stats": stats, "routed": routing.routed.astype(int).tolist(), "tokens": routing.tokens.tolist()}))
"""


def prompt_run(model: Path, n_ubatch: int, room: float) -> dict[str, Any]:
    """The prompt's stats and recorded routing under the minimum budget plus `room` of the experts' size."""
    from pyzipmoe.runtime.budget import model_memory

    need = model_memory(model)
    job = {"model": str(model), "n_ubatch": n_ubatch, "budget": str(need.minimum + int(room * need.expert_bytes))}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(job)], env=worker_env(llama_bin_dir()),
                          capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert done.returncode == 0, stderr_tail(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("room", [0.0, 0.5])
@pytest.mark.parametrize("n_ubatch", [64, 16])
def test_each_micro_batch_decodes_a_routed_expert_of_a_store_at_most_once(zipmoe_model: Path, n_ubatch: int,
                                                                          room: float) -> None:
    got = prompt_run(zipmoe_model, n_ubatch, room)
    routed = np.array(got["routed"], dtype=bool)  # (micro-batches, layers, experts)
    assert sum(got["tokens"]) > 16 and all(t <= n_ubatch for t in got["tokens"])
    if n_ubatch == 16:
        assert routed.shape[0] >= 2  # the prompt really came in several micro-batches
    pairs = TENSORS_PER_LAYER * int(routed.sum())  # (store, expert) routed, each micro-batch on its own
    stats = got["stats"]
    assert 0 < stats["experts_decoded"] <= pairs, (stats, pairs)
    # each routed pair of each micro-batch met once: a hit of a tier or a miss, never twice
    assert stats["hits_hot"] + stats["hits_warm"] + stats["hits_sm"] + stats["misses"] == pairs, (stats, pairs)
    # and the stores did have to decode: a batch routes more experts than these budgets keep decoded
    assert stats["misses"] > 0, stats
    if room > 0:
        assert stats["hits_hot"] > 0, stats  # (experts kept from one micro-batch, or the fill, to the next)
