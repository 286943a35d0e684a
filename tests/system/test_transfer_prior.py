"""`zipmoe export` carries a stored model's kept prior (priors/sha256-<model blob>, with what its runs recorded merged
in) and `zipmoe import` keeps it (pyzipmoe.models.transfer); an archive without one imports as before, and one whose
prior is damaged, of another blob or of another shape is refused with one line, leaving the store as it was."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pyzipmoe import cli
from pyzipmoe.models.directory import ModelDirectory as Store
from pyzipmoe.plan import prior

N_LAYER, N_EXPERT = 2, 8  # the tiny preset's


def members_of(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tar:
        return [(x.name, tar.extractfile(x).read()) for x in tar]  # type: ignore[union-attr]


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def counts(*hot: int) -> np.ndarray:
    c = np.ones((N_LAYER, N_EXPERT), np.uint64)
    c[:, list(hot)] = 50
    return c


@pytest.fixture
def source(tiny_model: Path, tmp_path: Path) -> Store:
    store = Store(tmp_path / "from")
    store.create("m", f"FROM {tiny_model}\n", base_dir=tmp_path)
    return store


@pytest.fixture
def target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    monkeypatch.setenv("ZIPMOE_MODELS", str(tmp_path / "to"))  # what `zipmoe import` uses
    return Store(tmp_path / "to")


def snapshot(store: Store) -> dict[str, bytes]:
    return {str(p.relative_to(store.root)): p.read_bytes() for p in sorted(store.root.rglob("*"))
            if p.is_file() and p.relative_to(store.root).parts[0] != ".state"}


def test_export_carries_the_kept_prior_with_its_runs_and_import_keeps_it(
        source: Store, target: Store, tmp_path: Path) -> None:
    blob = source.open("m").model_path
    source.keep_prior("m", counts(0))
    prior.save(prior.record_path(blob), counts(3))  # a run's record, not merged yet
    source.export("m", tmp_path / "m.tar")
    members = members_of(tmp_path / "m.tar")
    name, data = members[-1]
    assert name == f"priors/{blob.name}" and [n for n, _ in members].count(name) == 1
    learned = prior.merge(counts(0), counts(3))
    np.testing.assert_array_equal(prior.decode(data), learned)
    target.import_(tmp_path / "m.tar")
    kept = prior.kept_prior(target.open("m").model_path)
    assert kept is not None
    np.testing.assert_array_equal(prior.load(kept), learned)


def test_an_archive_without_a_prior_imports_without_one(source: Store, target: Store, tmp_path: Path) -> None:
    source.export("m", tmp_path / "m.tar")
    assert not [n for n, _ in members_of(tmp_path / "m.tar") if n.startswith("priors/")]
    target.import_(tmp_path / "m.tar")
    assert target.open("m").prior() is None


def test_an_imported_prior_leaves_one_the_store_keeps_for_that_blob(
        source: Store, target: Store, tiny_model: Path, tmp_path: Path) -> None:
    source.keep_prior("m", counts(0))
    source.export("m", tmp_path / "m.tar")
    target.create("here", f"FROM {tiny_model}\n", base_dir=tmp_path)  # the same blob, with a prior learned here
    target.keep_prior("here", counts(5))
    target.import_(tmp_path / "m.tar")
    np.testing.assert_array_equal(prior.load(prior.kept_prior(target.open("m").model_path)), counts(5))


@pytest.mark.parametrize("damage, words", [
    ("truncated", "the prior file is damaged"),
    ("magic", "not a prior file"),
    ("shape", "a prior of 3 layers of 8 experts; the model has 2 of 8"),
    ("blob", "is not the prior of the model blob"),
])
def test_a_damaged_or_foreign_prior_is_refused_with_one_line(
        source: Store, target: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str,
        words: str) -> None:
    source.keep_prior("m", counts(0))
    source.export("m", tmp_path / "m.tar")
    members = members_of(tmp_path / "m.tar")
    name, data = members[-1]
    bad: dict[str, Any] = {
        "truncated": (name, data[:-8]),
        "magic": (name, b"NOTPRIOR" + data[8:]),
        "shape": (name, prior.encode(np.ones((N_LAYER + 1, N_EXPERT), np.uint64))),
        "blob": ("priors/sha256-" + "0" * 64, data),
    }
    path = write_tar(tmp_path / "bad.tar", [*members[:-1], bad[damage]])
    before = snapshot(target) if target.root.exists() else {}
    code = cli.main(["import", str(path)])
    err = capsys.readouterr().err
    assert code != 0 and err.startswith("zipmoe: error: ") and err.count("\n") == 1, err
    assert words in err and "Traceback" not in err, err
    assert (snapshot(target) if target.root.exists() else {}) == before  # no model, no prior
