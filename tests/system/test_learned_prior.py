"""A stored model's prior learns from its runs (docs/cache-and-planner.md, "Priors across prompts"): the runtime
settings under a budget give each run a fresh ZIPMOE_PRIOR_RECORD beside the kept prior (the user's, or an empty
one, wins), plan.prior.learn merges the records that runs left into the kept prior with decay under a lock, `zipmoe
show` says from how many runs, and `zipmoe prune` keeps what belongs to a model still stored."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from pyzipmoe.models.directory import ModelDirectory
from pyzipmoe.models.package import ModelPackage
from pyzipmoe.plan import prior
from stored_prior import Run, budget, program_envs, store, stored, zipmoe  # noqa: F401 (fixtures)

N_LAYER, N_EXPERT, K = 2, 8, 2  # the tiny preset's


def a_run(package: ModelPackage, hot: int, tokens: int) -> Path:
    """What a run's unload leaves (the native record, as zipmoe_prior_record writes it): `tokens` tokens, each routed
    to expert `hot` and the next one in every block."""
    counts = np.zeros((N_LAYER, N_EXPERT), np.uint64)
    counts[:, [hot, (hot + 1) % N_EXPERT]] = tokens
    path = prior.record_path(package.model_path)
    assert path is not None
    prior.save(path, counts)
    return path


def test_a_run_under_a_budget_gets_a_fresh_record_place_beside_the_kept_prior(
        stored: ModelPackage, store: ModelDirectory, monkeypatch: pytest.MonkeyPatch, budget: str) -> None:
    from pyzipmoe.runtime.controller import runtime_settings

    first = runtime_settings(stored.model_path, budget=budget).env["ZIPMOE_PRIOR_RECORD"]
    second = runtime_settings(stored.model_path, budget=budget).env["ZIPMOE_PRIOR_RECORD"]
    name = re.escape(stored.model_path.name)
    for path in (first, second):
        assert Path(path).parent == store.priors_dir and re.fullmatch(name + r"\.run-[0-9]+-[0-9a-f]+",
                                                                      Path(path).name), path
    assert first != second  # two runs (serve's children) never write over each other
    assert "ZIPMOE_PRIOR_RECORD" not in runtime_settings(stored.model_path).env  # no budget, no stores
    monkeypatch.setenv("ZIPMOE_PRIOR_RECORD", "")  # the opt-out: the user's setting stays in force
    assert "ZIPMOE_PRIOR_RECORD" not in runtime_settings(stored.model_path, budget=budget).env


def test_a_file_outside_the_store_gets_no_record(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pyzipmoe.runtime.controller import runtime_settings
    from pyzipmoe.runtime.budget import model_memory

    monkeypatch.delenv("ZIPMOE_PRIOR_RECORD", raising=False)
    need = model_memory(tiny_model)
    assert "ZIPMOE_PRIOR_RECORD" not in runtime_settings(tiny_model, budget=str(need.minimum), is_zipmoe=False).env


def test_runs_records_merge_into_the_kept_prior_with_decay_and_show_counts_them(
        stored: ModelPackage, store: ModelDirectory, zipmoe: Run, monkeypatch: pytest.MonkeyPatch,
        budget: str) -> None:
    from pyzipmoe.runtime.controller import runtime_settings

    monkeypatch.setattr(prior, "HALF_LIFE_ROUTINGS", 2 * 100)  # a run of 100 tokens of 2 experts halves the rest
    first = a_run(stored, 0, 40)
    kept = prior.learn(stored.model_path)
    assert kept == store.priors_dir / stored.model_path.name and not first.exists()
    expected = np.zeros((N_LAYER, N_EXPERT), np.uint64)
    expected[:, [0, 1]] = 40
    np.testing.assert_array_equal(prior.load(kept), expected)
    a_run(stored, 4, 100)
    damaged = a_run(stored, 6, 1)
    damaged.write_bytes(damaged.read_bytes()[:-8])  # dropped, not merged
    env = runtime_settings(stored.model_path, budget=budget).env  # the next run learns first
    assert env["ZIPMOE_PRIOR"] == str(kept)
    expected[:, [0, 1]] = 20  # 40, halved by the second run's 200 routings a block
    expected[:, [4, 5]] = 100
    np.testing.assert_array_equal(prior.load(kept), expected)
    assert [p.name for p in store.priors_dir.iterdir() if ".run-" in p.name] == []
    code, out, _ = zipmoe("show", "tiny")
    assert code == 0 and "120 tokens, learned from 2 runs" in out, out
    assert json.loads(zipmoe("show", "tiny", "--json")[1])["prior"]["runs"] == 2
    store.keep_prior("tiny", expected)  # a calibration starts the count again
    assert stored.prior()["runs"] == 0


def test_a_record_of_another_shape_or_of_no_routing_is_dropped_and_a_damaged_kept_prior_left_alone(
        stored: ModelPackage, store: ModelDirectory) -> None:
    kept = store.keep_prior("tiny", np.ones((N_LAYER, N_EXPERT), np.uint64))
    other = prior.record_path(stored.model_path)
    prior.save(other, np.ones((N_LAYER + 1, N_EXPERT), np.uint64))
    idle = prior.record_path(stored.model_path)  # a run that routed nothing (its load failed late)
    prior.save(idle, np.zeros((N_LAYER, N_EXPERT), np.uint64))
    assert prior.learn(stored.model_path) == kept and not other.exists() and not idle.exists()
    np.testing.assert_array_equal(prior.load(kept), np.ones((N_LAYER, N_EXPERT), np.uint64))
    assert prior.kept_runs(kept) == 0
    kept.write_bytes(b"ZMPRIOR1 damaged")
    run = a_run(stored, 0, 5)
    assert prior.learn(stored.model_path) == kept  # for the load to refuse with its one line
    assert kept.read_bytes() == b"ZMPRIOR1 damaged" and run.exists()


def test_a_record_whose_writer_died_mid_write_is_removed_and_a_live_writers_kept(
        stored: ModelPackage, store: ModelDirectory) -> None:
    import subprocess

    dead_pid = subprocess.Popen(["true"])  # (a pid that has ended: no process has it now)
    dead_pid.wait()
    record = prior.record_path(stored.model_path)
    dead = record.with_name(f"{record.name}.tmp{dead_pid.pid}")
    live = record.with_name(f"{record.name}.tmp{os.getpid()}")
    dead.write_bytes(b"ZMPRIOR1 half written")
    live.write_bytes(b"ZMPRIOR1 being written")
    prior.learn(stored.model_path)
    assert not dead.exists() and live.exists()


def test_prune_keeps_a_stored_models_records_and_drops_a_removed_ones(
        stored: ModelPackage, store: ModelDirectory) -> None:
    a_run(stored, 0, 5)
    prior.learn(stored.model_path)
    pending = a_run(stored, 2, 5)
    kept = store.priors_dir / stored.model_path.name
    store.prune()
    assert kept.is_file() and prior.runs_path(kept).is_file() and pending.is_file()
    store.remove("tiny")
    store.prune()
    assert list(store.priors_dir.iterdir()) == []


@pytest.mark.parametrize("command", ["run", "serve"])
def test_zipmoe_run_and_serve_of_a_stored_model_give_their_program_a_record_place_under_a_budget(
        stored: ModelPackage, store: ModelDirectory, zipmoe: Run, command: str, budget: str,
        program_envs: list[dict[str, str]]) -> None:
    """The environment llama-cli (run) or llama-server (serve NAME) starts with; the program is not started."""
    assert zipmoe(command, "tiny")[0] == 0
    assert zipmoe(command, "tiny", "--memory-budget", budget)[0] == 0
    without, with_budget = program_envs
    assert "ZIPMOE_PRIOR_RECORD" not in without
    assert Path(with_budget["ZIPMOE_PRIOR_RECORD"]).parent == store.priors_dir
