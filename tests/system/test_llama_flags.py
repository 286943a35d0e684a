"""zipmoe's settings as flags of the patched llama.cpp programs (patches/0007-zipmoe-args.patch): each flag, its
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
    assert f"={bad} is not" in refused_flag.stderr or "is not a size" in refused_flag.stderr, refused_flag.stderr


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
    assert refused.returncode != 0 and "ZIPMOE_CACHE_POLICY=nope is not a policy" in refused.stderr
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
