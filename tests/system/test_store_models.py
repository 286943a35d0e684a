"""The model store and its commands: create/list/show/cp/rm/prune/export/import, stored once, checked before use,
consistent after a crash and under concurrency; and running a stored model (llama.cpp, when it is built)."""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import llama_bin_dir

import pyzipmoe
from pyzipmoe.models import blobs as models_blobs
from pyzipmoe.models import directory as S
from pyzipmoe.models import manifest as models_manifest
from pyzipmoe.models import name as models_name
from pyzipmoe.models import package as models_package
from pyzipmoe.errors import ZipmoeError
from pyzipmoe.models.modelfile import Message
from pyzipmoe.models.blobs import BlobError
from pyzipmoe.models.directory import ModelDirectory as Store
from pyzipmoe.models.name import ModelName, ModelNotFoundError
from pyzipmoe.models.name import ModelsError as StoreError
from pyzipmoe.runtime.runner import library_path

REPO = Path(pyzipmoe.__file__).resolve().parent.parent
TIMEOUT = 120  # seconds for any child process


# ------------------------------------------------------------------------------------------ helpers


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    root = tmp_path / "models"
    monkeypatch.setenv("ZIPMOE_MODELS", str(root))  # what the commands use when --models is not given
    return Store(root)


def modelfile(directory: Path, text: str, name: str = "Modelfile") -> Path:
    path = directory / name
    path.write_text(text)
    return path


def blob_files(store: Store) -> dict[str, int]:
    """blob file name -> inode: a blob written again would get a new inode."""
    return {p.name: p.stat().st_ino for p in store.blobs_dir.iterdir()} if store.blobs_dir.exists() else {}


def assert_consistent(store: Store) -> None:
    """The store's invariant: every manifest is readable and every blob it names exists with its sha256."""
    for entry in store.list_models():
        assert entry.problem is None, entry
        store.open(entry.name, full_check=True)


def subparsers(parser: argparse.ArgumentParser) -> Any:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


