"""zipmoe's settings as flags of the patched llama.cpp programs (patches/0005-zipmoe-args.patch): each flag, its
LLAMA_ARG_* twin and its ZIPMOE_* variable give the same run, and a budget makes the program start again with
OpenMP's short spin unless the user said how OpenMP threads wait."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import helpers
from pyzipmoe.runtime.budget import human_size, model_memory
from pyzipmoe.runtime.config import BUDGET_ENV, OPENMP_SPIN, RUNTIME_ENV

PROMPT = "The expert"
TIMEOUT = 120
# flag, its LLAMA_ARG_* twin, the variable the runtime reads, a value it takes, one it refuses
FLAGS = [("--memory-budget", "LLAMA_ARG_MEMORY_BUDGET", "ZIPMOE_MEMORY_BUDGET", None, "12 parsecs"),
         ("--cache-policy", "LLAMA_ARG_CACHE_POLICY", "ZIPMOE_CACHE_POLICY", "lru", "nope"),
         ("--hot-share", "LLAMA_ARG_HOT_SHARE", "ZIPMOE_HOT_SHARE", "0.5", "2"),
         ("--sm-share", "LLAMA_ARG_SM_SHARE", "ZIPMOE_SM_SHARE", "0.25", "x"),
         ("--cache-plan", "LLAMA_ARG_CACHE_PLAN", "ZIPMOE_PLAN", "0:2,1,1;1:1,2,0", "nonsense")]


def clean_env(lib_dir: Path, **extra: str) -> dict[str, str]:
    """This environment without anything that configures the runtime or OpenMP's waiting, plus `extra`."""
    drop = set(RUNTIME_ENV) | {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("LLAMA_ARG_")}
    env["LD_LIBRARY_PATH"] = str(lib_dir)
    return {**env, **extra}


def budget_for(model: Path) -> str:
    """A budget that makes the cache evict, in KiB as a user would write it."""
    need = model_memory(model)
    return f"{(need.minimum + need.expert_bytes // 3) // 1024}KiB"


def zipmoe_lines(stderr: str) -> list[str]:
    """The runtime's load notes ("zipmoe: memory budget ...")."""
    return [ln[ln.index("zipmoe:"):] for ln in stderr.splitlines() if "zipmoe: " in ln and "budget" in ln]


def program(lib_dir: Path, name: str) -> Path:
    path = lib_dir / name
    if not path.exists():
        helpers.unavailable(f"{path} is not built")
    return path


