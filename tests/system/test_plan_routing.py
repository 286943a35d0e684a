"""`zipmoe plan --trace` with a recorded-routing file (pyzipmoe.plan.trace): planned from the order its tokens routed
in, as a run re-plans from its own; a recording of another model is refused with a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pyzipmoe.cli import main as zipmoe_main
from pyzipmoe.plan import inputs, trace
from pyzipmoe.plan import solver as planner
from pyzipmoe.plan.replay import synthetic_steps
from pyzipmoe.runtime.config import DEFAULT_POLICY


@pytest.fixture(scope="module")
def tiny_zipmoe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pyzipmoe import synth
    from pyzipmoe.file import convert

    root = tmp_path_factory.mktemp("plan-routing")
    synth.write_config(root / "tiny.gguf", synth.PRESETS["tiny"])
    convert.convert(root / "tiny.gguf", root / "tiny.zipmoe.gguf", threads=1)
    return root / "tiny.zipmoe.gguf"


def recording(layers: list[int], n_expert: int = 8, k: int = 2, steps: int = 64) -> trace.Routing:
    routed = np.zeros((steps, len(layers), n_expert), bool)
    for i, layer_steps in enumerate(synthetic_steps("zipf", len(layers), n_expert, k, steps, seed=3)):
        for t, ids in enumerate(layer_steps):
            routed[t, i, ids] = True
    return trace.Routing(routed=routed, layers=np.array(layers, np.int32), tokens=np.ones(steps, np.int32), k=k)


def budget(model: Path, tier_bytes: int) -> str:
    from pyzipmoe.runtime.budget import model_memory

    return str(model_memory(model).minimum + tier_bytes)


def test_a_recording_plans_from_the_order_its_tokens_routed(tiny_zipmoe: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str], monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no calibration: the conservative costs
    path = tmp_path / "run.routing.npz"
    trace.save(path, recording([0, 1]))
    g = inputs.geometry_from_gguf(tiny_zipmoe)
    counts, routing = trace.planner_inputs(trace.load(path), g.n_layer, g.n_expert, g.n_expert_used, g.layers, "r")
    model = planner.cost_model(g, inputs.default_costs(g), counts, routing, policy=DEFAULT_POLICY)
    assert model.recency  # 64 generated tokens a layer: enough for the recency model
    code = zipmoe_main(["plan", str(tiny_zipmoe), "--memory-budget", budget(tiny_zipmoe, 60 << 10), "--trace",
                        str(path), "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    data = json.loads(out)
    assert data["frequencies"] == "routing" and data["trace"] == str(path)
    assert data["plan"] == planner.plan_tiers(model, 60 << 10).encode()  # the recency model's plan
    code = zipmoe_main(["plan", str(tiny_zipmoe), "--memory-budget", budget(tiny_zipmoe, 60 << 10), "--trace",
                        str(path)])
    out, _ = capsys.readouterr()
    assert code == 0 and "recorded routing" in out


@pytest.mark.parametrize("layers,n_expert,message", [([0, 2], 8, "recorded MoE layers [0, 2]; the model's are [0, 1]"),
                                                     ([0, 1], 16, "recorded with 16 experts")])
def test_a_recording_of_another_model_is_refused(tiny_zipmoe: Path, tmp_path: Path, capsys, layers, n_expert,
                                                 message):
    path = tmp_path / "other.npz"
    trace.save(path, recording(layers, n_expert))
    code = zipmoe_main(["plan", str(tiny_zipmoe), "--memory-budget", "1MiB", "--trace", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and message in err and err.count("\n") == 1, err


def test_a_damaged_recording_is_refused(tiny_zipmoe: Path, tmp_path: Path, capsys):
    path = tmp_path / "bad.npz"
    trace.save(path, recording([0, 1]))
    with np.load(path) as z:
        arrays = dict(z)
    arrays["version"] = np.array(7)
    np.savez(path, **arrays)
    code = zipmoe_main(["plan", str(tiny_zipmoe), "--memory-budget", "1MiB", "--trace", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and "version 7" in err, err
