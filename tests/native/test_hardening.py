"""Hostile and damaged zipmoe files: absurd sizes, forged checksums, the integrity record.

A file that declares absurd sizes (2^60-byte tensors, 2^40 values per expert, 2^20 experts without the bytes to
back them) is refused before anything is allocated, by the native index parser and by the Python reader, even when its checksums are
forged to match (whoever writes a file can forge XXH3 checksums). The integrity record catches damage to the
metadata and the dense tensors, in Python (`zipmoe verify`) and in zipmoe's llama.cpp loader (patches/0001),
with messages that name what is damaged. llama.cpp runs happen in a child process (tests/native/mutation_worker.py).
"""

from __future__ import annotations

import json
import os
import re
import resource
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import cffi
import numpy as np
import pytest

from pyzipmoe.file import codec
from pyzipmoe.file import convert
from pyzipmoe.file import verify
from pyzipmoe.file import gguf as format
from pyzipmoe.file import integrity
from pyzipmoe.file import metadata
from pyzipmoe.file import reader
from pyzipmoe._native import library_candidates
from pyzipmoe.errors import ChecksumError, FormatError, UnsupportedError

from helpers import llama_bin_dir

WORKER = Path(__file__).with_name("mutation_worker.py")

# the integrity functions are not part of zipmoe.h's cffi declarations; tests reach them directly
_ffi = cffi.FFI()
_ffi.cdef("""
typedef struct { const char * name; uint64_t offset; uint64_t size; } zipmoe_integrity_tensor;
uint64_t zipmoe_integrity_hash(const void * data, size_t size, uint64_t h);
int64_t zipmoe_integrity_verify(int fd, const uint64_t * record, size_t record_len, uint64_t data_start,
                                const zipmoe_integrity_tensor * tensors, size_t n_tensors, char * msg, size_t msg_size);
int64_t zipmoe_tensor_open(const void * index, size_t index_size, uint64_t data_size, void ** out);
void    zipmoe_tensor_free(void * t);
""")
_lib = _ffi.dlopen(str(next(p for p in library_candidates() if p.is_file())))


# ----------------------------------------------------------------------------------------------- helpers


def _u64(raw: bytes | bytearray, at: int) -> int:
    return struct.unpack_from("<Q", raw, at)[0]


def _record_at(raw: bytes | bytearray) -> tuple[int, int]:
    """(file offset, element count) of the zipmoe.integrity value."""
    key = format.encode_string(integrity.INTEGRITY_KEY)
    at = raw.index(key) + len(key) + 4 + 4
    return at + 8, _u64(raw, at)


def forge_integrity(raw: bytearray, layout: format.GGUFFile) -> None:
    """Rewrites the integrity record to match raw, as a hostile writer would (tensor layout as in `layout`)."""
    at, n = _record_at(raw)
    rec = np.frombuffer(bytes(raw[at:at + 8 * n]), "<u8").copy()
    kinds = rec[integrity.INTEGRITY_HEADER:-1:2]
    for i, t in enumerate(layout.tensors):
        if kinds[i] == integrity.KIND_HASHED:
            data = raw[t.file_offset:t.file_offset + t.nbytes]
            rec[integrity.INTEGRITY_HEADER + 2 * i + 1] = integrity.integrity_hash(data)
    meta = bytearray(raw[:int(rec[3])])
    meta[at:at + 8 * n] = bytes(8 * n)
    rec[4] = integrity.integrity_hash(meta)
    rec[-1] = codec.checksum(rec[:-1])
    raw[at:at + 8 * n] = rec.tobytes()


def forge_index(raw: bytearray, t: format.Tensor, edits: dict[int, int]) -> None:
    """Sets index elements of the index companion t and forges the index checksum."""
    idx = np.frombuffer(bytes(raw[t.file_offset:t.file_offset + t.nbytes]), "<u8").copy()
    for i, v in edits.items():
        idx[i] = v & (2**64 - 1)
    idx[-1] = codec.checksum(idx[:-1])
    raw[t.file_offset:t.file_offset + t.nbytes] = idx.tobytes()