def completion(lib_dir: Path, model: Path, flags: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = [str(program(lib_dir, "llama-completion")), "-m", str(model), "-n", "6", "-p", PROMPT, "--temp", "0",
            "-no-cnv", "-t", "2", "-c", "128", "-v", *flags]  # -v: the runtime's load notes
    return subprocess.run(argv, env=env, capture_output=True, text=True, errors="surrogateescape", timeout=TIMEOUT,
                          stdin=subprocess.DEVNULL,
                          check=False)


@pytest.mark.parametrize("flag,twin,var,good,bad", FLAGS, ids=[f[0] for f in FLAGS])
def test_completion_flag_twin_and_variable_agree(llama_lib_dir: Path, zipmoe_model: Path, flag: str, twin: str,
                                                  var: str, good: str | None, bad: str) -> None:
    budget = budget_for(zipmoe_model)
    good = good or budget
    base = [] if flag == "--memory-budget" else ["--memory-budget", budget]
    by_flag = completion(llama_lib_dir, zipmoe_model, [*base, flag, good], clean_env(llama_lib_dir))
    by_twin = completion(llama_lib_dir, zipmoe_model, base, clean_env(llama_lib_dir, **{twin: good}))
    by_var = completion(llama_lib_dir, zipmoe_model, base, clean_env(llama_lib_dir, **{var: good}))
    for run in (by_flag, by_twin, by_var):
        assert run.returncode == 0, run.stderr[-2000:]
    assert by_flag.stdout == by_twin.stdout == by_var.stdout and PROMPT in by_flag.stdout
    assert zipmoe_lines(by_flag.stderr) == zipmoe_lines(by_twin.stderr) == zipmoe_lines(by_var.stderr)
    assert zipmoe_lines(by_flag.stderr), by_flag.stderr[-2000:]
    refused_flag = completion(llama_lib_dir, zipmoe_model, [*base, flag, bad], clean_env(llama_lib_dir))
    refused_var = completion(llama_lib_dir, zipmoe_model, base, clean_env(llama_lib_dir, **{var: bad}))
    assert refused_flag.returncode != 0 and refused_var.returncode != 0
    assert f"{var}={bad}" in refused_var.stderr or f"memory budget {bad}" in refused_var.stderr, refused_var.stderr
    assert f"={bad} is not" in refused_flag.stderr or f"error: {flag} {bad} is not" in refused_flag.stderr, \
        refused_flag.stderr


def test_completion_budget_gives_the_bf16_tokens(llama_lib_dir: Path, tiny_model: Path, zipmoe_model: Path) -> None:
    """The flag applies the budget (its load note says so) and changes nothing of the tokens."""
    budget = budget_for(zipmoe_model)
    stock = completion(llama_lib_dir, tiny_model, [], clean_env(llama_lib_dir))
    zipped = completion(llama_lib_dir, zipmoe_model, ["--memory-budget", budget], clean_env(llama_lib_dir))
    assert stock.returncode == 0 and zipped.returncode == 0, zipped.stderr[-2000:]
    assert zipped.stdout == stock.stdout
    assert any(ln.startswith("zipmoe: memory budget ") for ln in zipmoe_lines(zipped.stderr)), zipped.stderr[-2000:]


def test_flags_are_in_the_help(llama_lib_dir: Path) -> None:
    for name in ("llama-cli", "llama-completion", "llama-server", "llama-bench"):
        done = subprocess.run([str(program(llama_lib_dir, name)), "--help"], env=clean_env(llama_lib_dir),
                              capture_output=True, text=True, errors="surrogateescape", timeout=TIMEOUT,
                          stdin=subprocess.DEVNULL, check=False)
        text = done.stdout + done.stderr
        assert done.returncode == 0, text[-2000:]
        for flag, twin, var, _, _ in FLAGS:
            assert flag in text and var in text, (name, flag)
            if name != "llama-bench":  # llama-bench reads no LLAMA_ARG_* variable
                assert twin in text, (name, twin)


def cli(lib_dir: Path, model: Path, flags: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = [str(program(lib_dir, "llama-cli")), "-m", str(model), "-n", "6", "-st", "-p", PROMPT, "--temp", "0",
            "-t", "2", "-c", "256", *flags]
    return subprocess.run(argv, env=env, capture_output=True, text=True, errors="surrogateescape", timeout=TIMEOUT,
                          stdin=subprocess.DEVNULL,
                          check=False)


def answer(stdout: str) -> str:
    """llama-cli's reply: what follows the prompt's echo, up to its speed line (the loading spinner before it and
    the timings differ run to run)."""
    after = stdout.split(f"> {PROMPT}\n", 1)
    assert len(after) == 2, stdout[-2000:]
    return after[1].split("[ Prompt:", 1)[0]


def flag_and_variable(run: Callable[..., subprocess.CompletedProcess[str]], lib_dir: Path, model: Path,
                      flags: list[str], **variables: str) -> tuple[subprocess.CompletedProcess[str], ...]:
    """`run` (a program of lib_dir on model) once with `flags`, once with the same settings as `variables`; both
    must succeed."""
    by_flag = run(lib_dir, model, flags, clean_env(lib_dir))
    by_var = run(lib_dir, model, [], clean_env(lib_dir, **variables))
    assert by_flag.returncode == 0 and by_var.returncode == 0, by_flag.stderr[-2000:]
    return by_flag, by_var


def test_cli_flag_and_variable_agree(llama_lib_dir: Path, zipmoe_model: Path) -> None:
    budget = budget_for(zipmoe_model)
    by_flag, by_var = flag_and_variable(cli, llama_lib_dir, zipmoe_model, ["--memory-budget", budget,
                                                                           "--cache-policy", "lru"],
                                        ZIPMOE_MEMORY_BUDGET=budget, ZIPMOE_CACHE_POLICY="lru")
    assert answer(by_flag.stdout) == answer(by_var.stdout) and answer(by_flag.stdout).strip()
    refused = cli(llama_lib_dir, zipmoe_model, ["--memory-budget", "100KiB"], clean_env(llama_lib_dir))
    need = model_memory(zipmoe_model)
    assert refused.returncode != 0
    assert f"memory budget 100KiB is below the minimum of {human_size(need.minimum)}" in refused.stderr


def bench(lib_dir: Path, model: Path, flags: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = [str(program(lib_dir, "llama-bench")), "-m", str(model), "-p", "0", "-n", "4", "-r", "1", "-t", "2",
            "-v", *flags]
    return subprocess.run(argv, env=env, capture_output=True, text=True, errors="surrogateescape", timeout=TIMEOUT,
                          stdin=subprocess.DEVNULL,
                          check=False)


def test_bench_flag_and_variable_agree(llama_lib_dir: Path, zipmoe_model: Path) -> None:
    """llama-bench has its own parser: the flag reaches the runtime as the variable does (its load note), a
    refused value is refused the same way, and a missing value is a usage error."""
    budget = budget_for(zipmoe_model)
    by_flag, by_var = flag_and_variable(bench, llama_lib_dir, zipmoe_model, ["--memory-budget", budget,
                                                                             "--hot-share", "0.5"],
                                        ZIPMOE_MEMORY_BUDGET=budget, ZIPMOE_HOT_SHARE="0.5")
    assert zipmoe_lines(by_flag.stderr) == zipmoe_lines(by_var.stderr) and zipmoe_lines(by_flag.stderr)
    refused = bench(llama_lib_dir, zipmoe_model, ["--cache-policy", "nope"], clean_env(llama_lib_dir))
    assert refused.returncode == 1
    assert refused.stderr.splitlines() == ["error: --cache-policy nope is not a policy (lfuda, tlfu, lru, lfu or fifo)"]
    missing = bench(llama_lib_dir, zipmoe_model, ["--memory-budget"], clean_env(llama_lib_dir))
    assert missing.returncode != 0


def stand_in_build(lib_dir: Path, root: Path) -> Path:
    """A build directory for ZIPMOE_BUILD_DIR whose bin/ is lib_dir's, but for llama-bench: a script that keeps the
    environment it was started with (child.env) and runs the real llama-bench with -v, its stderr in child.err."""
    bin_dir = root / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for f in lib_dir.iterdir():
        if f.name != "llama-bench":
            (bin_dir / f.name).symlink_to(f)
    script = bin_dir / "llama-bench"
    script.write_text(f"#!/bin/sh\ncat /proc/$$/environ > '{root}/child.env'\n"
                      f"exec '{program(lib_dir, 'llama-bench')}' \"$@\" -v 2> '{root}/child.err'\n")
    script.chmod(0o755)
    return root / "build"


def test_zipmoe_bench_configures_the_runtime_as_the_flag_does(llama_lib_dir: Path, zipmoe_model: Path,
                                                              tmp_path: Path) -> None:
    """`zipmoe bench --memory-budget B` starts llama-bench with the runtime set up as bare `llama-bench
    --memory-budget B` sets it up: the same load note (the budget and its split between the tiers, and that
    nothing supervises it), the budget the only runtime variable, and OpenMP's short spin. Timing differences
    between the two (tools/bench/bench_flags.py) are then not the cache's configuration."""
    budget = budget_for(zipmoe_model)
    build = stand_in_build(llama_lib_dir, tmp_path)
    done = subprocess.run([sys.executable, "-m", "pyzipmoe", "bench", str(zipmoe_model), "--memory-budget", budget,
                           "--no-planner", "-p", "0", "-n", "4", "-r", "1", "-t", "2", "--json"],
                          env=clean_env(llama_lib_dir, ZIPMOE_BUILD_DIR=str(build)), capture_output=True, text=True,
                          errors="surrogateescape", timeout=TIMEOUT, stdin=subprocess.DEVNULL, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    raw = (tmp_path / "child.env").read_bytes().decode(errors="replace")
    child = dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)
    runtime = {k: v for k, v in child.items() if k in RUNTIME_ENV}
    assert runtime.keys() == {BUDGET_ENV}, runtime
    assert child[OPENMP_SPIN[0]] == OPENMP_SPIN[1]
    bare = bench(llama_lib_dir, zipmoe_model, ["--memory-budget", budget], clean_env(llama_lib_dir))
    assert bare.returncode == 0, bare.stderr[-2000:]
    wrapped = zipmoe_lines((tmp_path / "child.err").read_text(errors="replace"))
    assert wrapped == zipmoe_lines(bare.stderr) and any(ln.startswith("zipmoe: memory budget ") for ln in wrapped), \
        (wrapped, zipmoe_lines(bare.stderr))


class Server:
    """llama-server on loopback with `flags` and `env`; its stderr in `log`."""

    def __init__(self, lib_dir: Path, model: Path, flags: list[str], env: dict[str, str], log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url, self.log = f"http://127.0.0.1:{port}", log
        argv = [str(program(lib_dir, "llama-server")), "-m", str(model), "--port", str(port), "-t", "2", "-c", "256",
                "-np", "1", "-v", *flags]
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=err, start_new_session=True)
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"llama-server exited with {self.proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if helpers.http_json(self.url + "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        helpers.kill_group(self.proc)
        raise AssertionError("llama-server was not ready in time")

    def complete(self) -> str:
        status, body = helpers.http_json(self.url + "/completion", {"prompt": PROMPT, "n_predict": 6,
                                                                    "temperature": 0, "cache_prompt": False}, TIMEOUT)
        assert status == 200, (status, body)
        return body["content"]

    def environ(self) -> dict[str, str]:
        """The environment of the program now running as the server's pid (after any exec)."""
        raw = Path(f"/proc/{self.proc.pid}/environ").read_bytes()
        return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)

    def close(self) -> None:
        helpers.kill_group(self.proc)


def test_server_flag_twin_and_variable_agree(llama_lib_dir: Path, zipmoe_model: Path, tmp_path: Path) -> None:
    """The same text through the flag, its twin and the variable; under a budget the server runs with OpenMP's
    short spin that it set itself, and keeps a spin the user set."""
    budget = budget_for(zipmoe_model)
    runs = {"flag": (["--memory-budget", budget], {}), "twin": ([], {"LLAMA_ARG_MEMORY_BUDGET": budget}),
            "var": ([], {"ZIPMOE_MEMORY_BUDGET": budget}), "user spin": (["--memory-budget", budget],
                                                                         {"GOMP_SPINCOUNT": "7"})}
    texts, spins = {}, {}
    for name, (flags, extra) in runs.items():
        srv = Server(llama_lib_dir, zipmoe_model, flags, clean_env(llama_lib_dir, **extra), tmp_path / f"{name}.log")
        try:
            texts[name] = srv.complete()
            spins[name] = srv.environ().get(OPENMP_SPIN[0])
        finally:
            srv.close()
        assert any(ln.startswith("zipmoe: memory budget ") for ln in
                   zipmoe_lines(srv.log.read_text(errors="replace"))), name
    assert len(set(texts.values())) == 1, texts
    assert spins == {"flag": OPENMP_SPIN[1], "twin": OPENMP_SPIN[1], "var": OPENMP_SPIN[1], "user spin": "7"}


def test_no_budget_no_restart(llama_lib_dir: Path, tiny_model: Path, tmp_path: Path) -> None:
    """Without a budget the program is left as stock llama.cpp runs: OpenMP's own spin."""
    srv = Server(llama_lib_dir, tiny_model, [], clean_env(llama_lib_dir), tmp_path / "plain.log")
    try:
        assert OPENMP_SPIN[0] not in srv.environ()
    finally:
        srv.close()


def run_program(lib_dir: Path, name: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(program(lib_dir, name)), *args], env=env, capture_output=True, text=True,
                          errors="surrogateescape", timeout=TIMEOUT, stdin=subprocess.DEVNULL, check=False)


BAD_BUDGET = [("flag", ["--memory-budget", "abc"], {}, "--memory-budget abc"),
              ("twin", [], {"LLAMA_ARG_MEMORY_BUDGET": "abc"}, "LLAMA_ARG_MEMORY_BUDGET=abc"),
              ("variable", [], {"ZIPMOE_MEMORY_BUDGET": "abc"}, "ZIPMOE_MEMORY_BUDGET=abc"),
              ("over 100%", ["--memory-budget", "150%"], {}, "--memory-budget 150%")]


@pytest.mark.parametrize("name", ["llama-completion", "llama-cli", "llama-server"])
@pytest.mark.parametrize("how,flags,extra,named", BAD_BUDGET, ids=[b[0] for b in BAD_BUDGET])
def test_a_bad_budget_is_refused_while_the_arguments_are_parsed(llama_lib_dir: Path, zipmoe_model: Path, name: str,
                                                                how: str, flags: list[str], extra: dict[str, str],
                                                                named: str) -> None:
    """One line naming what the user gave (the flag, its twin or the variable), exit status 1, before the model is
    read: no load error, no memory-fit pass."""
    prompt = [] if name == "llama-server" else ["-n", "1", "-p", PROMPT]
    done = run_program(llama_lib_dir, name, ["-m", str(zipmoe_model), *prompt, *flags],
                       clean_env(llama_lib_dir, **extra))
    assert done.returncode == 1, done.stderr[-2000:]
    lines = [ln for ln in done.stderr.splitlines() if "abc" in ln or "150%" in ln]
    assert lines == [f"error: {named} is not a memory budget: write e.g. 6GiB, 512MiB, 60% or auto"], done.stderr
    assert "llama_model_load" not in done.stderr and "common_fit_params" not in done.stderr, done.stderr


BAD_SETTINGS = [("policy", ["--cache-policy", "lfru"], {}, "error: --cache-policy lfru is not a policy (lfuda, tlfu, "
                 "lru, lfu or fifo)"),
                ("policy variable", [], {"ZIPMOE_CACHE_POLICY": "LRU"}, "error: ZIPMOE_CACHE_POLICY=LRU is not a "
                 "policy (lfuda, tlfu, lru, lfu or fifo)"),
                ("plan", ["--cache-plan", "0:1,1"], {}, "error: --cache-plan 0:1,1 is not a plan "
                 "(\"<layer>:<hot>,<warm>,<sm>;...\", as `zipmoe plan` prints)"),
                ("plan twin", [], {"LLAMA_ARG_CACHE_PLAN": "0:1,1,99999999999999999999"}, "error: "
                 "LLAMA_ARG_CACHE_PLAN=0:1,1,99999999999999999999 is not a plan (\"<layer>:<hot>,<warm>,<sm>;...\", "
                 "as `zipmoe plan` prints)")]


@pytest.mark.parametrize("how,flags,extra,line", BAD_SETTINGS, ids=[b[0] for b in BAD_SETTINGS])
def test_a_bad_policy_or_plan_is_refused_while_the_arguments_are_parsed(llama_lib_dir: Path, zipmoe_model: Path,
                                                                         how: str, flags: list[str],
                                                                         extra: dict[str, str], line: str) -> None:
    """What zipmoe's parsers refuse without a model is refused before loading (at load it was printed twice, the
    memory-fit pass's between): one line, exit status 1."""
    done = run_program(llama_lib_dir, "llama-completion", ["-m", str(zipmoe_model), "-n", "1", "-p", PROMPT, *flags],
                       clean_env(llama_lib_dir, **extra))
    assert done.returncode == 1, done.stderr[-2000:]
    assert [ln for ln in done.stderr.splitlines() if "error" in ln] == [line], done.stderr[-2000:]


def test_llama_bench_refuses_a_bad_budget_before_loading(llama_lib_dir: Path, zipmoe_model: Path) -> None:
    done = bench(llama_lib_dir, zipmoe_model, ["--memory-budget", "12 parsecs"], clean_env(llama_lib_dir))
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "error: --memory-budget 12 parsecs is not a memory budget: write e.g. 6GiB, 512MiB, 60% or auto"], done.stderr


