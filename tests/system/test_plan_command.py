"""`zipmoe plan` (pyzipmoe/cli/plan.py) on a real zipmoe file: the geometry read from the file, the table and
JSON it prints, the errors it reports, and costs from a calibration. The planner's math is tested in
tests/unit/test_planner.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pyzipmoe.cli import main as zipmoe_main
from pyzipmoe.cli import plan as cli_plan
from pyzipmoe.plan import inputs
from pyzipmoe.plan import solver as planner


@pytest.fixture(scope="module")
def tiny_zipmoe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pyzipmoe.file import convert
    from pyzipmoe import synth

    root = tmp_path_factory.mktemp("plan")
    synth.write_config(root / "tiny.gguf", synth.PRESETS["tiny"])
    convert.convert(root / "tiny.gguf", root / "tiny.zipmoe.gguf", threads=1)
    return root / "tiny.zipmoe.gguf"


def test_geometry_from_a_zipmoe_file(tiny_zipmoe: Path):
    g = inputs.geometry_from_gguf(tiny_zipmoe)
    tiny = __import__("pyzipmoe.synth", fromlist=["PRESETS"]).PRESETS["tiny"]
    values = 3 * tiny.n_embd * tiny.n_ff_exp  # gate, up and down
    assert (g.n_layer, g.n_expert, g.n_expert_used, g.layers) == (tiny.n_layer, tiny.n_expert, tiny.n_expert_used,
                                                                  tuple(range(tiny.n_layer)))
    assert g.hot_bytes == (2 * values,) * tiny.n_layer and g.sm_bytes == (values,) * tiny.n_layer
    assert all(values < w < 2 * values for w in g.warm_bytes)
    assert g.dense_bytes > 0 and g.tiered == (True,) * tiny.n_layer
    # its plain source: the same experts decoded, stored raw (read as they are: no warm or sm tier)
    plain = inputs.geometry_from_gguf(tiny_zipmoe.with_name("tiny.gguf"))
    assert (plain.n_layer, plain.n_expert, plain.n_expert_used, plain.layers) == (g.n_layer, g.n_expert,
                                                                                  g.n_expert_used, g.layers)
    assert plain.hot_bytes == plain.warm_bytes == g.hot_bytes and plain.sm_bytes == (0,) * tiny.n_layer
    assert plain.tiered == (False,) * tiny.n_layer and plain.dense_bytes == g.dense_bytes


@pytest.fixture
def no_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def whole(model: Path, tier_bytes: int) -> str:
    """The --memory-budget that leaves tier_bytes for the tiers (the budget also holds the weights that are not
    experts and one layer's experts in flight)."""
    from pyzipmoe.runtime.budget import model_memory

    return str(model_memory(model).minimum + tier_bytes)


def run_plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = zipmoe_main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_table(tiny_zipmoe: Path, capsys: pytest.CaptureFixture[str], no_calibration: None):
    code, out, err = run_plan(capsys, str(tiny_zipmoe), "--memory-budget", whole(tiny_zipmoe, 60 << 10))
    assert code == 0 and err == ""
    assert "uniform (no --trace" in out and "conservative" in out
    assert "predicted generation:" in out and "tokens/s" in out
    plan_line = [line for line in out.splitlines() if line.startswith("ZIPMOE_PLAN=")]
    assert len(plan_line) == 1 and set(planner.decode_plan(plan_line[0].split("=", 1)[1])) == {0, 1}
    header = next(line for line in out.splitlines() if line.startswith("layer"))
    assert all(word in header for word in ("hot", "warm", "sm", "cold", "bytes", "delay"))


def test_cli_json_with_trace_and_costs(tiny_zipmoe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       no_calibration: None):
    counts = np.zeros((1, 2, 8), np.int64)
    counts[0, :, :3] = [50, 30, 20]
    np.savez(tmp_path / "trace.npz", counts=counts)
    (tmp_path / "costs.json").write_text(json.dumps({"cores": 4, "base_seconds_per_token": 0.02}))
    code, out, err = run_plan(capsys, str(tiny_zipmoe), "--memory-budget", whole(tiny_zipmoe, 120000), "--json",
                              "--trace", str(tmp_path / "trace.npz"), "--costs", str(tmp_path / "costs.json"))
    assert code == 0 and err == ""
    data = json.loads(out)
    # the tiers' part, less the room a prompt's read buffers take beside them
    assert data["budget"] + data["read_bytes"] == 120000 and data["bytes"] <= data["budget"]
    assert data["memory"]["budget"] == int(whole(tiny_zipmoe, 120000))
    assert (data["memory"]["read_bytes"], data["memory"]["tier_bytes"]) == (data["read_bytes"], data["budget"])
    assert data["costs"]["cores"] == 4
    assert (data["frequencies"], data["trace"]) == ("trace", str(tmp_path / "trace.npz"))
    assert data["env"] == {"ZIPMOE_PLAN": data["plan"]}
    assert data["tokens_per_second"] <= data["all_hot_tokens_per_second"] == pytest.approx(50)
    assert data["hit_rates"]["cold"] == pytest.approx(0)  # room for the three experts that take all routing, beside a prompt's reads of the others
    assert [layer["hot"] + layer["warm"] + layer["sm"] + layer["cold"] for layer in data["layers"]] == [8, 8]


@pytest.mark.parametrize("budget,message", [("-1", "negative"), ("abc", "not a size"), ("200%", "at most 100%")])
def test_cli_bad_budgets(tiny_zipmoe: Path, capsys: pytest.CaptureFixture[str], budget: str, message: str):
    code, out, err = run_plan(capsys, str(tiny_zipmoe), "--memory-budget", budget)
    assert code == 2 and out == ""
    assert err.startswith("zipmoe: error:") and message in err and err.count("\n") == 1


def test_cli_bad_files(tiny_zipmoe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                       no_calibration: None):
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"\x00" * 100)
    np.save(tmp_path / "shape.npy", np.ones((1, 5, 8), np.int64))
    (tmp_path / "costs.json").write_text('{"cores": -1}')
    cases = [
        (["--trace", str(garbage)], "trace"),
        (["--trace", str(tmp_path / "shape.npy")], "(1, 5, 8)"),
        (["--costs", str(tmp_path / "costs.json")], "cores"),
    ]
    for extra, message in cases:
        code, out, err = run_plan(capsys, str(tiny_zipmoe), "--memory-budget", "1MiB", *extra)
        assert code == 2 and out == "" and message in err and err.count("\n") == 1, err
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("not weights\n")
    code, _, err = run_plan(capsys, str(not_gguf), "--memory-budget", "1MiB")
    assert code == 2 and "not a GGUF file" in err and "Traceback" not in err and err.count("\n") == 1, err


