"""`zipmoe import` of hostile archives: all or nothing, never a model it was not asked for, bounded in what it
reads, writes and inflates; and a seeded archive fuzzer that holds those properties over hundreds of archives."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import json
import lzma
import os
import random
import resource
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pyzipmoe import cli
from pyzipmoe.errors import ZipmoeError
from pyzipmoe.models import blobs as models_blobs
from pyzipmoe.models import directory as models_directory
from pyzipmoe.models import transfer
from pyzipmoe.models.directory import ModelDirectory as Store
from pyzipmoe.models.manifest import MEDIA_CONFIG, MEDIA_MODEL, MEDIA_PARAMS

MANIFEST_DIR = "manifests/zipmoe.local/library"


# ------------------------------------------------------------------------------------------ helpers


@pytest.fixture
def exported(tiny_model: Path, tmp_path: Path) -> dict[str, Any]:
    """A store holding `victim` and `m`, and m's export (members as (name, bytes), in export's order)."""
    store = Store(tmp_path / "models")
    store.create("victim", f"FROM {tiny_model}\nSYSTEM i am the victim\n", base_dir=tmp_path)
    store.create("m", f"FROM {tiny_model}\nSYSTEM i am m\nPARAMETER temperature 0\n", base_dir=tmp_path)
    tar_path = tmp_path / "m.tar"
    store.export("m", tar_path)
    with tarfile.open(tar_path) as tar:
        members = [(x.name, tar.extractfile(x).read()) for x in tar]  # type: ignore[union-attr]
    return {"store": store, "tar": tar_path, "members": members}


def write_tar(path: Path, members: list[Any], compress: str = "") -> Path:
    """members: (name, bytes) or TarInfo-with-data tuples (info, bytes)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for m in members:
            if isinstance(m[0], tarfile.TarInfo):
                info, data = m
                tar.addfile(info, io.BytesIO(data) if data is not None else None)
            else:
                info = tarfile.TarInfo(m[0])
                info.size = len(m[1])
                tar.addfile(info, io.BytesIO(m[1]))
    raw = buf.getvalue()
    raw = {"": lambda b: b, "gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}[compress](raw)
    path.write_bytes(raw)
    return path


def snapshot(store: Store) -> dict[str, Any]:
    """Every file of the store but its state directory: name -> bytes (manifests) or inode (blobs)."""
    out: dict[str, Any] = {}
    for p in sorted(store.root.rglob("*")):
        rel = p.relative_to(store.root)
        if rel.parts[0] == ".state" or p.is_dir():
            continue
        out[str(rel)] = p.read_bytes() if rel.parts[0] == "manifests" else p.stat().st_ino
    return out


def manifest_of(members: list[tuple[str, bytes]]) -> dict[str, Any]:
    return json.loads(members[0][1])


def with_manifest(members: list[tuple[str, bytes]], obj: dict[str, Any], name: str | None = None) -> list[Any]:
    return [(name or members[0][0], json.dumps(obj).encode()), *members[1:]]


def blob_member(data: bytes) -> tuple[str, bytes]:
    return f"blobs/sha256-{hashlib.sha256(data).hexdigest()}", data


def refused(store: Store, path: Path, *fragments: str, name: str | None = None, **kw: Any) -> str:
    before = snapshot(store)
    with pytest.raises(ZipmoeError) as e:
        store.import_(path, name, **kw)
    for fragment in fragments:
        assert fragment in str(e.value), str(e.value)
    assert snapshot(store) == before
    assert not [p for p in store.tmp_dir.iterdir()], list(store.tmp_dir.iterdir())
    return str(e.value)


# ------------------------------------------------------------------------------------------ regressions


def test_an_extra_manifest_never_replaces_another_model(exported: dict[str, Any], tmp_path: Path) -> None:
    store, members = exported["store"], exported["members"]
    evil = write_tar(tmp_path / "evil.tar", [*members, (f"{MANIFEST_DIR}/victim/latest", members[0][1])])
    store.remove("m")
    refused(store, evil, "more than one manifest")
    assert store.open("victim").system == "i am the victim"
    fresh = Store(tmp_path / "fresh")  # blobs not in the store: was committed half way, then failed
    refused(fresh, evil, "more than one manifest")
    assert fresh.list_models() == []


def test_a_name_that_exists_is_refused_unless_forced(exported: dict[str, Any], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    store, tar_path = exported["store"], exported["tar"]
    message = refused(store, tar_path, "model m:latest exists", "--force")
    refused(store, tar_path, "model victim:latest exists", name="victim")
    assert store.open("victim").system == "i am the victim" and "\n" not in message
    code = cli.main(["import", str(tar_path), "victim", "--models", str(store.root)])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "exists" in err and "Traceback" not in err, err
    code = cli.main(["import", str(tar_path), "victim", "--force", "--models", str(store.root)])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "adding victim:latest (replacing it): 0 new blobs (0 B)" and "imported victim" in lines[1], out
    assert store.open("victim").system == "i am m"


def test_the_plan_is_printed_before_the_commit(exported: dict[str, Any], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other"
    seen: list[Any] = []

    def announce(plan: Any) -> None:
        seen.append((plan, Store(other).exists("m")))

    Store(other).import_(exported["tar"], announce=announce)
    (plan, existed), = seen
    assert not existed and plan.name == "m:latest" and not plan.replaces and plan.new_blobs == 4
    assert plan.new_bytes == sum(len(d) for n, d in exported["members"][1:])


def test_blobs_are_checked_against_the_manifest_before_they_are_written(exported: dict[str, Any],
                                                                        tmp_path: Path) -> None:
    members = exported["members"]
    fresh = Store(tmp_path / "fresh")
    junk = blob_member(b"x" * 1000)
    refused(fresh, write_tar(tmp_path / "a.tar", [*members, junk]), "not a blob of")
    refused(fresh, write_tar(tmp_path / "b.tar", [members[1], *members[:1], *members[2:]]), "before the manifest")
    refused(fresh, write_tar(tmp_path / "c.tar", [*members, members[1]]), "appears twice")
    name, data = members[-1]
    refused(fresh, write_tar(tmp_path / "d.tar", [*members[:-1], (name, data + b"more")]), "the manifest says")


def test_a_member_larger_than_the_free_disk_is_refused_before_a_byte_is_written(
        exported: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = Store(tmp_path / "fresh")
    monkeypatch.setattr(transfer, "DISK_RESERVE", 1 << 62, raising=False)
    written: list[int] = []
    original = models_blobs.Job.stage_chunks
    monkeypatch.setattr(models_blobs.Job, "stage_chunks",
                        lambda self, chunks, *a: written.append(1) or original(self, chunks, *a))
    refused(fresh, exported["tar"], "are free in")
    assert written == []


def test_a_compressed_bomb_is_refused_while_it_inflates(exported: dict[str, Any], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    members = exported["members"]
    fresh = Store(tmp_path / "fresh")
    for kind in ("gz", "bz2", "xz"):  # valid compressed exports still import
        assert Store(tmp_path / f"ok-{kind}").import_(write_tar(tmp_path / f"m.tar.{kind}", members, kind)).names
    monkeypatch.setattr(transfer, "RATIO_SLACK", 1 << 20, raising=False)
    zeros = bytes(64 << 20)
    obj = manifest_of(members)
    obj["layers"] = [x for x in obj["layers"] if x["mediaType"] != MEDIA_MODEL]
    obj["layers"].append({"mediaType": MEDIA_MODEL, "digest": "sha256:" + hashlib.sha256(zeros).hexdigest(),
                          "size": len(zeros)})
    for kind in ("gz", "bz2", "xz"):
        bomb = write_tar(tmp_path / f"bomb.tar.{kind}", [with_manifest(members, obj)[0], blob_member(zeros)], kind)
        assert bomb.stat().st_size < 1 << 20
        refused(fresh, bomb, "inflates to more than")


def test_sparse_and_special_members_are_refused(exported: dict[str, Any], tmp_path: Path) -> None:
    members = exported["members"]
    fresh = Store(tmp_path / "fresh")
    name, data = members[-1]
    sparse = tarfile.TarInfo(name)
    sparse.size = 10
    sparse.pax_headers = {"GNU.sparse.map": "0,10", "GNU.sparse.size": str(len(data)), "GNU.sparse.name": name}
    refused(fresh, write_tar(tmp_path / "s.tar", [*members[:-1], (sparse, b"0123456789")]), "not a plain file")
    for kind in (tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.FIFOTYPE, tarfile.CHRTYPE):
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, "/etc/passwd"
        refused(fresh, write_tar(tmp_path / "t.tar", [*members[:-1], (info, None)]), "not a plain file")
    assert not (fresh.root / "etc").exists()


def test_headers_and_entries_are_bounded(exported: dict[str, Any], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    members = exported["members"]
    fresh = Store(tmp_path / "fresh")
    info = tarfile.TarInfo(members[1][0])
    info.size = len(members[1][1])
    info.pax_headers = {"comment": "x" * (2 << 20)}
    refused(fresh, write_tar(tmp_path / "pax.tar", [members[0], (info, members[1][1]), *members[2:]]),
            "tar header larger than")
    monkeypatch.setattr(transfer, "MAX_MEMBERS", 50, raising=False)
    dirs = []
    for i in range(60):
        d = tarfile.TarInfo(f"d{i}")
        d.type = tarfile.DIRTYPE
        dirs.append((d, None))
    refused(fresh, write_tar(tmp_path / "many.tar", [*dirs, *members]), "more than 50 entries")


def test_small_blobs_are_read_through_the_capped_reader(exported: dict[str, Any], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest whose config (or parameters) digest names the installed model blob: refused by its size, never
    read whole."""
    store, members = exported["store"], exported["members"]
    model = store.open("m").manifest.model
    monkeypatch.setattr(transfer, "SMALL_BLOB_MAX", model.size - 1)
    monkeypatch.setattr(models_directory, "SMALL_BLOB_MAX", model.size - 1)
    for key in ("config", "parameters"):
        obj = manifest_of(members)
        big = {"mediaType": MEDIA_CONFIG, "digest": model.digest, "size": model.size}
        if key == "config":
            obj["config"] = big
        else:
            obj["layers"].append({**big, "mediaType": MEDIA_PARAMS})
        refused(store, write_tar(tmp_path / "c.tar", with_manifest(members, obj)[:1]), "too large", name="new")


def test_deeply_nested_json_is_an_error_not_a_traceback(exported: dict[str, Any], tmp_path: Path) -> None:
    members = exported["members"]
    fresh = Store(tmp_path / "fresh")
    deep = b"[" * 200_000 + b"]" * 200_000
    refused(fresh, write_tar(tmp_path / "m.tar", [(members[0][0], b'{"schemaVersion": 2, "config": ' + deep + b"}")]),
            "not a valid manifest")
    obj = manifest_of(members)
    obj["layers"].append({"mediaType": MEDIA_PARAMS, "digest": "sha256:" + hashlib.sha256(deep).hexdigest(),
                          "size": len(deep)})
    refused(fresh, write_tar(tmp_path / "p.tar", [*with_manifest(members, obj), blob_member(deep)]), "not JSON")


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "archive.tar"
    os.mkfifo(fifo)
    result: list[BaseException | None] = []

    def run() -> None:
        try:
            Store(tmp_path / "s").import_(fifo)
            result.append(None)
        except BaseException as e:  # noqa: BLE001
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # unblock the old code's open() so that the thread ends
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(10)
        pytest.fail("import blocked on a FIFO")
    assert isinstance(result[0], ZipmoeError) and "not a regular file" in str(result[0]), result


# ------------------------------------------------------------------------------------------ the fuzzer


FUZZ_ARCHIVES = int(os.environ.get("ZIPMOE_IMPORT_FUZZ", "320"))


def _mutate(rng: random.Random, members: list[tuple[str, bytes]], victim: dict[str, Any],
            installed: list[tuple[str, int]]) -> tuple[list[Any], str, str | None, bool]:
    """One hostile archive: (members, compression, NAME or None, --force)."""
    ms: list[Any] = list(members)
    obj = manifest_of(members)
    ops = rng.sample(range(14), rng.randint(1, 3))
    for op in ops:
        if op == 0:  # rename a member
            i = rng.randrange(len(ms))
            name = rng.choice(["../x", "/abs/x", "blobs/../manifests/x", "blobs/sha256-zz", "a/b/c/d/e/f",
                               f"{MANIFEST_DIR}/victim/latest", f"{MANIFEST_DIR}/Bad Name/x", "blobs/",
                               "manifests/h/n/m", "x" * 300, "blobs/sha256-" + "0" * 64, "./blobs/a"])
            ms[i] = (name, ms[i][1]) if not isinstance(ms[i][0], tarfile.TarInfo) else ms[i]
        elif op == 1:  # change a member's type
            i = rng.randrange(len(ms))
            name = ms[i][0] if isinstance(ms[i][0], str) else ms[i][0].name
            info = tarfile.TarInfo(name)
            info.type = rng.choice([tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.FIFOTYPE, tarfile.CHRTYPE,
                                    tarfile.BLKTYPE, tarfile.DIRTYPE, tarfile.CONTTYPE])
            info.linkname = rng.choice(["/etc/passwd", "../../victim", "blobs/x"])
            data = ms[i][1] if info.type == tarfile.CONTTYPE else None
            if data is not None:
                info.size = len(data)
            ms[i] = (info, data)
        elif op == 2:  # truncate or extend a blob
            i = rng.randrange(1, len(ms))
            if isinstance(ms[i][0], str):
                data = ms[i][1]
                ms[i] = (ms[i][0], data[:rng.randrange(len(data) + 1)] if rng.random() < 0.5
                         else data + bytes(rng.randrange(1, 5000)))
        elif op == 3:  # flip bytes of a member
            i = rng.randrange(len(ms))
            if isinstance(ms[i][0], str) and ms[i][1]:
                data = bytearray(ms[i][1])
                for _ in range(rng.randint(1, 4)):
                    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
                ms[i] = (ms[i][0], bytes(data))
        elif op == 4:  # a duplicate manifest
            ms.insert(rng.randrange(len(ms) + 1), ms[0])
        elif op == 5:  # an extra manifest for the victim, with m's or the victim's blobs
            ms.insert(rng.randrange(1, len(ms) + 1), (f"{MANIFEST_DIR}/victim/latest",
                                                      json.dumps(rng.choice([obj, victim])).encode()))
        elif op == 6:  # the manifest's digests point at installed blobs (the victim's, any size)
            digest, size = rng.choice(installed)
            key = rng.choice(["config", 0, -1])
            layer = {"mediaType": MEDIA_CONFIG if key == "config" else rng.choice([MEDIA_PARAMS, MEDIA_MODEL]),
                     "digest": digest, "size": rng.choice([size, size + 1, 1 << 40])}
            if key == "config":
                obj["config"] = layer
            else:
                obj["layers"][key] = layer
            ms = with_manifest(ms, obj)
        elif op == 7:  # duplicate or extra blob members
            if rng.random() < 0.5:
                ms.append(ms[rng.randrange(1, len(ms))])
            else:
                ms.append(blob_member(rng.randbytes(rng.randrange(0, 4096))))
        elif op == 8:  # garbage as the model blob, with a manifest that agrees
            data = rng.choice([rng.randbytes(rng.randrange(0, 20000)), members[-1][1][:rng.randrange(1, 20000)],
                               b"GGUF" + rng.randbytes(100)])
            model = obj["layers"][0]
            for i, m in enumerate(ms):
                if isinstance(m[0], str) and m[0] == f"blobs/{model['digest'].replace(':', '-')}":
                    ms[i] = blob_member(data)
            obj["layers"][0] = {**model, "digest": "sha256:" + hashlib.sha256(data).hexdigest(), "size": len(data)}
            ms = with_manifest(ms, obj)
        elif op == 9:  # hostile manifest JSON
            ms[0] = (ms[0][0] if isinstance(ms[0][0], str) else f"{MANIFEST_DIR}/m/latest", rng.choice([
                b"[" * 100000, b"{}", b"null", b'{"schemaVersion": 2}', json.dumps({**obj, "layers": []}).encode(),
                json.dumps({**obj, "layers": obj["layers"] * 300}).encode(), rng.randbytes(100),
                json.dumps({**obj, "schemaVersion": 1e400}).encode().replace(b"Infinity", b"1e999")]))
        elif op == 10:  # a declared size in the manifest that lies
            layer = rng.choice(obj["layers"])
            layer["size"] = rng.choice([0, -1, 1 << 62, layer["size"] + 1, "12", True])
            ms = with_manifest(ms, obj)
        elif op == 11:  # shuffle
            rng.shuffle(ms)
        elif op == 12:  # parameters that are deeply nested or odd
            data = rng.choice([b"{" * 50000, b'{"a":' * 5000 + b"1" + b"}" * 5000, b'{"temperature": 1e999}',
                               b'{"memory_budget": "' + b"9" * 400 + b'"}', b'{"num_ctx": -1}'])
            obj["layers"].append({"mediaType": MEDIA_PARAMS, "digest": "sha256:" + hashlib.sha256(data).hexdigest(),
                                  "size": len(data)})
            ms = [*with_manifest(ms, obj), blob_member(data)]
        elif op == 13:  # a pax header or a long name
            i = rng.randrange(len(ms))
            if isinstance(ms[i][0], str):
                info = tarfile.TarInfo(ms[i][0])
                info.size = len(ms[i][1])
                info.pax_headers = rng.choice([{"comment": "x" * rng.choice([100, 3 << 20])},
                                               {"size": str(rng.choice([0, 1 << 40]))},
                                               {"GNU.sparse.map": "0,1", "GNU.sparse.size": "99999"}])
                ms[i] = (info, ms[i][1])
    compress = rng.choice(["", "", "", "gz", "bz2", "xz"])
    name = rng.choice([None, None, "victim", "new", "m:other"])
    return ms, compress, name, rng.random() < 0.3


def test_archive_fuzzer(exported: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded hostile archives against a store holding other models: every import exits 0 or 2 with one line,
    never a traceback; models other than the one named are never changed; nothing is written outside the store;
    a refused import leaves the store as it was; memory and disk stay bounded (reported)."""
    store, members = exported["store"], exported["members"]
    victim_manifest = json.loads(store.manifest_path(store.open("victim").name).read_bytes())
    installed = [(x.digest, x.size) for x in store.open("victim").manifest.blobs]
    store.remove("m")  # its blobs that the victim shares stay; the others must come from the archives
    seed = int(os.environ.get("ZIPMOE_IMPORT_FUZZ_SEED", "33"))
    rng = random.Random(seed)
    work = tmp_path / "work"
    work.mkdir()
    outside = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.name not in ("work", "models")}
    peak_stage = [0]
    original = models_blobs.Job._keep

    def keep(self: Any, tmp: Path, hex_: str, size: int) -> Any:
        total = sum(p.stat().st_size for p in self.dir.iterdir())
        peak_stage[0] = max(peak_stage[0], total)
        return original(self, tmp, hex_, size)

    monkeypatch.setattr(models_blobs.Job, "_keep", keep)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracebacks, outcomes, t0 = [], {0: 0, 1: 0, 2: 0}, time.monotonic()
    for i in range(FUZZ_ARCHIVES):
        ms, compress, name, force = _mutate(rng, members, victim_manifest, installed)
        path = write_tar(work / f"a{i}.tar", ms, compress)
        before = snapshot(store)
        target = name or "m"
        argv = ["import", str(path), *([name] if name else []), *(["--force"] if force else []), "--quiet",
                "--models", str(store.root)]
        try:
            code = cli.main(argv)
        except BaseException as e:  # noqa: BLE001: what the user would see as a traceback
            tracebacks.append((i, repr(e)))
            continue
        finally:
            path.unlink()
        out, err = capsys.readouterr()
        outcomes[code] = outcomes.get(code, 0) + 1
        assert code in (0, 2) and "Traceback" not in err, (i, code, err)
        assert out == "" and (err == "" if code == 0 else err.count("\n") == 1), (i, out, err)
        after = snapshot(store)
        full = f"{MANIFEST_DIR}/{target.split(':')[0]}/{target.split(':')[1] if ':' in target else 'latest'}"
        if code == 0:
            changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
            assert {k for k in changed if k.startswith("manifests/")} <= {full}, (i, changed)
            assert all(before[k] == after[k] for k in before if k.startswith("blobs/")), i  # never rewritten
            store.open(target, full_check=True)
            if not force and name is not None:
                assert full not in before, i
            # back to the starting point: the named model removed (or restored), unreferenced blobs pruned
            if full in before:
                store._commit(store.open(target).name, models_directory.Manifest.from_bytes(before[full], "x"), None)
            else:
                store.remove(target)
            store.prune()
            assert snapshot(store) == before, i
        else:
            assert after == before, (i, err)
        assert not list(store.tmp_dir.iterdir()), i
        assert {p: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.name not in ("work", "models")} == outside
        assert not list(work.iterdir())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert store.open("victim", full_check=True).system == "i am the victim"
    print(f"\narchive fuzzer: {FUZZ_ARCHIVES} archives (seed {seed}) in {time.monotonic() - t0:.1f} s: "
          f"{outcomes[0]} imported, {outcomes[2]} refused, {len(tracebacks)} tracebacks; peak staged "
          f"{peak_stage[0]} bytes; peak RSS {rss // 1024} MiB (+{(rss - rss0) // 1024} MiB during the run)")
    with capsys.disabled():
        print(f"archive fuzzer: {FUZZ_ARCHIVES} archives, {outcomes[0]} imported, {outcomes[2]} refused, "
              f"{len(tracebacks)} tracebacks, peak staged {peak_stage[0]} B, peak RSS {rss // 1024} MiB "
              f"(+{(rss - rss0) // 1024} MiB)")
    assert tracebacks == []
    assert FUZZ_ARCHIVES >= 300 or "ZIPMOE_IMPORT_FUZZ" in os.environ
    assert outcomes[0] > 0 and outcomes[2] > 0  # the fuzzer reaches both ends
    assert peak_stage[0] <= sum(len(d) for _, d in members) + (1 << 20)


def test_parameters_beyond_what_llama_cpp_takes_are_refused_at_import(exported: dict[str, Any],
                                                                       tmp_path: Path) -> None:
    """An archive's num_thread above ggml's maximum (the old code imported it, and `zipmoe run` then died in
    libgomp) and num_ctx beyond any context (imported, then std::bad_alloc blaming the model file): refused with
    one line, nothing written."""
    from pyzipmoe.runtime.config import MAX_CONTEXT, MAX_THREADS

    members = exported["members"]
    fresh = Store(tmp_path / "fresh")
    obj = manifest_of(members)
    layer = next(x for x in obj["layers"] if x["mediaType"] == MEDIA_PARAMS)
    old_name = f"blobs/{layer['digest'].replace(':', '-')}"
    for key, value, limit in (("num_thread", 100000, MAX_THREADS), ("num_ctx", 10**30, MAX_CONTEXT)):
        data = json.dumps({"temperature": 0, key: value}).encode()
        new_layer = {**layer, "digest": "sha256:" + hashlib.sha256(data).hexdigest(), "size": len(data)}
        new_obj = {**obj, "layers": [new_layer if x is layer else x for x in obj["layers"]]}
        rest = [m for m in with_manifest(members, new_obj) if m[0] != old_name]
        message = refused(fresh, write_tar(tmp_path / f"{key}.tar", [*rest, blob_member(data)]), key,
                          f"at most {limit}")
        assert "\n" not in message