@pytest.mark.parametrize("name,flags", [("llama-completion", ["-t", "100000"]), ("llama-completion", ["-tb", "600"]),
                                        ("llama-cli", ["-t", "513"]), ("llama-server", ["-t", "513"]),
                                        ("llama-bench", ["-t", "2,513"])])
def test_more_threads_than_ggml_runs_is_a_clear_error(llama_lib_dir: Path, tiny_model: Path, name: str,
                                                     flags: list[str]) -> None:
    """Above GGML_MAX_N_THREADS (512) ggml's thread pool crashed (a segfault in libgomp): one line, exit status 1.
    (Counts just above the limit but for llama-completion's: before the check, llama-cli started them all.)"""
    args = ["-m", str(tiny_model), *flags] + ([] if name in ("llama-bench", "llama-server") else
                                              ["-n", "1", "-p", PROMPT])
    if name == "llama-bench":
        args += ["-p", "0", "-n", "1", "-r", "1"]
    done = run_program(llama_lib_dir, name, args, clean_env(llama_lib_dir))
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    flag, count = flags[0], flags[1].split(",")[-1]
    assert f"error: {flag} {count}: more threads than ggml runs (at most 512)" in done.stderr.splitlines(), \
        done.stderr[-2000:]


def test_auto_is_a_budget_of_the_bare_programs(llama_lib_dir: Path, zipmoe_model: Path) -> None:
    """`--memory-budget auto` as `zipmoe run` takes it: the memory available less a margin, at most the whole model
    (on this machine: the whole model), and the tokens stay the BF16 model's."""
    need = model_memory(zipmoe_model)
    plain = completion(llama_lib_dir, zipmoe_model, [], clean_env(llama_lib_dir))
    auto = completion(llama_lib_dir, zipmoe_model, ["--memory-budget", "auto"], clean_env(llama_lib_dir))
    assert auto.returncode == 0, auto.stderr[-2000:]
    assert auto.stdout == plain.stdout
    whole = human_size(need.minimum + need.expert_bytes)
    assert any(ln.startswith(f"zipmoe: memory budget {whole} (auto: the memory available less a margin")
               for ln in zipmoe_lines(auto.stderr)), auto.stderr[-2000:]


