"""`zipmoe calibrate NAME` without --routing records the stored model's routing on built-in prompts and keeps it as
its prior (pyzipmoe.models.routing_run; docs/cache-and-planner.md, "Priors across prompts"), once: a prior kept
already stays (it learns from runs) unless --force."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import llama_bin_dir, stderr_tail, worker_env

from pyzipmoe.models.directory import ModelDirectory
from pyzipmoe.plan import prior

TIMEOUT = 600
N_LAYER, N_EXPERT, K = 2, 8, 2  # the tiny preset's

TEMPLATE = "{% for m in messages %}<{{ m.role }}> {{ m.content }}\n{% endfor %}<assistant> "

CHILD = r"""
import json, sys
from pyzipmoe.models.directory import ModelDirectory
from pyzipmoe.models.routing_run import PROMPTS, record_routing
from pyzipmoe.progress import Silent
from pyzipmoe._native import ffi, lib
job = json.loads(sys.argv[1])
r = record_routing(ModelDirectory(job["root"]), job["name"], Silent(), prompts=PROMPTS[:2], max_tokens=6)
print(json.dumps({"counts": r.counts.tolist(), "tokens": r.tokens, "chat": r.chat}))
"""


def child_env(root: Path) -> dict[str, str]:
    env = worker_env(llama_bin_dir())
    env["ZIPMOE_MODELS"] = str(root)
    env["XDG_CACHE_HOME"] = str(root / "xdg")
    return env


@pytest.fixture(scope="module")
def store(zipmoe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> ModelDirectory:
    root = tmp_path_factory.mktemp("calibrate-prior")
    store = ModelDirectory(root / "models")
    store.create("tiny", f"FROM {zipmoe_model}\n", base_dir=root)
    store.create("chat", f'FROM {zipmoe_model}\nTEMPLATE """{TEMPLATE}"""\n', base_dir=root)
    return store


@pytest.mark.parametrize("name", ["tiny", "chat"])
def test_the_built_in_prompts_routing_is_recorded_step_by_step(store: ModelDirectory, name: str) -> None:
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps({"root": str(store.root), "name": name})],
                          env=child_env(store.root), capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert done.returncode == 0, stderr_tail(done.stderr)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    counts = np.array(got["counts"])
    # the synthetic model has no chat template: plain completions, unless its package gives one
    assert counts.shape == (N_LAYER, N_EXPERT) and got["chat"] == (name == "chat")
    # every generated token is a step routing K experts in each block, each prompt one step at least
    assert (counts.sum(axis=1) >= K * 2 * 6).all() and got["tokens"] > 2 * 6


def test_calibrate_keeps_the_recorded_routing_as_the_prior_once(store: ModelDirectory) -> None:
    def calibrate(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pyzipmoe", "calibrate", *argv, "--read", "16KiB"],
                              env=child_env(store.root), capture_output=True, text=True, timeout=TIMEOUT, check=False)

    done = calibrate("tiny")
    assert done.returncode == 0, stderr_tail(done.stderr)
    path = store.priors_dir / store.open("tiny").model_path.name
    assert f"prior kept in {path}, the routing of" in done.stdout and "plain completions" in done.stdout, done.stdout
    first = prior.load(path)
    assert first.shape == (N_LAYER, N_EXPERT) and (first.sum(axis=1) > 0).all()
    path.write_bytes(prior.encode(np.ones_like(first)))  # kept already: a second calibrate leaves it
    done = calibrate("tiny")
    assert done.returncode == 0 and "prior kept" not in done.stdout, stderr_tail(done.stderr)
    assert (prior.load(path) == 1).all()
