"""A stored model's prior (docs/cache-and-planner.md, "Priors across prompts"): `zipmoe calibrate NAME --routing
FILE` keeps a recorded routing's counts in the store, `zipmoe show` says so, and the runtime settings that `zipmoe
run`, `zipmoe serve`'s children and pyzipmoe.Llama load with pass it as ZIPMOE_PRIOR under a memory budget, unless
the user named one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pyzipmoe.models.directory import ModelDirectory
from pyzipmoe.plan.prior import kept_prior
from pyzipmoe.models.package import ModelPackage
from pyzipmoe.plan import prior, trace
from stored_prior import Run, budget, program_envs, store, stored, zipmoe  # noqa: F401 (fixtures)

N_LAYER, N_EXPERT, K = 2, 8, 2  # the tiny preset's
STEPS = 12


def routing_file(path: Path, n_expert: int = N_EXPERT) -> Path:
    """A recorded routing of STEPS tokens, each routing to experts 0 and 1 of both blocks."""
    routed = np.zeros((STEPS, N_LAYER, n_expert), bool)
    routed[:, :, :K] = True
    trace.save(path, trace.Routing(routed, np.arange(N_LAYER, dtype=np.int32), np.ones(STEPS, np.int32), K))
    return path


def one_line_error(err: str, *fragments: str) -> None:
    assert err.startswith("zipmoe: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def test_calibrate_keeps_the_routing_as_the_models_prior_and_show_says_so(
        stored: ModelPackage, store: ModelDirectory, zipmoe: Run, tmp_path: Path) -> None:
    assert kept_prior(stored.model_path) is None and stored.prior() is None
    code, out, err = zipmoe("calibrate", "tiny", "--no-engine", "--routing", routing_file(tmp_path / "r.npz"))
    assert code == 0, err
    path = store.priors_dir / stored.model_path.name
    assert kept_prior(stored.model_path) == path and f"prior kept in {path}" in out
    expected = np.zeros((N_LAYER, N_EXPERT), np.uint64)
    expected[:, :K] = STEPS
    np.testing.assert_array_equal(prior.load(path), expected)
    assert not list(store.priors_dir.glob(".*"))  # no temporary file left beside it
    code, out, err = zipmoe("show", "tiny")
    assert code == 0 and f"{STEPS} tokens" in out, (out, err)
    code, out, err = zipmoe("show", "tiny", "--json")
    assert json.loads(out)["prior"] == {"path": str(path), "tokens": STEPS, "runs": 0, "error": None}


def test_calibrate_refuses_a_routing_of_another_model_or_a_file_model(
        stored: ModelPackage, zipmoe: Run, tmp_path: Path) -> None:
    code, _, err = zipmoe("calibrate", "tiny", "--no-engine", "--routing",
                          routing_file(tmp_path / "r.npz", N_EXPERT + 1))
    assert code != 0
    one_line_error(err, "a prior of 9 experts a layer, the model has 8")
    assert stored.prior() is None
    code, _, err = zipmoe("calibrate", stored.model_path, "--no-engine", "--routing", tmp_path / "r.npz")
    assert code != 0
    one_line_error(err, "--routing keeps a prior for a stored model")


def test_the_runtime_settings_pass_the_kept_prior_under_a_budget_only_and_the_users_wins(
        stored: ModelPackage, store: ModelDirectory, monkeypatch: pytest.MonkeyPatch, budget: str) -> None:
    from pyzipmoe.runtime.controller import runtime_settings

    assert "ZIPMOE_PRIOR" not in runtime_settings(stored.model_path, budget=budget).env  # none kept
    path = store.keep_prior("tiny", np.ones((N_LAYER, N_EXPERT), np.uint64))
    assert runtime_settings(stored.model_path, budget=budget).env["ZIPMOE_PRIOR"] == str(path)
    assert runtime_settings(str(stored.model_path), budget=budget, use_planner=True).env["ZIPMOE_PRIOR"] == str(path)
    assert "ZIPMOE_PRIOR" not in runtime_settings(stored.model_path).env  # no budget, no stores to seed
    monkeypatch.setenv("ZIPMOE_PRIOR", "/the/users.prior")
    assert "ZIPMOE_PRIOR" not in runtime_settings(stored.model_path, budget=budget).env  # theirs stays in force


@pytest.mark.parametrize("command", ["run", "serve"])
def test_zipmoe_run_and_serve_of_a_stored_model_give_their_program_the_kept_prior(
        stored: ModelPackage, store: ModelDirectory, zipmoe: Run, command: str, budget: str,
        program_envs: list[dict[str, str]]) -> None:
    """The environment llama-cli (run, interactive) or llama-server (serve NAME) starts with; the program itself is
    not started."""
    path = store.keep_prior("tiny", np.ones((N_LAYER, N_EXPERT), np.uint64))
    assert zipmoe(command, "tiny")[0] == 0  # first: each command sets what it passes in this process's environment
    assert zipmoe(command, "tiny", "--memory-budget", budget)[0] == 0
    without, with_budget = program_envs
    assert with_budget["ZIPMOE_PRIOR"] == str(path) and "ZIPMOE_PRIOR" not in without


def test_a_serve_child_of_a_stored_model_gets_the_kept_prior(
        stored: ModelPackage, store: ModelDirectory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        budget: str) -> None:
    """The environment `zipmoe serve`'s server starts a model's llama-server with (Models._spawn; not started)."""
    from pyzipmoe.runtime import runner
    from pyzipmoe.runtime.budget import model_memory
    from pyzipmoe.server.budget import SharedBudget, Tenant
    from pyzipmoe.server.children import Child, Models, Settings

    monkeypatch.setattr(runner, "program", lambda name: Path("/bin") / name)
    path = store.keep_prior("tiny", np.ones((N_LAYER, N_EXPERT), np.uint64))
    need = model_memory(stored.model_path)
    share = int(budget)
    models = Models(store, SharedBudget(str(2 * need.whole)), Settings(log_dir=tmp_path))
    child = Child("tiny", "tiny", stored, 128)
    try:
        _, env = models._spawn(child, Tenant("tiny", need.minimum, need.whole), share, True, need.other_bytes)
    finally:
        if child.control is not None:
            child.control.close()
    assert env["ZIPMOE_PRIOR"] == str(path) and env["ZIPMOE_MEMORY_BUDGET"] == str(share)
    assert Path(env["ZIPMOE_PRIOR_RECORD"]).parent == store.priors_dir  # and a place for its run's record


def test_prune_drops_the_prior_of_a_removed_model(stored: ModelPackage, store: ModelDirectory) -> None:
    path = store.keep_prior("tiny", np.ones((N_LAYER, N_EXPERT), np.uint64))
    store.prune()
    assert path.is_file()  # its model is still there
    store.remove("tiny")
    store.prune()
    assert not path.exists()
