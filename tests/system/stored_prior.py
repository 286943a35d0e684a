"""Fixtures of the stored-model prior tests, which import them (test_kept_prior.py, test_learned_prior.py; not a
conftest.py, whose module name would shadow tests/conftest.py's for `from conftest import ...`): a models directory
of their own, the tiny model stored in it, a budget, the environments the commands start programs with, and the
zipmoe command run in this process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pyzipmoe.models.directory import ModelDirectory
from pyzipmoe.models.package import ModelPackage

Run = Callable[..., tuple[int, str, str]]  # (the tests' annotation of the zipmoe fixture)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModelDirectory:
    """An empty models directory, the one the commands use; no prior or record of the caller's environment."""
    root = tmp_path / "models"
    monkeypatch.setenv("ZIPMOE_MODELS", str(root))
    monkeypatch.delenv("ZIPMOE_PRIOR", raising=False)
    monkeypatch.delenv("ZIPMOE_PRIOR_RECORD", raising=False)
    return ModelDirectory(root)


@pytest.fixture
def stored(store: ModelDirectory, tiny_model: Path, tmp_path: Path) -> ModelPackage:
    """The tiny model, stored as "tiny"."""
    store.create("tiny", f"FROM {tiny_model}\n", base_dir=tmp_path)
    return store.open("tiny")


@pytest.fixture
def zipmoe(capsys: pytest.CaptureFixture[str]) -> Run:
    """Runs `zipmoe ARGV...` in this process: (exit status, stdout, stderr)."""
    from pyzipmoe import cli

    def run(*argv: object) -> tuple[int, str, str]:
        code = cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def budget(stored: ModelPackage) -> str:
    """A memory budget (bytes) whose tiers hold about half of the stored model's experts."""
    from pyzipmoe.runtime.budget import model_memory

    need = model_memory(stored.model_path)
    return str(need.minimum + need.expert_bytes // 2)


@pytest.fixture
def program_envs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, str]]:
    """The environments the zipmoe commands start their llama.cpp program with, in order; no program is started.
    The runtime's variables, which the commands set in this process, are restored after the test."""
    from pyzipmoe.runtime import config, runner, supervise

    for key in config.RUNTIME_ENV:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    started: list[dict[str, str]] = []
    monkeypatch.setattr(runner, "program", lambda name: Path("/bin") / name)
    monkeypatch.setattr(supervise, "run_program", lambda argv, env, **kw: started.append(dict(env)) or 0)
    return started