@pytest.fixture
def zipmoe(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """Runs the zipmoe command in-process: (exit status, stdout, stderr). Until cli.py registers the store
    commands itself, they are registered here."""
    from pyzipmoe import cli
    from pyzipmoe.cli.models import register

    if "create" not in subparsers(cli.build_parser()).choices:
        original = cli.build_parser

        def build() -> argparse.ArgumentParser:
            parser = original()
            register(subparsers(parser))
            return parser

        monkeypatch.setattr(cli, "build_parser", build)

    def run(*argv: object) -> tuple[int, str, str]:
        code = cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def one_line_error(err: str, *fragments: str) -> None:
    assert err.startswith("zipmoe: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ZIPMOE_CACHE"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------ names


@pytest.mark.parametrize(("text", "full", "display"), [
    ("mymodel", "zipmoe.local/library/mymodel:latest", "mymodel:latest"),
    ("MyModel:V2", "zipmoe.local/library/mymodel:v2", "mymodel:v2"),
    ("me/qwen3-moe_30b.a3b:q8_0", "zipmoe.local/me/qwen3-moe_30b.a3b:q8_0", "me/qwen3-moe_30b.a3b:q8_0"),
    ("registry.example.com:5000/me/m:1.0", "registry.example.com:5000/me/m:1.0", "registry.example.com:5000/me/m:1.0"),
    ("zipmoe.local/library/m", "zipmoe.local/library/m:latest", "m:latest"),
])
def test_model_names(text: str, full: str, display: str) -> None:
    name = ModelName.parse(text)
    assert str(name) == full and name.display == display
    assert ModelName.parse(name.display) == name == ModelName.parse(str(name))


@pytest.mark.parametrize("text", ["", "a/b/c/d", "/abs/m", "m:", ":tag", "-m", "m:.x", "a b", "m@sha256:abc",
                                  "x" * 81, "../m", "m/../x", "ns//m", "m:t:u"])
def test_bad_model_names(text: str) -> None:
    with pytest.raises(models_name.InvalidNameError) as e:
        ModelName.parse(text)
    assert e.value.exit_code == 2 and "invalid model name" in str(e.value)


# ------------------------------------------------------------------------------------------ the commands


def test_create_list_show_cp_rm_prune(zipmoe: Callable[..., tuple[int, str, str]], store: Store, tiny_model: Path,
                                      tmp_path: Path) -> None:
    mf = modelfile(tmp_path, f"FROM {tiny_model}\nPARAMETER temperature 0.2\nPARAMETER stop <|end|>\n"
                             "SYSTEM You are terse.\nLICENSE MIT\n")
    code, out, err = zipmoe("create", "tiny", "-f", mf, "--chunk-size", "300", "--threads", "2")
    assert code == 0 and "converted" in out and "created tiny:latest" in out, (out, err)
    assert err == ""  # no progress bars when stderr is not a terminal

    code, out, _ = zipmoe("list")
    assert code == 0 and out.splitlines()[0].split() == ["NAME", "ID", "SIZE", "MODIFIED"]
    assert "tiny:latest" in out and "just now" in out
    code, out, _ = zipmoe("list", "--json")
    [entry] = json.loads(out)["models"]
    assert entry["name"] == "tiny:latest" and entry["full_name"] == "zipmoe.local/library/tiny:latest"
    assert len(entry["id"]) == 12 and entry["size"] > 0 and entry["problem"] is None

    code, out, _ = zipmoe("show", "tiny")
    assert code == 0
    for fragment in ("Model", "qwen3moe", "experts", "8, 2 used per token", "of the BF16 source", "Parameters",
                     "temperature", '"<|end|>"', "System", "You are terse.", "License", "MIT"):
        assert fragment in out, out
    code, out, _ = zipmoe("show", "tiny", "--json")
    shown = json.loads(out)
    assert shown["id"] == entry["id"] and shown["parameters"] == {"temperature": 0.2, "stop": ["<|end|>"]}
    assert shown["config"]["zipmoe"]["chunk_size"] == 300 and shown["config"]["architecture"] == "qwen3moe"
    assert shown["config"]["zipmoe"]["source"]["sha256"] == sha256(tiny_model)
    code, out, _ = zipmoe("show", "tiny", "--parameters")
    assert out.split() == ["temperature", "0.2", "stop", '"<|end|>"']
    code, out, _ = zipmoe("show", "tiny", "--system")
    assert out == "You are terse.\n"  # the output ends with a newline, as every other's

    # show --modelfile gives a Modelfile that creates the same model again (FROM the stored blob)
    code, out, _ = zipmoe("show", "tiny", "--modelfile")
    assert out.startswith('# Modelfile generated by "zipmoe show"') and "FROM tiny:latest" in out
    again = modelfile(tmp_path, out, "Modelfile.again")
    code, out, _ = zipmoe("create", "tiny-again", "-f", again)
    assert code == 0 and "already in the store" in out
    assert store.open("tiny-again").digest == store.open("tiny").digest

    code, out, _ = zipmoe("cp", "tiny", "me/tiny:backup")
    assert code == 0 and "me/tiny:backup" in out
    assert {e.name.display for e in store.list_models()} == {"tiny:latest", "tiny-again:latest", "me/tiny:backup"}
    blobs = blob_files(store)

    code, out, _ = zipmoe("rm", "tiny", "tiny-again")
    assert code == 0 and out.count("deleted") == 2
    assert blob_files(store) == blobs  # me/tiny:backup still uses every blob
    code, out, _ = zipmoe("rm", "me/tiny:backup")
    assert code == 0 and "freed" in out and blob_files(store) == {}
    assert not (store.manifests_dir / "zipmoe.local").exists()  # empty directories go too

    code, _, err = zipmoe("rm", "tiny")
    assert code == 2  # no such model: bad input, as a missing file (pyzipmoe.errors.EXIT_STATUSES)
    one_line_error(err, "model 'tiny:latest' not found")
    code, out, _ = zipmoe("prune")
    assert code == 0 and "removed 0 unreferenced blobs" in out


def test_layout_is_ollamas_with_zipmoe_media_types(store: Store, tiny_model: Path, tmp_path: Path) -> None:
    store.create("me/tiny:v1", f"FROM {tiny_model}\nTEMPLATE {{{{ messages }}}}\nSYSTEM s\nMESSAGE user hi\n"
                               "LICENSE MIT\nPARAMETER seed 3\n", base_dir=tmp_path)
    path = store.root / "manifests" / "zipmoe.local" / "me" / "tiny" / "v1"
    manifest = json.loads(path.read_bytes())
    assert manifest["schemaVersion"] == 2
    assert manifest["mediaType"] == "application/vnd.docker.distribution.manifest.v2+json"
    assert manifest["config"]["mediaType"] == models_manifest.MEDIA_CONFIG
    types = [x["mediaType"] for x in manifest["layers"]]
    assert types == [models_manifest.MEDIA_MODEL, models_manifest.MEDIA_TEMPLATE, models_manifest.MEDIA_SYSTEM, models_manifest.MEDIA_LICENSE, models_manifest.MEDIA_MESSAGES, models_manifest.MEDIA_PARAMS]
    for layer in [manifest["config"], *manifest["layers"]]:
        assert not layer["mediaType"].startswith("application/vnd.ollama.image.")
        blob = store.root / "blobs" / layer["digest"].replace(":", "-")
        assert blob.stat().st_size == layer["size"] and "sha256:" + sha256(blob) == layer["digest"]
    model = store.root / "blobs" / manifest["layers"][0]["digest"].replace(":", "-")
    assert model.read_bytes()[:4] == b"GGUF"
    assert json.loads((store.root / "blobs" / manifest["layers"][-1]["digest"].replace(":", "-")).read_bytes()) == {
        "seed": 3}
    assert [p.name for p in store.tmp_dir.iterdir()] == []  # the job cleaned up after itself


def test_second_create_stores_no_new_model_blob(store: Store, tiny_model: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    first = store.create("a", f"FROM {tiny_model}\nSYSTEM one\n", base_dir=tmp_path, threads=2)
    assert first.converted and not first.model_reused and first.new_blobs == 3  # model, config, system
    before = blob_files(store)
    from pyzipmoe.file import convert

    def no_conversion(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the source was converted again")

    monkeypatch.setattr(convert, "convert", no_conversion)
    second = store.create("b", f"FROM {tiny_model}\nSYSTEM two\n", base_dir=tmp_path)
    assert second.model_reused and not second.converted and second.model_digest == first.model_digest
    after = blob_files(store)
    assert {k: v for k, v in after.items() if k in before} == before  # nothing rewritten
    assert len(after) == len(before) + 1  # only the new system prompt
    # other codec settings are another conversion
    monkeypatch.undo()
    third = store.create("c", f"FROM {tiny_model}\n", base_dir=tmp_path, codec="zstd", chunk_n=1000)
    assert third.converted and third.model_digest != first.model_digest
    assert_consistent(store)


def test_a_changed_source_is_converted_again(store: Store, tiny_model: Path, tmp_path: Path,
                                             copy_of: Callable[[Path], Path],
                                             flip_bit: Callable[[Path, int], None]) -> None:
    """The sha256 of a FROM file is remembered with its stat: a write to the file makes it count again."""
    source = copy_of(tiny_model)
    first = store.create("a", f"FROM {source}", base_dir=tmp_path)
    assert store.create("b", f"FROM {source}", base_dir=tmp_path).model_reused
    flip_bit(source, source.stat().st_size - 100)  # the last tensor's data
    third = store.create("c", f"FROM {source}", base_dir=tmp_path)
    assert third.converted and third.model_digest != first.model_digest
    source.unlink()
    store.prune()
    assert not list((store.state_dir / "sources").iterdir())


def test_create_from_a_zipmoe_gguf_stores_it_as_is(store: Store, zipmoe_model: Path, tmp_path: Path) -> None:
    report = store.create("z", f"FROM {zipmoe_model}", base_dir=tmp_path)
    assert not report.converted and report.model_digest == "sha256:" + sha256(zipmoe_model)
    assert store.open("z").model_path.read_bytes() == zipmoe_model.read_bytes()
    assert store.create("z2", f"FROM {zipmoe_model}", base_dir=tmp_path).model_reused


def test_create_from_a_quantized_gguf_stores_it_as_is(store: Store, typed_models: dict[str, Path],
                                                       tmp_path: Path) -> None:
    """FROM a GGUF whose experts are quantized (Q4_K_M mixes Q4_K and Q6_K) keeps the file as it is (conversion
    would save them 0.5-4%; the runtime serves a plain GGUF's experts from its cache under a budget); FROM an F16
    one converts it, as a BF16 one."""
    source = typed_models["Q4_K_M"]
    report = store.create("q4", f"FROM {source}", base_dir=tmp_path)
    assert not report.converted and report.model_digest == "sha256:" + sha256(source)
    package = store.open("q4")
    assert package.model_path.read_bytes() == source.read_bytes()
    assert package.config["file_type"] == "plain" and package.config["zipmoe"] is None
    assert package.config["expert_types"] == ["Q4_K", "Q6_K"], package.config
    report = store.create("f16", f"FROM {typed_models['F16']}", base_dir=tmp_path)
    assert report.converted and store.open("f16").config["expert_types"] == ["F16"]


def test_create_from_a_stored_model_inherits(store: Store, tiny_model: Path, tmp_path: Path) -> None:
    store.create("base", f"FROM {tiny_model}\nPARAMETER temperature 0.5\nPARAMETER num_ctx 256\nSYSTEM old\n"
                         "MESSAGE user hi\nLICENSE MIT\n", base_dir=tmp_path)
    report = store.create("derived", "FROM base\nPARAMETER temperature 0.1\nSYSTEM new\n", base_dir=tmp_path)
    assert report.model_reused and report.source == "base:latest"
    derived, base = store.open("derived"), store.open("base")
    assert derived.manifest.model == base.manifest.model and derived.config == base.config
    assert dict(derived.parameters) == {"temperature": 0.1, "num_ctx": 256}
    assert (derived.system, derived.messages, derived.license) == ("new", (Message("user", "hi"),), ("MIT",))


def test_relative_from_is_relative_to_the_modelfile(zipmoe: Callable[..., tuple[int, str, str]], store: Store,
                                                    tiny_model: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "weights.gguf").symlink_to(tiny_model)
    modelfile(tmp_path / "dir", "FROM ./weights.gguf\n")
    monkeypatch.chdir(tmp_path)
    code, _, err = zipmoe("create", "rel", "-f", "dir/Modelfile")
    assert code == 0, err


def test_create_errors_are_one_line(zipmoe: Callable[..., tuple[int, str, str]], store: Store, tmp_path: Path,
                                    non_moe_gguf: Path) -> None:
    code, _, err = zipmoe("create", "m", "-f", tmp_path / "missing")
    assert code == 2
    one_line_error(err, "missing: no such file")
    code, _, err = zipmoe("create", "m", "-f", modelfile(tmp_path, "FROM nope.gguf\n"))
    assert code == 2
    one_line_error(err, f"Modelfile, line 1: FROM nope.gguf: no such file ({tmp_path / 'nope.gguf'}), and no model "
                        "'nope.gguf:latest'")
    code, _, err = zipmoe("create", "m", "-f", modelfile(tmp_path, "# x\nFROM /nope/x.gguf\n"))
    one_line_error(err, "line 2: FROM /nope/x.gguf: no such file")
    code, _, err = zipmoe("create", "m", "-f", modelfile(tmp_path, f"FROM {non_moe_gguf}\n"))
    assert code == 2
    one_line_error(err, "not a MoE model")
    code, _, err = zipmoe("create", "m", "-f", modelfile(tmp_path, "FROM x\nPARAMETER top_k many\n"))
    assert code == 2
    one_line_error(err, "Modelfile, line 2: PARAMETER top_k 'many' is not a whole number")
    code, _, err = zipmoe("create", "bad name", "-f", modelfile(tmp_path, "FROM x\n"))
    assert code == 2
    one_line_error(err, "invalid model name")
    code, _, err = zipmoe("create", "m", "-f", modelfile(tmp_path, "FROM x\n"), "--codec", "huff", "--level", "3")
    one_line_error(err, "zstd codec only")
    assert store.list_models() == [] and not list(store.tmp_dir.glob("job-*"))


def test_create_from_a_fifo_is_refused_without_blocking(zipmoe: Callable[..., tuple[int, str, str]], store: Store,
                                                        tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe.gguf")
    result: list[tuple[int, str, str]] = []
    t = threading.Thread(target=lambda: result.append(zipmoe("create", "m", "-f",
                                                             modelfile(tmp_path, "FROM pipe.gguf\n"))), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # let the old code's open() return, so that the thread ends
        os.close(os.open(tmp_path / "pipe.gguf", os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
        pytest.fail("create blocked on a FIFO named by FROM")
    code, _, err = result[0]
    assert code == 2
    one_line_error(err, "FROM pipe.gguf", "is not a regular file")
    assert store.list_models() == [] and not list(store.tmp_dir.glob("job-*"))


def test_create_from_stdin(zipmoe: Callable[..., tuple[int, str, str]], store: Store, tiny_model: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(f"FROM {tiny_model}\nPARAMETER num_ctx 64\n"))
    code, out, err = zipmoe("create", "piped", "-f", "-", "--quiet")
    assert code == 0 and out == "", err
    assert store.open("piped").parameters == {"num_ctx": 64}


def test_help_teaches(zipmoe: Callable[..., tuple[int, str, str]]) -> None:
    for command in ("create", "list", "show", "cp", "rm", "prune", "export", "import"):
        code, out, _ = zipmoe(command, "--help")
        assert code == 0 and "examples:" in out and "exit status:" in out and "missing, damaged" in out, command
    code, out, _ = zipmoe("--help")
    for command in ("create", "list", "show", "cp", "rm", "prune", "export", "import"):
        assert command in out


# ------------------------------------------------------------------------------------------ export / import


def test_export_import_round_trip(zipmoe: Callable[..., tuple[int, str, str]], store: Store, tiny_model: Path,
                                  tmp_path: Path) -> None:
    store.create("m:v1", f"FROM {tiny_model}\nSYSTEM hello\nPARAMETER temperature 0\n", base_dir=tmp_path)
    original = store.open("m:v1")
    tar_path = tmp_path / "m.tar"
    code, out, err = zipmoe("export", "m:v1", tar_path)
    assert code == 0 and "exported m:v1" in out, err
    with tarfile.open(tar_path) as tar:
        names = tar.getnames()
    assert names[0] == "manifests/zipmoe.local/library/m/v1"
    assert sorted(names[1:]) == sorted(f"blobs/{x.digest.replace(':', '-')}" for x in original.manifest.blobs)

    other = tmp_path / "other-store"
    code, out, err = zipmoe("import", tar_path, "--models", other)
    assert code == 0 and "imported m:v1" in out and "4 new blobs" in out, (out, err)
    copy = Store(other).open("m:v1", full_check=True)
    assert copy.digest == original.digest and copy.system == "hello"

    code, out, _ = zipmoe("import", tar_path, "renamed:x", "--models", other)
    assert code == 0 and "imported renamed:x" in out and "0 new blobs" in out
    assert Store(other).open("renamed:x").digest == original.digest

    assert zipmoe("rm", "m:v1")[0] == 0 and blob_files(store) == {}
    assert zipmoe("import", tar_path)[0] == 0
    assert store.open("m:v1", full_check=True).digest == original.digest
    assert_consistent(store)


def test_import_refuses_a_damaged_archive(store: Store, tiny_model: Path, tmp_path: Path,
                                          flip_bit: Callable[[Path, int], None]) -> None:
    store.create("m", f"FROM {tiny_model}", base_dir=tmp_path)
    tar_path = tmp_path / "m.tar"
    store.export("m", tar_path)
    flip_bit(tar_path, tar_path.stat().st_size // 2)  # inside the model blob, the largest member
    fresh = Store(tmp_path / "fresh")
    with pytest.raises(BlobError, match="does not match its sha256.*damaged"):
        fresh.import_(tar_path)
    assert fresh.list_models() == [] and blob_files(fresh) == {} and not list(fresh.tmp_dir.iterdir())
    (tmp_path / "junk.tar").write_bytes(b"not a tar file at all" * 100)
    with pytest.raises(StoreError, match="not a tar file"):
        fresh.import_(tmp_path / "junk.tar")
    with tarfile.open(tmp_path / "evil.tar", "w") as tar:
        info = tarfile.TarInfo("../escape")
        info.size = 1
        tar.addfile(info, __import__("io").BytesIO(b"x"))
    with pytest.raises(StoreError, match="unexpected entry"):
        fresh.import_(tmp_path / "evil.tar")


def test_export_refuses_a_damaged_blob(store: Store, tiny_model: Path, tmp_path: Path,
                                       flip_bit: Callable[[Path, int], None]) -> None:
    store.create("m", f"FROM {tiny_model}", base_dir=tmp_path)
    flip_bit(store.open("m").model_path, 5000)
    with pytest.raises(BlobError, match="model m:latest: its model blob .*sha256-.* is damaged"):
        store.export("m", tmp_path / "m.tar")
    assert not (tmp_path / "m.tar").exists() and not list(tmp_path.glob(".m.tar.*"))


# ------------------------------------------------------------------------------------------ corruption


def test_a_modified_blob_is_detected_before_use(zipmoe: Callable[..., tuple[int, str, str]], store: Store,
                                                tiny_model: Path, tmp_path: Path,
                                                flip_bit: Callable[[Path, int], None]) -> None:
    store.create("m", f"FROM {tiny_model}\nSYSTEM be nice\n", base_dir=tmp_path)
    pkg = store.open("m")
    flip_bit(pkg.model_path, pkg.model_path.stat().st_size // 2)
    with pytest.raises(BlobError) as e:
        store.open("m")
    assert f"model m:latest: its model blob {pkg.model_path} is damaged" in str(e.value)
    code, _, err = zipmoe("show", "m")
    assert code == 2
    one_line_error(err, "model m:latest", pkg.model_path.name, "damaged")
    with pytest.raises(BlobError):
        S.resolve_model("m", store=store)
    flip_bit(pkg.model_path, pkg.model_path.stat().st_size // 2)  # repaired
    assert store.open("m").model_path == pkg.model_path

    assert pkg.system_path is not None
    pkg.system_path.write_text("be evil")
    with pytest.raises(BlobError, match=f"model m:latest: its system blob {pkg.system_path} is damaged"):
        store.open("m")
    pkg.system_path.unlink()
    with pytest.raises(BlobError, match=f"its system blob {pkg.system_path.name} is missing"):
        store.open("m")


def test_full_check_finds_what_the_stat_cannot(store: Store, tiny_model: Path, tmp_path: Path,
                                               flip_bit: Callable[[Path, int], None]) -> None:
    """A media error changes no stat field; only a full hash (show --verify) finds it."""
    store.create("m", f"FROM {tiny_model}", base_dir=tmp_path)
    pkg = store.open("m")
    flip_bit(pkg.model_path, 1000)
    hex_ = pkg.manifest.model.hex
    store._stamp(hex_)  # as if the damage happened without any write through the file system
    assert store.open("m").model_path == pkg.model_path
    with pytest.raises(BlobError, match="damaged"):
        store.open("m", full_check=True)


def test_an_ollama_manifest_is_refused(store: Store) -> None:
    path = store.manifests_dir / "zipmoe.local" / "library" / "llama" / "latest"
    path.parent.mkdir(parents=True)
    layer = {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:" + "0" * 64, "size": 1}
    path.write_text(json.dumps({"schemaVersion": 2, "config": {**layer, "mediaType": "x"}, "layers": [layer]}))
    with pytest.raises(StoreError, match="an Ollama model"):
        store.open("llama")
    [entry] = store.list_models()
    assert "Ollama" in (entry.problem or "")
    with pytest.raises(StoreError, match="cannot tell which blobs"):
        store.prune()  # refuses to guess what an unreadable manifest uses


# ------------------------------------------------------------------------------------------ interruptions


def test_a_failing_create_leaves_the_store_consistent(store: Store, tiny_model: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    store.create("keep", f"FROM {tiny_model}\nSYSTEM keep\n", base_dir=tmp_path)
    real = models_blobs._atomic_file

    def failing(dst: Path) -> Any:
        if "manifests" in dst.parts:  # after the blobs are in place, before the manifest
            raise OSError(28, "No space left on device")
        return real(dst)

    monkeypatch.setattr(S, "_atomic_file", failing)
    with pytest.raises(OSError, match="No space left"):
        store.create("broken", f"FROM {tiny_model}\nSYSTEM broken\n", base_dir=tmp_path)
    monkeypatch.undo()
    assert [e.name.display for e in store.list_models()] == ["keep:latest"]
    assert_consistent(store)
    assert not list(store.tmp_dir.iterdir())
    report = store.prune()
    assert len(report.blobs) == 1 and report.jobs == 0  # the orphaned system prompt
    assert_consistent(store)


KILLED_CREATE = r"""
import pathlib, sys, time
from pyzipmoe.file import convert
from pyzipmoe.models import directory as S
root, src, stage, ready = sys.argv[1:5]

def hold():
    pathlib.Path(ready).touch()
    time.sleep(600)

if stage == "convert":
    real_convert = convert.convert
    def converting(*args, **kwargs):
        real_convert(*args, **kwargs)  # the converted model is in the job directory
        hold()
    convert.convert = converting
else:
    real_atomic = S._atomic_file
    def committing(dst):
        if "manifests" in dst.parts:  # under the store lock, the blobs in place, the manifest not yet written
            hold()
        return real_atomic(dst)
    S._atomic_file = committing
S.ModelDirectory(root).create("victim", f"FROM {src}\nSYSTEM victim\n", threads=2)
"""


@pytest.mark.parametrize("stage", ["convert", "commit"])
def test_a_killed_create_leaves_the_store_consistent(stage: str, store: Store, tiny_model: Path, zipmoe_model: Path,
                                                     tmp_path: Path) -> None:
    store.create("survivor", f"FROM {zipmoe_model}\nSYSTEM survivor\n", base_dir=tmp_path)
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CREATE, str(store.root), str(tiny_model), stage, str(ready)],
                            env=child_env(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert [e.name.display for e in store.list_models()] == ["survivor:latest"]
    assert_consistent(store)
    report = store.prune()  # the lock died with the process: prune does not wait
    assert report.jobs == 1
    assert len(report.blobs) == (3 if stage == "commit" else 0)  # converted model, config, system prompt
    assert not list(store.tmp_dir.iterdir())
    store.create("victim", f"FROM {tiny_model}\nSYSTEM victim\n", base_dir=tmp_path)
    assert_consistent(store)


# ------------------------------------------------------------------------------------------ concurrency


CONCURRENT_CREATE = r"""
import pathlib, sys, time
from pyzipmoe.models import directory as S
root, src, name, codec, go = sys.argv[1:6]
while not pathlib.Path(go).exists():
    time.sleep(0.005)
report = S.ModelDirectory(root).create(name, f"FROM {src}\nSYSTEM {name}\n", codec=codec, threads=1)
print(report.model_digest)
"""


def test_concurrent_creates_do_not_corrupt_the_store(store: Store, tiny_model: Path, tmp_path: Path) -> None:
    go = tmp_path / "go"
    jobs = [(f"m{i}", codec) for i, codec in enumerate(["huff", "huff", "huff", "zstd", "zstd"])]
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT_CREATE, str(store.root), str(tiny_model), name, codec,
                               str(go)], env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, codec in jobs]
    time.sleep(0.5)  # let them all start and wait at the line
    go.touch()
    results = [p.communicate(timeout=TIMEOUT) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    digests = [out.strip() for out, _ in results]
    assert len(set(digests[:3])) == 1 and len(set(digests[3:])) == 1 and digests[0] != digests[3]
    assert sorted(e.name.display for e in store.list_models()) == [f"m{i}:latest" for i in range(5)]
    assert_consistent(store)
    # stored once: 2 models, 2 configs (one per model), 5 system prompts
    assert len(blob_files(store)) == 2 + 2 + 5
    assert store.prune().blobs == () and not list(store.tmp_dir.iterdir())


def test_creates_while_pruning_and_removing(store: Store, tiny_model: Path, tmp_path: Path) -> None:
    store.create("m0", f"FROM {tiny_model}", base_dir=tmp_path)
    errors: list[BaseException] = []
    stop = threading.Event()

    def prune_and_remove() -> None:
        while not stop.is_set():
            try:
                store.prune()
                if store.exists("gone"):
                    store.remove("gone")
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

    def create(i: int) -> None:
        try:
            for j in range(3):
                store.create(f"m{i}-{j}", f"FROM {tiny_model}\nSYSTEM {i} {j}\n", base_dir=tmp_path, threads=1)
                store.create("gone", f"FROM {tiny_model}\nSYSTEM gone {i} {j}\n", base_dir=tmp_path, threads=1)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    pruner = threading.Thread(target=prune_and_remove)
    creators = [threading.Thread(target=create, args=(i,)) for i in range(3)]
    pruner.start()
    for t in creators:
        t.start()
    for t in creators:
        t.join(TIMEOUT)
    stop.set()
    pruner.join(TIMEOUT)
    assert not errors, errors
    assert_consistent(store)
    assert len([e for e in store.list_models() if e.name.model.startswith("m")]) == 10


# ------------------------------------------------------------------------------------------ using models


def test_resolve_model(store: Store, tiny_model: Path, tmp_path: Path) -> None:
    assert S.resolve_model(tiny_model, store=store) == (tiny_model, None)
    store.create("m", f"FROM {tiny_model}\nPARAMETER num_ctx 64\n", base_dir=tmp_path)
    path, pkg = S.resolve_model("m", store=store)
    assert pkg is not None and path == pkg.model_path and pkg.parameters == {"num_ctx": 64}
    with pytest.raises(ModelNotFoundError) as e:
        S.resolve_model("nope", store=store)
    assert e.value.exit_code == 2 and "no such file, and no model 'nope:latest'" in str(e.value)
    with pytest.raises(ZipmoeError) as e2:
        S.resolve_model(tmp_path / "x" / "missing.gguf", store=store)
    assert e2.value.exit_code == 2 and "no such file" in str(e2.value)


def test_package_arguments_for_llama_and_programs(store: Store, tiny_model: Path, tmp_path: Path) -> None:
    store.create("m", f"FROM {tiny_model}\nPARAMETER num_ctx 2048\nPARAMETER temperature 0.3\nPARAMETER top_k 5\n"
                      "PARAMETER stop A\nPARAMETER stop B\nPARAMETER seed 9\nPARAMETER num_predict -1\n"
                      "PARAMETER cache_mode none\nPARAMETER cache_policy lru\nPARAMETER memory_budget 1GiB\n"
                      "PARAMETER num_thread 3\n"
                      "SYSTEM sys\nTEMPLATE {{ messages }}\n", base_dir=tmp_path)
    pkg = store.open("m")
    assert pkg.llama_kwargs() == {"n_ctx": 2048, "seed": 9, "n_threads": 3, "n_threads_batch": 3,
                                  "zipmoe_cache": "none", "memory_budget": 1 << 30, "cache_policy": "lru"}
    assert pkg.sampling_kwargs() == {"temperature": 0.3, "top_k": 5, "stop": ["A", "B"], "seed": 9, "max_tokens": None}
    cli_args = pkg.llama_program_args("llama-cli")
    pairs = list(itertools.pairwise(cli_args))
    for pair in [("-c", "2048"), ("-t", "3"), ("-s", "9"), ("-n", "-1"), ("--temp", "0.3"), ("--top-k", "5"),
                 ("-r", "A"), ("-r", "B"), ("--chat-template-file", str(pkg.template_path))]:
        assert pair in pairs, (pair, cli_args)
    assert "--jinja" in cli_args and Path(cli_args[cli_args.index("-sysf") + 1]).read_text() == "sys"
    server_args = pkg.llama_program_args("llama-server")
    assert "-sysf" not in server_args and "--chat-template-file" in server_args
    assert {("-r", "A"), ("-r", "B")} <= set(itertools.pairwise(server_args))  # the server's default stop strings
    assert "--chat-template-file" not in pkg.llama_program_args("llama-server", template=False)
    assert pkg.environment() == {"ZIPMOE_CACHE": "none"}


def test_chat_messages_put_system_and_history_first() -> None:
    history = (Message("user", "hi"), Message("assistant", "hello"))
    user = [{"role": "user", "content": "and you?"}]
    assert models_package.chat_messages("sys", history, user) == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, *user]
    own = [{"role": "system", "content": "mine"}, *user]
    assert models_package.chat_messages("sys", (), own) == own  # the caller's own system prompt wins
    assert models_package.chat_messages(None, (), user) == user


class FakeLlama:
    """Just what apply_package touches, with llama_cpp.Llama's defaults for the arguments it fills in."""

    def __init__(self, model_path: str, n_ctx: int = 512, seed: int = -1, **kwargs: Any):
        self.model_path, self.n_ctx, self.seed, self.kwargs = model_path, n_ctx, seed, kwargs
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def create_completion(self, prompt: str, suffix: str | None = None, max_tokens: int | None = 16,
                          temperature: float = 0.8, top_k: int = 40, stop: list[str] | None = None,
                          seed: int | None = None) -> Any:
        self.calls.append(("completion", {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                                          "top_k": top_k, "stop": stop, "seed": seed}))
        return "text"

    def create_chat_completion(self, messages: list[dict[str, str]], temperature: float = 0.2, top_k: int = 40,
                               stop: list[str] | None = None, seed: int | None = None,
                               max_tokens: int | None = None) -> Any:
        self.calls.append(("chat", {"messages": messages, "temperature": temperature, "top_k": top_k, "stop": stop}))
        return "reply"

    def __call__(self, prompt: str, **kwargs: Any) -> Any:
        return self.create_completion(prompt, **kwargs)


def test_llama_from_store_applies_the_package(store: Store, tiny_model: Path, tmp_path: Path) -> None:
    store.create("m", f"FROM {tiny_model}\nPARAMETER num_ctx 64\nPARAMETER temperature 0\nPARAMETER stop END\n"
                      "PARAMETER memory_budget 2GiB\nSYSTEM sys\nMESSAGE user hi\n", base_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = S.llama_from_store("m", llama_class=FakeLlama, zipmoe_models=store.root, seed=5)
    assert [str(w.message) for w in caught] == [
        "m:latest: PARAMETER memory_budget is not supported by this FakeLlama; it is ignored"]
    assert llm.n_ctx == 64 and llm.seed == 5 and "memory_budget" not in llm.kwargs  # seed: the caller's
    assert llm.model_path == str(store.open("m").model_path) and llm.zipmoe_package.name.model == "m"
    llm("once", max_tokens=3)
    llm.create_completion("twice", None, 4, 0.9)  # positional arguments count as given
    llm.create_chat_completion([{"role": "user", "content": "q"}], top_k=1)
    assert llm.calls == [
        ("completion", {"prompt": "once", "max_tokens": 3, "temperature": 0, "top_k": 40, "stop": ["END"],
                        "seed": None}),
        ("completion", {"prompt": "twice", "max_tokens": 4, "temperature": 0.9, "top_k": 40, "stop": ["END"],
                        "seed": None}),
        ("chat", {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                               {"role": "user", "content": "q"}], "temperature": 0, "top_k": 1, "stop": ["END"]}),
    ]
    with pytest.raises(ModelNotFoundError):
        S.llama_from_store("absent", llama_class=FakeLlama, zipmoe_models=store.root)


# ------------------------------------------------------------------------------------------ running (llama.cpp)


GREEDY = r"""
import json, sys
import numpy as np
import pyzipmoe  # points llama_cpp at zipmoe's libllama
import llama_cpp
from pyzipmoe.runtime.llama import last_logits
from pyzipmoe.models.directory import llama_from_store

job = json.loads(sys.argv[1])
llm = llama_from_store(job["name"], zipmoe_models=job["root"], verbose=False, n_threads=1)
ref = llama_cpp.Llama(job["bf16"], n_ctx=job["n_ctx"], n_threads=1, verbose=False)

def greedy(model):
    tokens = model.tokenize(job["prompt"].encode())
    model.reset()
    model.eval(tokens)
    out = []
    for _ in range(job["n"]):
        out.append(int(np.argmax(last_logits(model))))
        model.eval([out[-1]])
    return out

result = {"ours": greedy(llm), "bf16": greedy(ref), "is_zipmoe": llm.is_zipmoe, "n_ctx": llm.context_params.n_ctx,
          # no temperature given: the package's (0) applies
          "text": llm.create_completion(job["prompt"], max_tokens=job["n"])["choices"][0]["text"],
          "text_bf16": ref.create_completion(job["prompt"], max_tokens=job["n"], temperature=0)["choices"][0]["text"],
          "chat": llm.create_chat_completion([{"role": "user", "content": "hello"}], max_tokens=4)["choices"][0]}
llm.close()
ref.close()
print(json.dumps(result))
"""


def test_run_store_model_greedy_tokens_match_bf16(store: Store, tiny_model: Path, tmp_path: Path) -> None:
    lib_dir = llama_bin_dir()
    store.create("tiny-chat", f"FROM {tiny_model}\nPARAMETER temperature 0\nPARAMETER num_ctx 128\n"
                              "PARAMETER seed 1\nSYSTEM You are a test.\n"
                              'TEMPLATE """{% for m in messages %}{{ m.role }}: {{ m.content }}\n'
                              '{% endfor %}assistant:"""\n', base_dir=tmp_path, chunk_n=300, threads=2)
    job = {"name": "tiny-chat", "root": str(store.root), "bf16": str(tiny_model), "n_ctx": 128, "n": 12,
           "prompt": "the expert model said hello to the world of water and time"}
    env = child_env()
    env["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    env["LD_LIBRARY_PATH"] = library_path(lib_dir, env)
    done = subprocess.run([sys.executable, "-c", GREEDY, json.dumps(job)], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["is_zipmoe"] and result["n_ctx"] == 128
    assert len(result["ours"]) == 12 and result["ours"] == result["bf16"]
    assert result["text"] == result["text_bf16"]
    assert result["chat"]["message"]["role"] == "assistant"
