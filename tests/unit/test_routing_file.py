"""The recorded-routing file (pyzipmoe.plan.trace): round trip, and a clear error for each kind of bad file."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import numpy as np
import pytest

from pyzipmoe.plan import trace
from pyzipmoe.plan.trace import Routing, RoutingFileError


def sample() -> Routing:
    routed = np.zeros((4, 2, 8), bool)
    routed[0, :, [0, 1, 2, 5]] = True  # a prompt's batch of 3 tokens: the union of its rows
    routed[1, 0, [1, 2]] = routed[1, 1, [3, 4]] = True
    routed[2, 0, [2, 7]] = routed[2, 1, [3, 6]] = True
    routed[3, 0, [0, 1]] = routed[3, 1, [4, 6]] = True
    return Routing(routed=routed, layers=np.array([1, 3], np.int32), tokens=np.array([3, 1, 1, 1], np.int32), k=2)


def test_round_trip(tmp_path: Path):
    r = sample()
    trace.save(tmp_path / "r.npz", r)
    assert trace.is_routing_file(tmp_path / "r.npz")
    back = trace.load(tmp_path / "r.npz")
    np.testing.assert_array_equal(back.routed, r.routed)
    np.testing.assert_array_equal(back.layers, r.layers)
    np.testing.assert_array_equal(back.tokens, r.tokens)
    assert back.k == 2 and (back.n_steps, back.n_layer, back.n_expert) == (4, 2, 8)
    assert [s.tolist() for s in back.steps(1)] == [[0, 1, 2, 5], [3, 4], [3, 6], [4, 6]]
    assert back.counts().sum(axis=0)[0].tolist() == [2, 3, 3, 0, 0, 1, 0, 1]
    assert not list(tmp_path.glob(".*tmp"))  # written atomically: no temporary left


def test_planner_inputs_check_the_model(tmp_path: Path):
    r = sample()
    counts, routing = trace.planner_inputs(r, 4, 8, 2, (1, 3), "r")
    assert counts.shape == (4, 8) and not counts[[0, 2]].any() and counts[3].tolist() == [1, 1, 1, 2, 2, 1, 2, 0]
    assert sorted(routing) == [1, 3] and routing[1].shape == (4, 8)
    with pytest.raises(RoutingFileError, match="recorded MoE layers \\[1, 3\\]; the model's are \\[0, 1\\]"):
        trace.planner_inputs(r, 4, 8, 2, (0, 1), "r")
    with pytest.raises(RoutingFileError, match="recorded with 8 experts, top-2; the model has 16, top-2"):
        trace.planner_inputs(r, 4, 16, 2, (1, 3), "r")


def save_raw(path: Path, **arrays) -> Path:
    good = sample()
    base = {"format": np.array(trace.FORMAT), "version": np.array(1), "routed": good.routed, "layers": good.layers,
            "tokens": good.tokens, "k": np.array(2)}
    base.update(arrays)
    np.savez(path, **{k: v for k, v in base.items() if v is not None})
    return path


@pytest.mark.parametrize("change,message", [
    ({"format": np.array("something-else")}, "format is"),
    ({"version": np.array(2)}, "version 2; this zipmoe reads version 1"),
    ({"k": None}, "missing key(s) k"),
    ({"k": np.array([2, 2])}, "k must be one integer"),
    ({"k": np.array(9)}, "k must be in 1..8"),
    ({"routed": np.zeros((4, 2, 8), np.int8)}, "routed must be bool"),
    ({"routed": np.zeros((4, 8), bool)}, "routed must be bool [n_steps, n_layer, n_expert]"),
    ({"layers": np.array([3, 1])}, "layers must be increasing"),
    ({"layers": np.array([1])}, "layers must be 2 integers"),
    ({"tokens": np.array([1, 1, 1])}, "tokens must be 4 integers"),
    ({"tokens": np.array([0, 1, 1, 1])}, "at least one token"),
    ({"tokens": np.array([1, 1, 1, 1])}, "step 0 covers one token but routed more than k=2"),
    ({"routed": np.zeros((4, 2, 8), bool)}, "step 1 (one token) routed no expert in layer 0"),
    ({"routed": np.array([[[object()]]])}, "cannot be read"),
])
def test_bad_files_say_what_is_wrong(tmp_path: Path, change, message):
    path = save_raw(tmp_path / "bad.npz", **change)
    with pytest.raises(RoutingFileError, match=re.escape(message)):
        trace.load(path)


def test_files_that_are_not_recorded_routing(tmp_path: Path):
    (tmp_path / "garbage.npz").write_bytes(b"\x00" * 100)
    np.save(tmp_path / "one.npy", np.ones(3))
    np.savez(tmp_path / "counts.npz", counts=np.ones((1, 2, 8), np.int32))
    good = tmp_path / "good.npz"
    trace.save(good, sample())
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(good.read_bytes()[:200])
    cases = [(tmp_path / "missing.npz", "No such file"), (tmp_path / "garbage.npz", "not a readable numpy file"),
             (tmp_path / "one.npy", "a single .npy array"), (tmp_path / "counts.npz", "missing key(s) format"),
             (truncated, "routing file")]
    for path, message in cases:
        with pytest.raises(RoutingFileError, match=re.escape(message)):
            trace.load(path)
        assert not trace.is_routing_file(path) or path == truncated
    assert zipfile.is_zipfile(good)


def test_from_log_stacks_the_blocks_in_order():
    logs = {3: np.eye(8, dtype=bool)[[1, 2]], 1: np.eye(8, dtype=bool)[[0, 4]]}
    r = trace.from_log(logs, np.array([1, 1]), k=1)
    assert r.layers.tolist() == [1, 3] and [s.tolist() for s in r.steps(0)] == [[0], [4]]
    with pytest.raises(RoutingFileError, match="different numbers of steps"):
        trace.from_log({1: np.eye(8, dtype=bool)[:2], 2: np.eye(8, dtype=bool)[:3]}, np.array([1, 1]), k=1)
    with pytest.raises(RoutingFileError, match="no MoE layer"):
        trace.from_log({}, np.array([], np.int32), k=1)