def test_cli_usage(capsys: pytest.CaptureFixture[str], tiny_zipmoe: Path):
    code, out, _ = run_plan(capsys, "--help")
    assert code == 0 and "examples:" in out and "ZIPMOE_PLAN" in out
    code, _, err = run_plan(capsys, str(tiny_zipmoe))  # no --memory-budget
    assert code == 2 and "--memory-budget" in err


def test_register_keeps_the_budget_away_from_the_runtime_environment():
    """cli.main exports an attribute `memory_budget` to the runtime's environment: planning must not."""
    import argparse

    parser = argparse.ArgumentParser(prog="zipmoe")
    cli_plan.register(parser.add_subparsers())
    args = parser.parse_args(["plan", "m.gguf", "--memory-budget", "1GiB"])
    assert args.plan_budget == "1GiB" and not hasattr(args, "memory_budget") and args.run is cli_plan.cmd_plan


def test_cli_costs_from_a_calibration(tiny_zipmoe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch):
    """A calibration (pyzipmoe.plan.calibration, faked here) gives what it measured; what it could not stays estimated,
    and --costs overrides both."""
    import sys
    import types

    class Calibration:
        def as_costs_dict(self) -> dict[str, object]:
            return {"cores": 3, "t_decode": 2e-4, "disk_bandwidth": 1e9, "read_latency": 5e-5,
                    "base_seconds_per_token": None}

    fake = types.ModuleType("pyzipmoe.plan.calibration")
    fake.load_calibration = lambda path: Calibration()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pyzipmoe.plan.calibration", fake)
    code, out, _ = run_plan(capsys, str(tiny_zipmoe), "--memory-budget", whole(tiny_zipmoe, 60 << 10), "--json")
    data = json.loads(out)
    assert code == 0 and data["costs"]["cores"] == 3 and data["costs"]["t_decode"] == 2e-4
    assert data["costs"]["base_seconds_per_token"] > 0 and "base_seconds_per_token: conservative" in data["costs_source"]
    (tmp_path / "costs.json").write_text('{"cores": 5}')
    code, out, _ = run_plan(capsys, str(tiny_zipmoe), "--memory-budget", whole(tiny_zipmoe, 60 << 10), "--json",
                            "--costs", str(tmp_path / "costs.json"))
    data = json.loads(out)
    assert (data["costs"]["cores"], data["costs"]["t_decode"]) == (5, 2e-4)