def _tensor_info_dims_at(raw: bytes | bytearray, g: format.GGUFFile, name: str) -> int:
    """File offset of the first dimension of tensor `name` in the tensor-info section."""
    enc = format.encode_string(name)
    at = raw.index(enc, 24 + len(g.kv_raw))
    return at + len(enc) + 4


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _open_index(index: bytes, data_size: int) -> int:
    out = _ffi.new("void **")
    rc = _lib.zipmoe_tensor_open(index, len(index), data_size, out)
    if rc >= 0:
        _lib.zipmoe_tensor_free(out[0])
    return int(rc)


def _verify_c(path: Path) -> tuple[int, str]:
    """zipmoe_integrity_verify on a file, as the loader calls it."""
    g = format.read_gguf(path)
    rec = integrity.IntegrityRecord.from_gguf(g)
    names = [_ffi.new("char[]", t.name.encode()) for t in g.tensors]
    tensors = _ffi.new("zipmoe_integrity_tensor[]", len(g.tensors))
    for i, t in enumerate(g.tensors):
        tensors[i].name, tensors[i].offset, tensors[i].size = names[i], t.offset, t.nbytes
    raw = np.ascontiguousarray(rec.raw, np.uint64)
    msg = _ffi.new("char[512]")
    fd = os.open(path, os.O_RDONLY)
    try:
        rc = _lib.zipmoe_integrity_verify(fd, _ffi.cast("uint64_t *", _ffi.from_buffer(raw)), raw.size, g.data_start,
                                          tensors, len(g.tensors), msg, 512)
    finally:
        os.close(fd)
    return int(rc), _ffi.string(msg).decode()


