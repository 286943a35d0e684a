"""Calibration: measured costs of tiny zipmoe models, the cache and what invalidates it, `zipmoe calibrate`."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
from pathlib import Path

import pytest

from pyzipmoe.runtime import measure as cal_mod
from pyzipmoe import cli
from pyzipmoe.plan import calibration as cal_cache
from pyzipmoe.plan.calibration import (
    Calibration,
    CalibrationError,
    cache_dir,
    cache_file,
    cpu_model,
    load_calibration,
    usable_cores,
)
from pyzipmoe.runtime.measure import calibrate, seconds_per_call
from pyzipmoe.cli.calibrate import calibration_table, duration, register

# a few reads, a few ms per timing, tier costs through the stores (the engine's are tested once): tests stay quick
FAST = {"read_bytes": 16 << 10, "min_seconds": 0.005, "engine": False}
COSTS = {"cores", "t_decode", "disk_bandwidth", "read_latency", "base_seconds_per_token", "t_read_sm", "t_read_cold",
         "t_layer"}


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own empty cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


@pytest.fixture
def model(zipmoe_models: dict, copy_of) -> Path:
    """A private copy of the tiny huff model: tests touch and rewrite it."""
    return copy_of(zipmoe_models["qwen3moe", "huff"])


def no_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*a, **kw):
        raise AssertionError("measured although a valid calibration was cached")

    monkeypatch.setattr(cal_mod, "measure_decode", fail)
    monkeypatch.setattr(cal_mod, "measure_disk", fail)


def positive(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


# ------------------------------------------------------------------------------------------ measuring


def test_the_engine_measures_tier_costs_and_the_base(model: Path) -> None:
    """Through the engine: six generations, solved for the base and each tier's cost per expert of a layer. A
    calibration made without the engine does not count as one when the engine is asked for, nor for making the
    planner the default."""
    from pyzipmoe.runtime.controller import planner_by_default

    under_budget = {"budget": "1GiB", "hot_share": None, "sm_share": None}
    assert not planner_by_default(model, **under_budget)  # nothing measured: plans would come from guesses
    without = calibrate(model, **FAST)
    assert not planner_by_default(model, **under_budget)
    cal = calibrate(model, **{**FAST, "engine": True})
    assert planner_by_default(model, **under_budget)  # the default once the engine's costs are known
    assert not planner_by_default(model, **{**under_budget, "budget": None})
    assert not planner_by_default(model, **{**under_budget, "hot_share": 0.5})
    assert not planner_by_default(model, **under_budget, plan="0:1,0,0")
    assert not cal.from_cache and cal.tier_source == "engine", cal
    assert positive(cal.base_seconds_per_token) and cal.base_seconds_per_token < 1
    assert positive(cal.t_decode) and min(cal.t_read_sm, cal.t_read_cold) >= cal.t_decode / cal.cores
    assert without.tier_source == "stores"
    assert calibrate(model, **{**FAST, "engine": True}).from_cache
    assert calibrate(model, **FAST).from_cache  # an engine calibration serves a quick request too


@pytest.mark.parametrize("codec", ["huff", "zstd", "esc"])
def test_numbers_are_positive_and_finite(zipmoe_models: dict, codec: str) -> None:
    path = zipmoe_models["qwen3moe", codec]
    cal = calibrate(path, **FAST)
    assert cal.codec == codec and not cal.from_cache
    assert cal.layer == 0 and cal.expert_tensors == 3 and cal.expert_values == 3 * 64 * 32  # gate, up, down
    assert 0 < cal.expert_compressed_bytes < cal.expert_values * 2
    for x in (cal.t_decode, cal.t_decode_fresh, cal.disk_bandwidth, cal.read_latency, cal.merge_seconds_per_value,
              cal.split_seconds_per_value, *cal.decode_values_per_second.values()):
        assert positive(x), cal
    assert cal.t_read_sm >= 0 and cal.t_read_cold >= 0 and math.isfinite(cal.t_read_sm + cal.t_read_cold)
    assert set(cal.decode_values_per_second) == {"huff", "zstd", "esc"}  # the others re-encoded
    # the decoder alone, into fresh memory, is no faster than its own speed allows
    assert cal.t_decode_fresh >= cal.expert_values / cal.decode_values_per_second[codec] * 0.5
    assert cal.cores >= 1 and cal.reads >= 1 and cal.bytes_read >= cal.read_size > 0
    assert cal.base_seconds_per_token is None and cal.tier_source == "stores"  # needs the model running
    costs = cal.as_costs_dict()
    assert set(costs) == COSTS and costs["t_decode"] == cal.t_decode
    assert cal.model["path"] == os.path.realpath(path) and cal.model["size"] == path.stat().st_size


def test_read_bytes_bounds_the_disk_measurement(model: Path) -> None:
    assert calibrate(model, read_bytes=1, min_seconds=0.005).reads == 1  # at least one read
    everything = calibrate(model, read_bytes=1 << 40, min_seconds=0.005, force=True)
    assert everything.reads == 2 * 3 * 8  # every expert region: 2 layers x 3 tensors x 8 experts


def test_seconds_per_call_takes_the_median_batch() -> None:
    ticks = iter(range(10**6))

    def clock() -> float:  # each reading 1 ms after the last: a batch of one call takes 1 ms
        return next(ticks) * 1e-3

    calls = []
    assert seconds_per_call(lambda: calls.append(1), 0.0, clock=clock) == pytest.approx(1e-3)
    assert len(calls) >= 6  # the warm-up call, then at least 5 batches


# ------------------------------------------------------------------------------------------ the cache


def test_second_call_uses_the_cache(model: Path, monkeypatch: pytest.MonkeyPatch, cache_home: Path) -> None:
    first = calibrate(model, **FAST)
    where = cache_file(model)
    assert where.parent == cache_home / "zipmoe" / "calibration" and where.is_file()
    assert json.loads(where.read_text())["schema"] == cal_cache.SCHEMA
    assert [p.name for p in where.parent.iterdir()] == [where.name]  # no temporary file left behind
    no_measuring(monkeypatch)
    again = calibrate(model, **FAST)
    assert again.from_cache and again == first
    assert load_calibration(model) == first


def test_touching_the_file_invalidates(model: Path) -> None:
    first = calibrate(model, **FAST)
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert load_calibration(model) is None
    again = calibrate(model, **FAST)
    assert not again.from_cache and again.model["mtime_ns"] == first.model["mtime_ns"] + 1_000_000_000
    assert load_calibration(model) is not None
    assert len(list(cache_file(model).parent.iterdir())) == 1  # the stale entry was replaced, not kept


def test_rewriting_the_file_invalidates(model: Path, zipmoe_models: dict, tmp_path: Path) -> None:
    calibrate(model, **FAST)
    new = tmp_path / "new.gguf"
    shutil.copyfile(zipmoe_models["qwen3moe", "zstd"], new)
    os.replace(new, model)  # another inode, size and codec under the same name
    assert load_calibration(model) is None
    assert calibrate(model, **FAST).codec == "zstd"


def test_another_machine_does_not_use_the_calibration(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here = calibrate(model, **FAST)
    real = cal_cache.machine_id()
    monkeypatch.setattr(cal_cache, "machine_id", lambda: {**real, "cpu": "Some Other CPU"})
    assert load_calibration(model) is None
    there = calibrate(model, **FAST)
    assert not there.from_cache and there.machine["cpu"] == "Some Other CPU"
    monkeypatch.setattr(cal_cache, "machine_id", lambda: {**real, "memory": real["memory"] * 2})
    assert load_calibration(model) is None
    monkeypatch.setattr(cal_cache, "machine_id", lambda: real)
    assert load_calibration(model) == here  # each machine keeps its own entry


def test_force_measures_again(model: Path) -> None:
    first = calibrate(model, **FAST)
    again = calibrate(model, force=True, **FAST)
    assert not again.from_cache and again.measured_at >= first.measured_at


def test_base_seconds_per_token_is_kept_when_given(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calibrate(model, **FAST)
    no_measuring(monkeypatch)
    assert calibrate(model, base_seconds_per_token=0.05, **FAST).base_seconds_per_token == 0.05
    assert load_calibration(model).as_costs_dict()["base_seconds_per_token"] == 0.05
    assert calibrate(model, **FAST).base_seconds_per_token == 0.05  # not given: the cached one stays


@pytest.mark.parametrize("damage", ["", "{not json", '{"schema": 1}', "[]",
                                    "same, with t_decode = -1", "same, with schema 999"])
def test_damaged_cache_is_measured_again(model: Path, damage: str) -> None:
    calibrate(model, **FAST)
    where = cache_file(model)
    data = json.loads(where.read_text())
    if damage == "same, with t_decode = -1":
        where.write_text(json.dumps({**data, "t_decode": -1}))
    elif damage == "same, with schema 999":
        where.write_text(json.dumps({**data, "schema": 999}))
    else:
        where.write_text(damage)
    assert load_calibration(model) is None
    assert not calibrate(model, **FAST).from_cache
    assert load_calibration(model) is not None


def test_unwritable_cache_costs_a_warning_not_the_result(model: Path, cache_home: Path) -> None:
    cache_home.mkdir(parents=True)
    (cache_home / "zipmoe").write_text("a file where the cache directory should be")
    with pytest.warns(UserWarning, match="could not cache the calibration"):
        cal = calibrate(model, **FAST)
    assert positive(cal.t_decode)


def test_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c" / "zipmoe" / "calibration"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for value in ("relative/dir", ""):  # the XDG spec: relative paths are ignored
        monkeypatch.setenv("XDG_CACHE_HOME", value)
        assert cache_dir() == tmp_path / "home" / ".cache" / "zipmoe" / "calibration"


# ------------------------------------------------------------------------------------------ bad input


def test_bad_models_are_one_line_errors(tmp_path: Path, non_moe_gguf: Path, not_gguf: Path) -> None:
    cases = [(tmp_path / "missing.gguf", "no such file"), (tmp_path, "not a file"),
             (non_moe_gguf, "no expert tensors"), (not_gguf, "not a GGUF file")]
    for path, says in cases:
        with pytest.raises(CalibrationError, match=says) as e:
            calibrate(path, **FAST)
        assert e.value.exit_code == 2 and "\n" not in str(e.value)
        assert load_calibration(path) is None


# ------------------------------------------------------------------------------------------ machine


@pytest.mark.parametrize("text,expect", [
    ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7763 64-Core Processor\n",
     "AMD EPYC 7763 64-Core Processor"),
    ("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n", "0xd0c"),
])
def test_cpu_model(tmp_path: Path, text: str, expect: str) -> None:
    (tmp_path / "cpuinfo").write_text(text)
    assert cpu_model(tmp_path / "cpuinfo") == expect


def test_cpu_model_without_cpuinfo(tmp_path: Path) -> None:
    assert cpu_model(tmp_path / "missing")  # platform's name, never empty


def _cores(tmp_path: Path, cgroup: str, files: dict[str, str]) -> int:
    """usable_cores on a fake machine: /proc/self/cgroup says `cgroup`, the cgroup tree holds `files`."""
    root, proc = tmp_path / "cg", tmp_path / "proc"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(cgroup)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return usable_cores(cgroup_root=root, proc_self=proc)


def test_cores_capped_by_cgroup_quota(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    v2 = {"cgroup.controllers": "cpu memory\n"}
    assert _cores(tmp_path / "a", "0::/app\n", {**v2, "app/cpu.max": "max 100000\n"}) == affinity
    assert _cores(tmp_path / "b", "0::/app\n", {**v2, "app/cpu.max": "50000 100000\n"}) == 1  # half a CPU: 1
    assert _cores(tmp_path / "c", "0::/app\n", {**v2, "app/cpu.max": "100000 100000\n"}) == 1
    assert _cores(tmp_path / "d", "0::/app\n", {**v2, "app/cpu.max": "garbage\n"}) == affinity
    v1 = {"cpu,cpuacct/docker/x/cpu.cfs_quota_us": "100000\n", "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n"}
    assert _cores(tmp_path / "e", "3:cpu,cpuacct:/docker/x\n", v1) == 1
    v1_none = {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}
    assert _cores(tmp_path / "f", "3:cpu,cpuacct:/\n", v1_none) == affinity


# ------------------------------------------------------------------------------------------ the command


def zipmoe(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """`zipmoe ARGV` through cli.main, with `calibrate` registered (cli.py may not register it yet) and its decode
    timings shortened."""
    real = cli.build_parser

    def build() -> argparse.ArgumentParser:
        parser = real()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        if "calibrate" not in sub.choices:
            register(sub)
        return parser

    monkeypatch.setattr(cli, "build_parser", build)
    quick = cal_mod.calibrate
    monkeypatch.setattr(cal_mod, "calibrate", lambda *a, **kw: quick(*a, **{**kw, "min_seconds": FAST["min_seconds"],
                                                                             "engine": False}))
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_command_prints_a_table_with_units(model: Path, monkeypatch, capsys) -> None:
    code, out, err = zipmoe(["calibrate", str(model), "--read", "16KiB"], monkeypatch, capsys)
    assert code == 0, err
    assert "measured in" in out and "t_decode" in out and "values/s" in out and "ns/value" in out
    assert "/s" in out.split("disk bandwidth")[1].splitlines()[0] and "read latency" in out
    assert str(cache_file(model)) in out
    code, out, err = zipmoe(["calibrate", str(model)], monkeypatch, capsys)
    assert code == 0 and "from the cache" in out


def test_command_json_is_one_object(model: Path, monkeypatch, capsys) -> None:
    code, out, err = zipmoe(["calibrate", str(model), "--json", "--read", "16KiB"], monkeypatch, capsys)
    assert code == 0, err
    data = json.loads(out)
    assert set(data["costs"]) == COSTS and positive(data["costs"]["t_decode"])
    assert data["from_cache"] is False and Path(data["cache_file"]).is_file()
    assert Calibration.from_dict(data).t_decode == data["t_decode"]
    code, out, err = zipmoe(["calibrate", str(model), "--json", "--force", "--read", "16KiB"], monkeypatch, capsys)
    assert code == 0 and json.loads(out)["from_cache"] is False


def test_command_help_has_examples(monkeypatch, capsys) -> None:
    code, out, _ = zipmoe(["calibrate", "--help"], monkeypatch, capsys)
    assert code == 0 and "examples:" in out and "zipmoe calibrate model.zipmoe.gguf" in out and "exit status" in out


def test_command_errors_are_one_line(tmp_path: Path, tiny_model: Path, non_moe_gguf: Path, monkeypatch, capsys) -> None:
    for target, says in ((tmp_path / "missing.gguf", "no such file"), (non_moe_gguf, "no expert tensors")):
        code, out, err = zipmoe(["calibrate", str(target)], monkeypatch, capsys)
        assert code == 2 and out == ""
        assert err.startswith("zipmoe: error: ") and says in err and err.count("\n") == 1
    code, out, err = zipmoe(["calibrate", str(tiny_model), "--read", "lots"], monkeypatch, capsys)
    assert code == 2 and "is not a size" in err  # argparse's usage error


def test_table_without_cache_and_with_given_base(model: Path) -> None:
    from dataclasses import replace

    cal = replace(calibrate(model, **FAST), base_seconds_per_token=0.025, page_cache_dropped=False)
    text = calibration_table(cal)
    assert "25.0 ms" in text and "given" in text and "may have been warm" in text and "cached in" not in text


@pytest.mark.parametrize("seconds,text", [(1.2, "1.20 s"), (4.56e-3, "4.56 ms"), (16e-6, "16.0 µs"),
                                          (850e-9, "850 ns"), (123.4, "123 s")])
def test_duration(seconds: float, text: str) -> None:
    assert duration(seconds) == text
