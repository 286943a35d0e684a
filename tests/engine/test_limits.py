"""Thread counts and context sizes at their bounds (pyzipmoe.runtime.config.MAX_THREADS, MAX_CONTEXT), through
pyzipmoe.Llama and `zipmoe run -p`: beyond them, one line and exit status 2 before llama.cpp sees the value (the
old code let -t 100000 segfault in libgomp and n_ctx=2**32+16 wrap around to a context of 256 tokens).

Each load runs in a child process: a crash there fails one test instead of killing pytest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import worker_env

from pyzipmoe.runtime.config import MAX_CONTEXT, MAX_THREADS

LOAD = """
import json, sys
from pyzipmoe import Llama
job = json.loads(sys.argv[1])
try:
    llm = Llama(job["model"], verbose=False, **job["kwargs"])
except ValueError as e:
    print(json.dumps({"error": str(e), "type": type(e).__name__}))
else:
    print(json.dumps({"n_ctx": llm.n_ctx(), "n_threads": llm.context_params.n_threads,
                      "n_threads_batch": llm.context_params.n_threads_batch}))
"""


def load(lib_dir: Path, model: Path, **kwargs: object) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", LOAD, json.dumps({"model": str(model), "kwargs": kwargs})],
                          env=worker_env(lib_dir), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kwargs, fragment", [
    ({"n_threads": 100000}, f"n_threads 100000 is out of range: threads go from 1 to {MAX_THREADS}"),
    ({"n_threads_batch": MAX_THREADS + 1}, f"n_threads_batch {MAX_THREADS + 1} is out of range"),
    ({"n_threads": -3}, "n_threads -3 is out of range"),
    ({"n_ctx": 2**32 + 16}, f"n_ctx {2**32 + 16} is out of range: a context goes from 1 to {MAX_CONTEXT} tokens"),
    ({"n_ctx": -1}, "n_ctx -1 is out of range"),
    ({"n_ctx": 1e30}, "n_ctx must be a whole number"),
])
def test_llama_refuses_what_llama_cpp_cannot_take(llama_lib_dir: Path, zipmoe_model: Path, kwargs: dict[str, object],
                                                  fragment: str) -> None:
    got = load(llama_lib_dir, zipmoe_model, **kwargs)
    assert "error" in got, f"{kwargs} was accepted: {got}"
    assert fragment in got["error"] and "\n" not in got["error"], got


def test_llama_takes_what_is_within_the_bounds(llama_lib_dir: Path, zipmoe_model: Path) -> None:
    got = load(llama_lib_dir, zipmoe_model, n_ctx=512, n_threads=2, n_threads_batch=1)
    assert got == {"n_ctx": 512, "n_threads": 2, "n_threads_batch": 1}
    got = load(llama_lib_dir, zipmoe_model, n_ctx=64, n_threads=0)  # 0 and None: llama-cpp-python's default
    assert "error" not in got and 1 <= got["n_threads"] <= MAX_THREADS, got


@pytest.mark.parametrize("flags, fragment", [
    (["-t", "100000"], "n_threads 100000 is out of range"),
    (["-c", str(2**32 + 16)], f"n_ctx {2**32 + 16} is out of range"),
])
def test_zipmoe_run_says_one_line_and_exits_2(llama_lib_dir: Path, zipmoe_model: Path, flags: list[str],
                                              fragment: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pyzipmoe", "run", "-n", "4", *flags, str(zipmoe_model), "-p", "hi"],
                          env=worker_env(llama_lib_dir), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, f"exit status {done.returncode}: {done.stderr[-2000:]}"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and lines[0].startswith("zipmoe: error:"), done.stderr


@pytest.mark.parametrize("line, fragment", [
    ("PARAMETER num_thread 100000", f"must be at most {MAX_THREADS}, got 100000"),
    (f"PARAMETER num_ctx {2**32 + 16}", f"must be at most {MAX_CONTEXT}, got {2**32 + 16}"),
])
def test_a_modelfile_takes_the_same_bounds(line: str, fragment: str) -> None:
    """The old code took these Modelfile lines, and `zipmoe run NAME` then segfaulted or wrapped the context."""
    from pyzipmoe.models.modelfile import ModelfileError, parse

    with pytest.raises(ModelfileError) as e:
        parse(f"FROM ./model.gguf\n{line}\n")
    assert "line 2" in str(e.value) and fragment in str(e.value) and "\n" not in str(e.value)
    assert parse(f"FROM ./model.gguf\nPARAMETER num_thread {MAX_THREADS}\nPARAMETER num_ctx {MAX_CONTEXT}\n")
