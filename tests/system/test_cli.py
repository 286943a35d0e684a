"""The zipmoe command: what people see, one-line errors and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import pyzipmoe
from pyzipmoe.file import gguf as format
from pyzipmoe.file import reader
from pyzipmoe.cli import main

REPO = Path(pyzipmoe.__file__).resolve().parent.parent


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *fragments: str) -> None:
    assert err.startswith("zipmoe: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err


def test_help_teaches(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for command in ("convert", "verify", "inspect", "unpack", "demo", "examples:", "exit status"):
        assert command in out
    code, out, _ = run(capsys, "convert", "--help")
    assert code == 0 and "--chunk-size" in out and "examples:" in out


def test_usage_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "convert", "only-one-argument.gguf")
    assert code == 2 and "usage:" in err and "Traceback" not in err


def test_convert_verify_inspect_unpack(capsys: pytest.CaptureFixture[str], tiny_model: Path, tmp_path: Path) -> None:
    packed, restored = tmp_path / "m.zipmoe.gguf", tmp_path / "m.gguf"
    code, out, _ = run(capsys, "convert", tiny_model, packed, "--codec", "zstd", "--level", "3", "--chunk-size",
                       "1000", "--threads", "2")
    assert code == 0
    assert "tensor group" in out and "ffn_up_exps" in out and "whole file" in out and "floor" in out
    code, out, _ = run(capsys, "verify", packed, "--against", tiny_model)
    assert code == 0 and out.startswith("OK ") and "identical to" in out
    code, out, _ = run(capsys, "inspect", packed)
    assert code == 0 and "zstd" in out and "blk.1.ffn_down_exps.weight" in out and "H(exp)" in out
    code, out, _ = run(capsys, "unpack", packed, restored)
    assert code == 0 and restored.read_bytes() == tiny_model.read_bytes()


def test_json_output(capsys: pytest.CaptureFixture[str], tiny_model: Path, tmp_path: Path) -> None:
    packed = tmp_path / "m.zipmoe.gguf"
    code, out, _ = run(capsys, "convert", tiny_model, packed, "--json")
    report = json.loads(out)
    assert code == 0 and report["codec"] == "huff" and report["output_size"] == packed.stat().st_size
    assert {g["label"] for g in report["groups"]} >= {"ffn_gate_exps", "whole file"}
    code, out, _ = run(capsys, "verify", packed, "--json")
    assert code == 0 and json.loads(out)["ok"] is True
    code, out, _ = run(capsys, "inspect", tiny_model, "--json")
    info = json.loads(out)
    assert code == 0 and info["compressed"] is False and len(info["tensors"]) == 6


def test_quiet_convert_prints_nothing(capsys: pytest.CaptureFixture[str], tiny_model: Path, tmp_path: Path) -> None:
    assert run(capsys, "convert", tiny_model, tmp_path / "q.gguf", "--quiet") == (0, "", "")


def test_inspect_plain_gguf_says_something_useful(capsys: pytest.CaptureFixture[str], tiny_model: Path,
                                                  non_moe_gguf: Path, f16_moe_gguf: Path) -> None:
    code, out, _ = run(capsys, "inspect", tiny_model)
    assert code == 0 and "not compressed" in out and "H(exp)" in out and "floor" in out
    code, out, _ = run(capsys, "inspect", non_moe_gguf)
    assert code == 0 and "not a MoE model" in out
    code, out, _ = run(capsys, "inspect", f16_moe_gguf)
    assert code == 0 and "2 F16 expert tensors" in out and " F16 " in out  # the status, and the table's type column


@pytest.mark.parametrize("fixture, fragment", [
    ("not_gguf", "not a GGUF file"),
    ("truncated_gguf", "truncated"),
    ("non_moe_gguf", "not a MoE model"),
    ("zipmoe_model", "already a zipmoe file"),
])
def test_convert_bad_input(fixture: str, fragment: str, request: pytest.FixtureRequest,
                           capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run(capsys, "convert", request.getfixturevalue(fixture), tmp_path / "out.gguf")
    assert code == 2 and out == ""
    assert_one_line_error(err, fragment)
    assert list(tmp_path.iterdir()) == []


def test_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for argv in (("convert", tmp_path / "nope.gguf", tmp_path / "out.gguf"), ("verify", tmp_path / "nope.gguf"),
                 ("inspect", tmp_path / "nope.gguf"), ("unpack", tmp_path / "nope.gguf", tmp_path / "o.gguf")):
        code, _, err = run(capsys, *argv)
        assert code == 2
        assert_one_line_error(err, "No such file or directory", "nope.gguf")
    assert list(tmp_path.iterdir()) == []


def test_output_directory_must_exist(capsys: pytest.CaptureFixture[str], tiny_model: Path, tmp_path: Path) -> None:
    code, _, err = run(capsys, "convert", tiny_model, tmp_path / "no" / "out.gguf")
    assert code == 2
    assert_one_line_error(err, "no such directory for the output", str(tmp_path / "no"))
    code, _, err = run(capsys, "convert", tiny_model, tmp_path)
    assert code == 2
    assert_one_line_error(err, "the output is a directory")
    assert list(tmp_path.iterdir()) == []


def test_level_needs_zstd(capsys: pytest.CaptureFixture[str], tiny_model: Path, tmp_path: Path) -> None:
    code, _, err = run(capsys, "convert", tiny_model, tmp_path / "o.gguf", "--level", "3")
    assert code == 2
    assert_one_line_error(err, "--level applies to --codec zstd only")


def test_corrupted_expert_fails_verify(capsys: pytest.CaptureFixture[str], zipmoe_model: Path,
                                       copy_of: Callable[[Path], Path],
                                       flip_bit: Callable[[Path, int], None], tmp_path: Path) -> None:
    damaged = copy_of(zipmoe_model)
    c = reader.open_zipmoe(damaged).compressed_by_name["blk.0.ffn_gate_exps.weight"]
    flip_bit(damaged, c.region_file_offset(2) + c.expert.span(2).exp_offset + 1)
    code, out, err = run(capsys, "verify", damaged)
    assert code != 0 and out == ""
    assert_one_line_error(err, "blk.0.ffn_gate_exps.weight: expert 2", "checksum")
    code, _, err = run(capsys, "unpack", damaged, tmp_path / "restored.gguf")
    assert code != 0
    assert_one_line_error(err, "blk.0.ffn_gate_exps.weight: expert 2")
    assert not (tmp_path / "restored.gguf").exists()


def test_truncated_zipmoe_fails_verify(capsys: pytest.CaptureFixture[str], zipmoe_model: Path,
                                       tmp_path: Path) -> None:
    damaged = tmp_path / "cut.gguf"
    damaged.write_bytes(zipmoe_model.read_bytes()[:-5000])
    code, _, err = run(capsys, "verify", damaged)
    assert code == 2
    assert_one_line_error(err, "truncated")


def test_verify_mismatch_exits_1(capsys: pytest.CaptureFixture[str], zipmoe_model: Path, tiny_model: Path,
                                 copy_of: Callable[[Path], Path]) -> None:
    other = copy_of(tiny_model)
    t = format.read_gguf(other).by_name["blk.0.ffn_down_exps.weight"]
    data = bytearray(other.read_bytes())
    data[t.file_offset + 2 * 5] ^= 0x01
    other.write_bytes(bytes(data))
    code, out, err = run(capsys, "verify", zipmoe_model, "--against", other)
    assert code == 1 and out == ""
    assert_one_line_error(err, "blk.0.ffn_down_exps.weight expert 0 element 5 (flat index 5): zipmoe gives 0x")


def python_m(*argv: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "pyzipmoe", *map(str, argv)], capture_output=True, text=True,
                          env=env, timeout=120)


def test_python_m_round_trip(tiny_model: Path, tmp_path: Path) -> None:
    packed = tmp_path / "m.zipmoe.gguf"
    done = python_m("convert", tiny_model, packed)
    assert done.returncode == 0, done.stderr
    assert "whole file" in done.stdout and done.stderr == ""  # no progress bars when stderr is not a terminal
    done = python_m("verify", packed, "--against", tiny_model)
    assert done.returncode == 0 and done.stdout.startswith("OK"), done.stderr


def test_python_m_bad_input(not_gguf: Path, tmp_path: Path) -> None:
    done = python_m("convert", not_gguf, tmp_path / "out.gguf")
    assert done.returncode == 2 and done.stdout == ""
    assert_one_line_error(done.stderr, "not a GGUF file")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("budget,says", [("inf", "not a size"), ("nan", "not a size"), ("1e30", "not a size"),
                                         ("9" * 400, "more than zipmoe can address")])
def test_run_refuses_a_budget_past_any_machine_in_one_line(zipmoe_model: Path, budget: str, says: str) -> None:
    """`zipmoe run MODEL --memory-budget inf` once ran with an undefined budget; now exit 2 and one line, before
    llama.cpp starts."""
    done = python_m("run", zipmoe_model, "--memory-budget", budget, "-p", "hi", "-n", "1")
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    assert_one_line_error(done.stderr, says)


# ------------------------------------------------------------------------------ the command line as a whole


def test_one_table_of_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    """`zipmoe --help`, every subcommand's --help and the README give the same exit statuses: the one table."""
    from pyzipmoe.cli import _subcommands, build_parser
    from pyzipmoe.errors import EXIT_STATUSES, exit_status_text

    table = exit_status_text()
    code, out, _ = run(capsys, "--help")
    assert code == 0 and table in out
    for name in _subcommands(build_parser()):
        code, out, _ = run(capsys, name, "--help")
        assert code == 0 and table in out and out.count("exit status:") == 1, name
    readme = (REPO / "README.md").read_text()
    for status, meaning in EXIT_STATUSES:
        assert f"| {status} | {meaning} |" in readme, status