def completion_quiet(lib_dir: Path, model: Path, flags: list[str]) -> subprocess.CompletedProcess[str]:
    """llama-completion at its default verbosity."""
    return run_program(lib_dir, "llama-completion", ["-m", str(model), "-n", "2", "-p", PROMPT, "--temp", "0",
                                                     "-no-cnv", "-t", "2", "-c", "128", *flags], clean_env(lib_dir))


@pytest.mark.parametrize("which", ["zipmoe", "plain"])
def test_the_budget_line_is_shown_once_at_default_verbosity(llama_lib_dir: Path, zipmoe_model: Path,
                                                            tiny_model: Path, which: str) -> None:
    """Without -v: one line says the budget and its split (a plain MoE GGUF is budgeted too)."""
    model = zipmoe_model if which == "zipmoe" else tiny_model
    done = completion_quiet(llama_lib_dir, model, ["--memory-budget", budget_for(zipmoe_model)])
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [ln for ln in zipmoe_lines(done.stderr) if ln.startswith("zipmoe: memory budget ")]
    assert len(lines) == 1 and "cache tiers" in lines[0], done.stderr[-3000:]


def help_text(lib_dir: Path, name: str) -> str:
    done = run_program(lib_dir, name, ["--help"], clean_env(lib_dir))
    assert done.returncode == 0
    return done.stdout + done.stderr