def _llama_runs(reference: Path, files: list[Path], tmp_path: Path, env: dict[str, str] | None = None) -> list[dict]:
    """Loads each file with zipmoe's llama.cpp (in children); returns their classified outcomes."""
    bin_dir = llama_bin_dir()
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"reference": str(reference), "files": [str(f) for f in files], "env": env or {}}))
    done = subprocess.run([sys.executable, str(WORKER), str(job)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, LLAMA_CPP_LIB_PATH=str(bin_dir), OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["results"]


@pytest.fixture
def real_index(zipmoe_model: Path) -> tuple[np.ndarray, int]:
    """A real index (uint64 elements) and the size of its data companion."""
    g = format.read_gguf(zipmoe_model)
    t, d = g.by_name["blk.0.ffn_up_exps.zipmoe_index"], g.by_name["blk.0.ffn_up_exps.zipmoe_data"]
    raw = zipmoe_model.read_bytes()[t.file_offset:t.file_offset + t.nbytes]
    return np.frombuffer(raw, "<u8").copy(), d.nbytes


def _forged(idx: np.ndarray, **edits: int) -> bytes:
    fields = {"ne0": 5, "ne1": 6, "ne2": 7, "n_expert": 9, "n_per": 10, "chunk_n": 11, "n_chunks": 12,
              "data_size": 13, "align": 14}
    out = idx.copy()
    for k, v in edits.items():
        out[fields[k]] = v & (2**64 - 1)
    out[-1] = codec.checksum(out[:-1])
    return out.tobytes()


# ------------------------------------------------------------------------------------------ absurd sizes


@pytest.mark.parametrize("case", ["2^40 values per expert", "2^20 experts", "2^60-byte data companion",
                                  "2^63-byte data companion", "chunk of 2^24+1 values", "zero-size chunks"])
def test_absurd_sizes_are_refused_before_allocating(case: str, real_index: tuple[np.ndarray, int]) -> None:
    idx, data_size = real_index
    n_chunks = lambda n, s: -(-n // s)  # noqa: E731
    chunk_n = int(idx[11])
    index, size = {
        "2^40 values per expert": (_forged(idx, ne0=1 << 20, ne1=1 << 20, n_per=1 << 40,
                                           n_chunks=n_chunks(1 << 40, chunk_n)), data_size),
        "2^20 experts": (_forged(idx, ne2=1 << 20, n_expert=1 << 20), data_size),
        "2^60-byte data companion": (_forged(idx, ne0=1 << 29, ne1=1 << 29, n_per=1 << 58,
                                             n_chunks=n_chunks(1 << 58, chunk_n), data_size=1 << 60), 1 << 60),
        "2^63-byte data companion": (_forged(idx, data_size=1 << 63), 1 << 63),
        "chunk of 2^24+1 values": (_forged(idx, chunk_n=(1 << 24) + 1, n_chunks=1), data_size),
        "zero-size chunks": (_forged(idx, chunk_n=0), data_size),
    }[case]
    before, t0 = _maxrss_mib(), time.monotonic()
    assert _open_index(index, size) == -2  # ZIPMOE_ERR_CORRUPT
    with pytest.raises(FormatError):
        codec.ExpertTensor(index, size)
    assert time.monotonic() - t0 < 1.0
    assert _maxrss_mib() - before < 16  # nothing the size of the claim was allocated


def test_real_index_still_opens(real_index: tuple[np.ndarray, int]) -> None:
    idx, data_size = real_index
    assert _open_index(idx.tobytes(), data_size) == 0
    assert _open_index(_forged(idx), data_size) == 0  # forging an unchanged index changes nothing
    assert _open_index(_forged(idx), data_size - 1) == -2  # the index must state its data companion's size


def test_absurd_source_size_is_refused_by_the_reader(zipmoe_model: Path, tmp_path: Path) -> None:
    """zipmoe.source.size = 2^60 would make verify and unpack restore (hash, write) an exabyte of zeros."""
    raw = bytearray(zipmoe_model.read_bytes())
    key = format.encode_string("zipmoe.source.size") + struct.pack("<I", 10)
    at = raw.index(key) + len(key)
    raw[at:at + 8] = struct.pack("<Q", 1 << 60)
    forge_integrity(raw, format.read_gguf(zipmoe_model))
    damaged = tmp_path / "huge-source.gguf"
    damaged.write_bytes(bytes(raw))
    t0 = time.monotonic()
    for action in (verify.verify, convert.inspect, lambda p: verify.unpack(p, tmp_path / "out.gguf")):
        with pytest.raises(FormatError, match="zipmoe.source.size"):
            action(damaged)
    assert time.monotonic() - t0 < 5
    assert not (tmp_path / "out.gguf").exists()


def test_converter_refuses_sources_that_are_mostly_gaps(tiny_model: Path, tmp_path: Path) -> None:
    src = tmp_path / "padded.gguf"
    src.write_bytes(tiny_model.read_bytes() + bytes(2 * tiny_model.stat().st_size))
    with pytest.raises(UnsupportedError, match="lie between or after its tensors"):
        convert.convert(src, tmp_path / "out.gguf", threads=1)


# ------------------------------------------------------------------------------------------ integrity


def test_chain_hash_is_the_same_in_pieces_and_in_c() -> None:
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, 3 * integrity.INTEGRITY_BLOCK + 12345, dtype=np.uint8).tobytes()
    whole = integrity.integrity_hash(data)
    assert whole == _lib.zipmoe_integrity_hash(data, len(data), 0)
    for _ in range(5):
        h, pos = integrity.ChainHash(), 0
        while pos < len(data):
            n = int(rng.integers(1, 2 * integrity.INTEGRITY_BLOCK))
            h.update(data[pos:pos + n])
            pos += n
        assert h.digest() == whole
    assert integrity.integrity_hash(b"") == integrity.ChainHash().digest() == 0


def test_converted_files_carry_a_valid_record(zipmoe_models: dict[tuple[str, str], Path]) -> None:
    for path in zipmoe_models.values():
        zf = reader.open_zipmoe(path)
        assert zf.integrity is not None
        g = zf.gguf
        kinds = [integrity.KIND_COMPANION if t.name.endswith(metadata.DATA_SUFFIX) else integrity.KIND_HASHED
                 for t in g.tensors]
        assert list(zf.integrity.kinds) == kinds
        assert integrity.check_integrity(path, g, zf.integrity) == g.data_start + sum(
            t.nbytes for t, k in zip(g.tensors, kinds) if k == integrity.KIND_HASHED)
        assert _verify_c(path) == (0, "")
        assert verify.verify(path).integrity_bytes > g.data_start


def _damage(path: Path, where: str, out_dir: Path) -> Path:
    damaged = out_dir / f"damaged-{where.replace(' ', '-')}.gguf"
    raw = bytearray(path.read_bytes())
    g = format.read_gguf(path)
    at = {
        "general.name": raw.index(b"zipmoe synthetic") + 3,  # a key/value pair the model reads (its name)
        "tensor info": _tensor_info_dims_at(raw, g, "blk.1.attn_v.weight") - 5,  # a letter of the name
        "dense tensor": g.by_name["output_norm.weight"].file_offset + 17,
        "index": g.by_name["blk.1.ffn_down_exps.zipmoe_index"].file_offset + 8 * 60,
        "record": _record_at(raw)[0] + 8 * 4,
        "data companion": g.by_name["blk.0.ffn_gate_exps.zipmoe_data"].file_offset + 5,
    }[where]
    raw[at] ^= 0x10
    damaged.write_bytes(bytes(raw))
    return damaged


@pytest.mark.parametrize("where, message", [
    ("general.name", r"the metadata \(header, key/value pairs and tensor infos: bytes 0-\d+\) is damaged"),
    ("tensor info", r"the metadata .* is damaged"),
    ("dense tensor", r"tensor '?output_norm.weight'? is damaged"),
    ("index", r"tensor '?blk.1.ffn_down_exps.zipmoe_index'? is damaged"),
])
def test_integrity_names_the_damage(where: str, message: str, zipmoe_model: Path, tmp_path: Path) -> None:
    damaged = _damage(zipmoe_model, where, tmp_path)
    g = format.read_gguf(damaged)
    with pytest.raises(ChecksumError, match=message):
        integrity.check_integrity(damaged, g, integrity.IntegrityRecord.from_gguf(g))
    rc, msg = _verify_c(damaged)
    assert rc == -3  # ZIPMOE_ERR_CHECKSUM
    assert re.search(message, msg), msg


def test_damaged_record_is_refused_by_the_reader(zipmoe_model: Path, tmp_path: Path) -> None:
    damaged = _damage(zipmoe_model, "record", tmp_path)
    with pytest.raises(ChecksumError, match="zipmoe.integrity: the record is damaged"):
        reader.open_zipmoe(damaged)


def test_data_companions_are_left_to_their_chunk_checksums(zipmoe_model: Path, tmp_path: Path) -> None:
    damaged = _damage(zipmoe_model, "data companion", tmp_path)
    g = format.read_gguf(damaged)
    integrity.check_integrity(damaged, g, integrity.IntegrityRecord.from_gguf(g))
    assert _verify_c(damaged)[0] == 0
    with pytest.raises(ChecksumError):
        verify.verify(damaged)  # the chunk's own checksum


def test_verify_refuses_a_file_without_a_record(zipmoe_model: Path, copy_of: Callable[[Path], Path]) -> None:
    renamed = copy_of(zipmoe_model)
    renamed.write_bytes(renamed.read_bytes().replace(b"zipmoe.integrity", b"zipmoe.integritz"))
    assert reader.open_zipmoe(renamed).integrity is None
    with pytest.raises(FormatError, match="no zipmoe.integrity record"):
        verify.verify(renamed)


# ------------------------------------------------------------------------------------- zipmoe's llama.cpp


def test_llama_refuses_damage_and_names_it(zipmoe_model: Path, tmp_path: Path) -> None:
    paths = {w: _damage(zipmoe_model, w, tmp_path) for w in ("general.name", "dense tensor", "index", "record")}
    results = _llama_runs(zipmoe_model, list(paths.values()), tmp_path)
    by_where = dict(zip(paths, results))
    for where, r in by_where.items():
        assert r["class"] == "refused" and r["stage"] == "load", (where, r)
        assert "zipmoe:" in r["reason"], (where, r)
    assert "metadata" in by_where["general.name"]["reason"]
    assert "output_norm.weight" in by_where["dense tensor"]["reason"]
    assert "blk.1.ffn_down_exps.zipmoe_index" in by_where["index"]["reason"]
    assert "zipmoe.integrity record is damaged" in by_where["record"]["reason"]


def test_llama_without_record_needs_skip(zipmoe_model: Path, tmp_path: Path) -> None:
    renamed = tmp_path / "no-record.gguf"
    renamed.write_bytes(zipmoe_model.read_bytes().replace(b"zipmoe.integrity", b"zipmoe.integritz"))
    (refused,) = _llama_runs(zipmoe_model, [renamed], tmp_path)
    assert refused["class"] == "refused" and "no zipmoe.integrity record" in refused["reason"]
    (skipped,) = _llama_runs(zipmoe_model, [renamed], tmp_path, env={"ZIPMOE_INTEGRITY": "skip"})
    assert skipped["class"] == "ok"  # only a key's name changed: the same logits


def test_llama_refuses_forged_hostile_files(zipmoe_model: Path, tmp_path: Path) -> None:
    """Checksums forged to match (index and integrity record): the structural checks still refuse absurd
    sizes and offsets, before anything is allocated or read through them."""
    g = format.read_gguf(zipmoe_model)
    original = zipmoe_model.read_bytes()
    index = g.by_name["blk.0.ffn_up_exps.zipmoe_index"]
    idx = np.frombuffer(original[index.file_offset:index.file_offset + index.nbytes], "<u8")
    n_expert, chunks = int(idx[9]), int(idx[12])
    first_chunk = metadata.INDEX_HEADER + 2 * n_expert
    cases: dict[str, Callable[[bytearray], None]] = {
        "data companion of 2^60 bytes": lambda raw: raw.__setitem__(
            slice(_tensor_info_dims_at(raw, g, "blk.0.ffn_up_exps.zipmoe_data"),
                  _tensor_info_dims_at(raw, g, "blk.0.ffn_up_exps.zipmoe_data") + 8), struct.pack("<Q", 1 << 60)),
        "2^40 values per expert": lambda raw: forge_index(raw, index, {
            5: 1 << 20, 6: 1 << 20, 10: 1 << 40, 12: -(-(1 << 40) // int(idx[11]))}),
        "a million experts": lambda raw: forge_index(raw, index, {7: 1 << 20, 9: 1 << 20}),
        "region outside the data": lambda raw: forge_index(raw, index, {metadata.INDEX_HEADER + 2: 1 << 62}),
        "chunk past its region": lambda raw: forge_index(raw, index, {first_chunk: 1 << 40}),
        "chunk ends out of order": lambda raw: forge_index(raw, index, {first_chunk + 2 * (chunks - 2): 1}),
    }
    files = []
    for i, (name, edit) in enumerate(cases.items()):
        raw = bytearray(original)
        edit(raw)
        forge_integrity(raw, g)
        path = tmp_path / f"forged-{i}.gguf"
        path.write_bytes(bytes(raw))
        files.append(path)
    results = _llama_runs(zipmoe_model, files, tmp_path)
    for name, r in zip(cases, results):
        assert r["class"] == "refused" and r["stage"] == "load", (name, r)


N_FORGED = int(os.environ.get("ZIPMOE_FORGED", "160"))


def test_llama_survives_forged_index_damage(zipmoe_models: dict[tuple[str, str], Path], tmp_path: Path) -> None:
    """Random damage to the indexes, with the index checksum and the integrity record forged to match, as a
    hostile file would: every load and generate is refused or completes, never a crash or a hang (a forger can
    change the output on purpose, so different output is allowed here)."""
    rng = np.random.default_rng(11)
    files, counts = [], {}
    for key in (("qwen3moe", "huff"), ("olmoe", "zstd")):
        model = zipmoe_models[key]
        g, original = format.read_gguf(model), model.read_bytes()
        indexes = [t for t in g.tensors if t.name.endswith(metadata.INDEX_SUFFIX)]
        for i in range(N_FORGED // 2):
            raw = bytearray(original)
            t = indexes[int(rng.integers(len(indexes)))]
            n = t.nbytes // 8
            edits = {}
            for _ in range(int(rng.integers(1, 4))):
                # the header and the region table most of the time: that is where the sizes are
                at = int(rng.integers(metadata.INDEX_HEADER + 16)) if rng.random() < 0.6 else int(rng.integers(n - 1))
                old = _u64(raw, t.file_offset + 8 * at)
                edits[at] = int(rng.choice([old ^ (1 << int(rng.integers(64))), old + int(rng.integers(-3, 4)),
                                            0, 2**64 - 1, 1 << int(rng.integers(64))]))
            forge_index(raw, t, edits)
            forge_integrity(raw, g)
            path = tmp_path / f"forged-{key[1]}-{i:03d}.gguf"
            path.write_bytes(bytes(raw))
            files.append((model, path))
    for model in {m for m, _ in files}:
        results = _llama_runs(model, [p for m, p in files if m == model], tmp_path)
        for r in results:
            counts[r["class"]] = counts.get(r["class"], 0) + 1
            assert r["class"] in ("ok", "refused", "wrong"), r
    print(f"\nforged index damage: {counts}")
    assert counts.get("refused", 0) > 0


# ------------------------------------------------------------------------------- the control file, ZIPMOE_PLAN

CONTROL_MAGIC = int.from_bytes(b"ZMCTL001", "little")
W_SEQ, W_POLICY, W_POLLS = 1, 2, 14


def _words(path: Path) -> tuple[int, ...]:
    raw = path.read_bytes()
    return struct.unpack(f"<{len(raw) // 8}Q", raw[:len(raw) // 8 * 8])


def _wait(what: Callable[[], bool], seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(0.05)
    return False


def _server(zipmoe_model: Path, env: dict[str, str], log: Path) -> tuple[subprocess.Popen, str]:
    """zipmoe's llama-server on loopback under a budget, ready; (process, url)."""
    import socket

    import helpers

    server = helpers.llama_bin_dir() / "llama-server"
    if not server.is_file():
        helpers.unavailable(f"{server} is not built")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [str(server), "-m", str(zipmoe_model), "--port", str(port), "-t", "2", "-c", "256", "-np", "1",
            "--memory-budget", "100%"]
    with open(log, "wb") as err:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        try:
            return helpers.http_json(url + "/health", timeout=2)[0] == 200
        except OSError:
            return False

    if not _wait(ready, 120):
        helpers.kill_group(proc)
        raise AssertionError("llama-server was not ready in time")
    return proc, url


def test_llama_server_survives_the_control_file_truncated_or_garbled(zipmoe_model: Path, tmp_path: Path) -> None:
    """The control file is read with pread, not through a mapping: truncated under llama-server (which killed it
    with SIGBUS), the budget stays and one warning says so; replaced, the server keeps the file it opened; a split
    naming a policy that does not exist is refused before it is taken for one."""
    import helpers

    ctl, log = tmp_path / "control", tmp_path / "server.log"
    ctl.write_bytes(struct.pack("<16Q", CONTROL_MAGIC, *[0] * 15))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZIPMOE_", "LLAMA_ARG_"))}
    env.update(LD_LIBRARY_PATH=str(helpers.llama_bin_dir()), ZIPMOE_CONTROL=str(ctl))
    proc, url = _server(zipmoe_model, env, log)
    try:
        assert _wait(lambda: _words(ctl)[W_POLLS] > 0), "the server never polled its control file"
        words = list(_words(ctl))
        words[W_SEQ], words[W_POLICY] = words[W_SEQ] + 2, 99
        ctl.write_bytes(struct.pack("<16Q", *words))
        assert _wait(lambda: "policy 99 is none" in log.read_text(errors="replace")), log.read_text()[-3000:]
        os.truncate(ctl, 0)
        assert _wait(lambda: "was truncated" in log.read_text(errors="replace")), log.read_text()[-3000:]
        time.sleep(0.3)  # several polls of the thread
        status, body = helpers.http_json(url + "/completion", {"prompt": "The expert", "n_predict": 4,
                                                               "temperature": 0}, 120)
        assert status == 200 and proc.poll() is None, (status, body)
        assert os.path.getsize(ctl) == 0  # (nothing written to a file that is no longer a control file)
        fresh = tmp_path / "fresh"
        fresh.write_bytes(struct.pack("<16Q", CONTROL_MAGIC, 4, 99, *[0] * 13))
        os.replace(fresh, ctl)  # replaced: the server keeps the file it opened
        time.sleep(0.3)
        status, body = helpers.http_json(url + "/completion", {"prompt": "The expert", "n_predict": 4,
                                                               "temperature": 0}, 120)
        assert status == 200 and proc.poll() is None, (status, body)
    finally:
        helpers.kill_group(proc)
    text = log.read_text(errors="replace")
    assert proc.returncode != -7, "SIGBUS"  # (kill_group's signal otherwise)
    assert text.count("was truncated") == 1, text[-3000:]


def _completion(zipmoe_model: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    import helpers

    program = helpers.llama_bin_dir() / "llama-completion"
    if not program.is_file():
        helpers.unavailable(f"{program} is not built")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ZIPMOE_", "LLAMA_ARG_"))}
    return subprocess.run([str(program), "-m", str(zipmoe_model), "-n", "2", "-p", "The expert", "-no-cnv", "-t", "2",
                           "-c", "128"], env={**base, "LD_LIBRARY_PATH": str(program.parent), **env},
                          capture_output=True, text=True, errors="replace", timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("plan", ["0:99999999999999999999,1,1", "0:1,9223372036854775808,1", "4294967296:1,1,1",
                                  "0:-1,1,1", "0:+1,1,1", "0:1,1", "0:1,1,1,", "0:1,1,1;x"])
def test_llama_refuses_a_plan_with_numbers_out_of_range(zipmoe_model: Path, plan: str) -> None:
    """ZIPMOE_PLAN's numbers are checked (sscanf's %d and %lld overflowed: undefined, in practice a huge count)."""
    done = _completion(zipmoe_model, {"ZIPMOE_MEMORY_BUDGET": "100%", "ZIPMOE_PLAN": plan})
    assert done.returncode == 1 and done.stderr.count(f"ZIPMOE_PLAN={plan} is not a plan") == 1, done.stderr[-2000:]


def test_llama_refuses_a_plan_beyond_the_slot_rules(zipmoe_model: Path) -> None:
    """Rules beyond the cache's 4096 were dropped silently (the layers after them ran without a plan)."""
    plan = ";".join(f"{layer}:1,1,0" for layer in range(4097))
    done = _completion(zipmoe_model, {"ZIPMOE_MEMORY_BUDGET": "100%", "ZIPMOE_PLAN": plan})
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.count("has rules for more layers than the cache's limit of 4096") == 1, done.stderr[-2000:]
    ok = _completion(zipmoe_model, {"ZIPMOE_MEMORY_BUDGET": "100%", "ZIPMOE_PLAN": " 0: 1, 1, 0;1:1,1,0;"})
    assert ok.returncode == 0, ok.stderr[-2000:]


_plan_ffi = cffi.FFI()
_plan_ffi.cdef("""
typedef int64_t (*zipmoe_plan_rule_fn)(void * arg, int32_t layer, int64_t hot, int64_t warm, int64_t sm);
int64_t zipmoe_plan_parse(const char * text, zipmoe_plan_rule_fn fn, void * arg);
int64_t zipmoe_policy_parse(const char * name, int * out);
""")
_plan_lib = _plan_ffi.dlopen(str(next(p for p in library_candidates() if p.is_file())))


def _plan_rules(text: str) -> tuple[int, list[tuple[int, int, int, int]]]:
    rules: list[tuple[int, int, int, int]] = []

    @_plan_ffi.callback("int64_t(void *, int32_t, int64_t, int64_t, int64_t)")
    def keep(_arg, layer, hot, warm, sm):  # noqa: ANN001, ANN202
        rules.append((layer, hot, warm, sm))
        return 0

    return _plan_lib.zipmoe_plan_parse(text.encode(), keep, _plan_ffi.NULL), rules


def test_the_plan_parser_reads_checked_numbers() -> None:
    """The one parser of ZIPMOE_PLAN (the loader's and the programs' argument check): counts up to INT64_MAX, layers
    up to INT32_MAX, nothing else where a number goes."""
    assert _plan_rules("0:12,4,0;1:10,6,2") == (0, [(0, 12, 4, 0), (1, 10, 6, 2)])
    assert _plan_rules(" 3: 1, 2, 3;") == (0, [(3, 1, 2, 3)])
    assert _plan_rules(f"{2**31 - 1}:{2**63 - 1},0,0") == (0, [(2**31 - 1, 2**63 - 1, 0, 0)])
    for bad in (f"{2**31}:1,1,1", f"0:{2**63},1,1", "0:-1,1,1", "0:+1,1,1", "0:1,1", "0:1,1,1,", "x", ";"):
        assert _plan_rules(bad)[0] == -2, bad  # ZIPMOE_ERR_CORRUPT
    assert _plan_rules(";".join(f"{i}:1,1,1" for i in range(4096)))[0] == 0
    rc, rules = _plan_rules(";".join(f"{i}:1,1,1" for i in range(4097)))
    assert rc == -1 and len(rules) == 4096  # ZIPMOE_ERR_ARG: beyond ZIPMOE_MAX_SLOT_RULES
    out = _plan_ffi.new("int *")
    assert [_plan_lib.zipmoe_policy_parse(n.encode(), out) == 0 and out[0] for n in
            ("tlfu", "lru", "lfu", "fifo", "lfuda")] == [0, 1, 2, 3, 4]
    assert _plan_lib.zipmoe_policy_parse(b"LRU", out) == -1 and _plan_lib.zipmoe_policy_parse(b"", out) == -1