def test_a_missing_file_or_model_exits_2_from_every_command(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing MODEL or FILE (or a model name the store has not) is bad input everywhere: 2 and one line (run,
    serve, plan and calibrate exited with 1)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ZIPMOE_MODELS", str(tmp_path / "store"))
    for argv in (("inspect", "nope.gguf"), ("verify", "nope.gguf"), ("convert", "nope.gguf", "out.gguf"),
                 ("unpack", "nope.gguf", "o.gguf"), ("run", "nope.gguf", "hi"), ("serve", "nope.gguf"),
                 ("plan", "nope.gguf", "--memory-budget", "1GiB"), ("calibrate", "nope.gguf"),
                 ("show", "nope"), ("rm", "nope"), ("export", "nope", "x.tar"), ("import", "nope.tar"),
                 ("create", "m", "-f", "nope"), ("run", "nope"), ("serve", "nope:latest"), ("bench", "nope.gguf")):
        code, out, err = run(capsys, *argv)
        assert code == 2 and out == "", (argv, code, out, err)
        assert_one_line_error(err, "nope")
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["store"])


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import tomllib

    with open(REPO / "pyproject.toml", "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out == f"zipmoe {version}\n"


def test_every_positional_argument_is_described(capsys: pytest.CaptureFixture[str]) -> None:
    from pyzipmoe.cli import _subcommands, build_parser

    for name, parser in _subcommands(build_parser()).items():
        positionals = [a for a in parser._actions if not a.option_strings]
        code, out, _ = run(capsys, name, "--help")
        assert code == 0
        for action in positionals:
            assert action.help, (name, action.dest)
            assert action.help.split("%")[0][:30] in " ".join(out.split()), (name, action.dest)


@pytest.mark.parametrize("argv,expected", [
    (["run", "m", "-n", "4", "hello"], {"model": "m", "prompt_text": "hello", "n_predict": 4}),
    (["run", "m.gguf", "--temp", "0", "hello"], {"model": "m.gguf", "prompt_text": "hello", "temp": 0.0}),
    (["run", "-c", "64", "m", "hi", "--stats"], {"model": "m", "prompt_text": "hi", "ctx_size": 64, "stats": True}),
    (["run", "m", "-n", "4", "hi", "--", "-n", "5", "--", "x"],
     {"model": "m", "prompt_text": "hi", "n_predict": 4, "llama_args": ["-n", "5", "--", "x"]}),
    (["bench", "a.gguf", "-p", "8", "b.gguf", "-n", "2"], {"models": ["a.gguf", "b.gguf"], "n_prompt": 8, "n_gen": 2}),
    (["show", "m", "--template"], {"name": "m", "template": True}),
])
def test_options_anywhere(argv: list[str], expected: dict[str, object]) -> None:
    """Options may follow the positional arguments (`zipmoe run MODEL -n 4 hello` once said 'unrecognized
    arguments: hello'); after `--`, everything is the llama.cpp program's, untouched."""
    from pyzipmoe.cli import parse_args

    args = vars(parse_args(argv))
    assert {k: args[k] for k in expected} == expected


def test_demo_rows_say_what_ran() -> None:
    """Both demo runs are zipmoe's llama-simple: the rows name the file and the budget, not 'stock llama.cpp'."""
    from pyzipmoe.cli.demo import Run, _table

    text = _table(100 << 20, 70 << 20, 50 << 20, Run("a", 10.0, 90 << 20, "rss"), Run("a", 9.0, 60 << 20, "rss"))
    header, bf16, zipped = text.splitlines()
    assert header.split()[:2] == ["model", "file"] and "peak RSS" in header
    assert bf16.startswith("BF16 GGUF (as stock llama.cpp)") and "none" in bf16
    assert zipped.startswith("zipmoe GGUF") and "50.0 MiB" in zipped