@pytest.mark.parametrize("name", ["llama-completion", "llama-bench"])
def test_the_help_says_what_the_runtime_does(llama_lib_dir: Path, name: str) -> None:
    """The default policy is lfuda (the loader's), every policy the help names is one the loader takes, and a plain
    MoE GGUF is budgeted (zipmoe_plain_weights), not ignored."""
    text = " ".join(help_text(llama_lib_dir, name).split())
    assert "(default: lfuda)" in text and "(default: tlfu)" not in text
    assert "a plain GGUF ignores it" not in text
    assert "plain GGUF" in text and "or auto" in text
    source = (Path(__file__).parents[2] / "ggml_zipmoe/src/cache/policy.c").read_text()  # (zipmoe_policy_parse)
    for policy in ("lfuda", "tlfu", "lru", "lfu", "fifo"):
        assert f"{{ \"{policy}\", ZIPMOE_POLICY_" in source and f" {policy}" in text, policy


def dense_from(moe: Path, out: Path) -> Path:
    """`moe` (the tiny qwen3moe model) as a dense qwen3 model: its expert tensors and router replaced by one dense
    feed-forward block per layer, its metadata renamed. A model without experts that llama.cpp runs."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader, n_ff = GGUFReader(moe), 64
    w = GGUFWriter(out, "qwen3")
    for f in reader.fields.values():
        name = f.name.replace("qwen3moe.", "qwen3.")
        if f.name.startswith("GGUF.") or f.name == "general.architecture" or "expert" in name or \
                name == "qwen3.feed_forward_length":
            continue
        if f.types[0] == GGUFValueType.ARRAY:
            strings = f.types[-1] == GGUFValueType.STRING
            w.add_array(name, [bytes(f.parts[i]).decode() if strings else f.parts[i].tolist()[0] for i in f.data])
        elif f.types[0] == GGUFValueType.STRING:
            w.add_string(name, bytes(f.parts[f.data[0]]).decode())
        else:
            w.add_key_value(name, f.parts[f.data[0]].tolist()[0], f.types[0])
    w.add_feed_forward_length(n_ff)
    rng = np.random.default_rng(0)
    for t in reader.tensors:
        if "_exps" not in t.name and "ffn_gate_inp" not in t.name:
            data = np.array(t.data)
            typed = int(t.tensor_type) not in (0, 1)  # (F32 and F16 go as numpy arrays)
            w.add_tensor(t.name, data, raw_shape=data.shape if typed else None,
                         raw_dtype=t.tensor_type if typed else None)
        elif "ffn_down_exps" in t.name:
            w.add_tensor(t.name.replace("_exps", ""), rng.normal(0, 0.02, (int(t.shape[1]), n_ff)).astype(np.float32))
        elif "_exps" in t.name:
            w.add_tensor(t.name.replace("_exps", ""), rng.normal(0, 0.02, (n_ff, int(t.shape[0]))).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("budget", ["64MiB", "auto"])
def test_a_budget_for_a_model_without_experts_is_one_warning(llama_lib_dir: Path, tiny_model: Path, tmp_path: Path,
                                                             budget: str) -> None:
    """The model loads and runs as without a budget, and one line says that the budget does not apply."""
    dense = dense_from(tiny_model, tmp_path / "dense.gguf")
    plain = completion_quiet(llama_lib_dir, dense, [])
    budgeted = completion_quiet(llama_lib_dir, dense, ["--memory-budget", budget])
    assert plain.returncode == 0 and budgeted.returncode == 0, budgeted.stderr[-2000:]
    assert budgeted.stdout == plain.stdout
    said = [ln for ln in budgeted.stderr.splitlines() if "zipmoe" in ln]
    assert len(said) == 1 and "this model has none, so it loads as without a budget" in said[0], said
