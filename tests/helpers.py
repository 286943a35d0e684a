"""What several test files need, written once: where the repository and its tools are, skipping (or, under CI,
failing) when zipmoe's llama.cpp is not built, comparing logits bit for bit, the environment and the end of a
child process, writing a file another process polls, and where a test may make a memory cgroup.

`import helpers` works from every folder under tests/: pytest puts tests/ (the folder of conftest.py, which has
no __init__.py) on sys.path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / "tools"


# ------------------------------------------------------------------------------ what is built


def unavailable(reason: str) -> None:
    """Skips the test, except under CI (CI set), where whatever it needs must be there: there it fails. Called at a
    module's top level, it skips (or fails) the whole module."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: this test must run there)")
    pytest.skip(reason, allow_module_level=True)


def llama_bin_dir() -> Path:
    """build/bin with zipmoe's libllama and llama-cpp-python's Python part; `unavailable` without them."""
    import pyzipmoe

    bin_dir = pyzipmoe.build_dir() / "bin"
    if not (bin_dir / "libllama.so").is_file():
        unavailable(f"zipmoe's llama.cpp is not built ({bin_dir / 'libllama.so'} is missing; "
                    "`bash tools/setup.sh` builds it)")
    if find_spec("llama_cpp") is None:
        unavailable("llama-cpp-python is not installed (`bash tools/setup.sh` installs it)")
    return bin_dir


def load_tool(relative: str) -> ModuleType:
    """A script under tools/ (e.g. "bench/bench_budget.py") imported as a module, once per test process."""
    path = TOOLS / relative
    name = path.stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------- logits


def assert_bit_identical(a: np.ndarray, b: np.ndarray, what: str) -> None:
    """float32 logits [positions, n_vocab] equal bit for bit; the message names the first that differs."""
    assert a.shape == b.shape, f"{what}: shapes {a.shape} and {b.shape}"
    same = a.view(np.uint32) == b.view(np.uint32)
    if not same.all():
        pos, tok = np.argwhere(~same)[0]
        raise AssertionError(f"{what}: {np.count_nonzero(~same)} of {a.size} logits differ, the first at position "
                             f"{pos}, token {tok}: {a[pos, tok]!r} vs {b[pos, tok]!r}")


# ----------------------------------------------------------------------------- child processes


def worker_env(lib_dir: Path) -> dict[str, str]:
    """The environment of a child that runs llama-cpp-python on the libllama in lib_dir, with the runtime's
    defaults (an unbounded cache): what configures it comes from the test, never from the outside environment."""
    from pyzipmoe.runtime.config import RUNTIME_ENV
    from pyzipmoe.runtime.runner import library_path

    env = {k: v for k, v in os.environ.items() if k not in RUNTIME_ENV}
    env["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    env["LD_LIBRARY_PATH"] = library_path(lib_dir, env)
    return env


def stderr_tail(stderr: str) -> str:
    """What a failing llama.cpp program said that matters: its error lines and its last lines."""
    lines = stderr.splitlines()
    errors = [ln for ln in lines if " E " in ln or "error" in ln.lower() or "failed" in ln.lower()]
    return "\n".join(errors[-15:] + ["..."] + lines[-10:])


def kill_group(proc: subprocess.Popen) -> None:
    """Kills a child started with start_new_session=True and all it started, and reaps it."""
    from pyzipmoe.runtime.runner import stop_group

    stop_group(proc, grace=0)


def write_atomic(path: Path, text: str) -> None:
    """Writes `text` to `path` so that a process polling for it sees all of it or nothing."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------- cgroups


def memory_cgroup_parent() -> Path:
    """This process's cgroup v1 memory directory, where a test may make a child cgroup; skips when not root,
    without the v1 memory controller, or when that directory cannot take children."""
    from pyzipmoe.runtime.memory import own_cgroup_dir

    if os.geteuid() != 0:
        pytest.skip("needs root to make a memory cgroup")
    parent = own_cgroup_dir("memory")
    if parent is None:
        pytest.skip("the cgroup v1 memory controller is not mounted")
    if not (parent / "memory.limit_in_bytes").is_file() or not os.access(parent, os.W_OK):
        pytest.skip(f"cannot make memory cgroups in {parent}")
    return parent


def finish_worker(proc: subprocess.Popen[str], what: str, timeout: float) -> dict[str, Any]:
    """The JSON a worker printed as its last line, once it exited 0 within `timeout` seconds; else an
    AssertionError with the end of its stderr (its process group killed on a timeout)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(f"{what} took more than {timeout} s:\n{err[-3000:]}") from None
    assert proc.returncode == 0, f"{what} failed (exit status {proc.returncode}; -9: killed):\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 60) -> tuple[int, Any]:
    """POST `body` as JSON (GET without one) on loopback; (HTTP status, the decoded answer or None)."""
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None


def reset_cache() -> None:
    """The native cache as a process starts with it: no stores left from a test, no slots, an unbounded budget (the
    token-weighted LFU the store tests count by hand)."""
    import gc

    from pyzipmoe._native import ffi, lib

    gc.collect()
    lib.zipmoe_cache_set_slots(ffi.NULL, 0, 0, 0)
    lib.zipmoe_cache_configure(2**64 - 1, 0, 0, lib.ZIPMOE_POLICY_TOKEN_LFU)
