"""zipmoe's llama.cpp loader against files whose companions the metadata does not vouch for, an index header that
disagrees with its length, every load mode, and a failed load followed by a good one in the same process.

Each crafted file has its integrity record forged to match (as a hostile writer would), so that the loader's
structural checks, not the record, are what refuse it; `zipmoe verify` (the Python reader) must refuse it too.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import llama_bin_dir, worker_env
from test_hardening import _ffi as _hardening_ffi  # noqa: F401 (the library, opened once)
from test_hardening import _llama_runs, forge_index, forge_integrity

from pyzipmoe._native import ffi, lib
from pyzipmoe.errors import ZipmoeError
from pyzipmoe.file import gguf as format
from pyzipmoe.file import metadata
from pyzipmoe.file import verify


def _kv_value_at(raw: bytes | bytearray, key: str) -> int:
    """File offset of the value of key/value pair `key` (after its type)."""
    enc = format.encode_string(key)
    return raw.index(enc) + len(enc) + 4


def _craft(zipmoe_model: Path, tmp_path: Path, case: str) -> Path:
    raw = bytearray(zipmoe_model.read_bytes())
    g = format.read_gguf(zipmoe_model)
    if case == "listed name is no expert tensor":
        at = raw.index(format.encode_string("blk.0.ffn_up_exps.weight"))
        new = format.encode_string("blk.0.attn_k_xxxx.weight")
        raw[at:at + len(new)] = new
    elif case == "codec disagrees":
        at = _kv_value_at(raw, "zipmoe.codec")
        assert raw[at + 8:at + 12] == b"huff"
        raw[at + 8:at + 12] = b"zstd"
    elif case == "chunk size disagrees":
        at = _kv_value_at(raw, "zipmoe.chunk_size")
        raw[at:at + 4] = struct.pack("<I", struct.unpack_from("<I", raw, at)[0] + 1)
    else:
        raise AssertionError(case)
    forge_integrity(raw, g)
    out = tmp_path / f"{case.replace(' ', '-')}.gguf"
    out.write_bytes(bytes(raw))
    return out


CASES = {
    "listed name is no expert tensor": "which is no expert tensor",
    "codec disagrees": "disagrees with the metadata",
    "chunk size disagrees": "disagrees with the metadata",
}


def test_llama_and_verify_refuse_companions_the_metadata_does_not_vouch_for(zipmoe_model: Path,
                                                                             tmp_path: Path) -> None:
    files = {case: _craft(zipmoe_model, tmp_path, case) for case in CASES}
    for case, path in files.items():
        with pytest.raises(ZipmoeError):
            verify.verify(path)  # the Python reader refuses it: so must llama.cpp
    results = _llama_runs(zipmoe_model, list(files.values()), tmp_path)
    for (case, says), r in zip(CASES.items(), results):
        assert r["class"] == "refused" and r["stage"] == "load", (case, r)
        assert "zipmoe:" in r["reason"] and says in r["reason"], (case, r)


def test_the_index_length_is_known_from_its_header(zipmoe_model: Path) -> None:
    g = format.read_gguf(zipmoe_model)
    t, d = g.by_name["blk.0.ffn_up_exps.zipmoe_index"], g.by_name["blk.0.ffn_up_exps.zipmoe_data"]
    raw = zipmoe_model.read_bytes()[t.file_offset:t.file_offset + t.nbytes]
    header = raw[:8 * metadata.INDEX_HEADER]
    out = ffi.new("uint64_t *")
    assert lib.zipmoe_tensor_index_size(header, len(header), d.nbytes, out) == 0 and out[0] == t.nbytes
    assert lib.zipmoe_tensor_index_size(header, len(header) - 1, d.nbytes, out) == lib.ZIPMOE_ERR_CORRUPT
    assert lib.zipmoe_tensor_index_size(header, len(header), d.nbytes + 1, out) == lib.ZIPMOE_ERR_CORRUPT
    h = np.frombuffer(header, "<u8").copy()
    h[9] = h[7] = 1 << 20  # a million experts the data companion cannot hold
    assert lib.zipmoe_tensor_index_size(h.tobytes(), len(header), d.nbytes, out) == lib.ZIPMOE_ERR_CORRUPT


# ------------------------------------------------------------------------------------- one process, two loads

_SCRIPT = r"""
import json, os, sys
import llama_cpp.llama_cpp as L
job = json.loads(sys.argv[1])
os.environ["ZIPMOE_MEMORY_BUDGET"] = str(job["budget"])
os.environ.update(job.get("env", {}))
if "mode" in job:
    L.LLAMA_LOAD_MODE_MMAP = job["mode"]  # llama_cpp.Llama(use_mmap=True) asks for this mode
from llama_cpp import Llama
out = {}
if "bad" in job:
    try:
        Llama(model_path=job["bad"], n_ctx=64, n_threads=1, verbose=True)
        out["bad"] = "loaded"
    except Exception as e:
        out["bad"] = str(e)
try:
    llm = Llama(model_path=job["good"], n_ctx=64, n_threads=2, seed=0, verbose=True)
    res = llm.create_completion("the expert model said hello to", max_tokens=12, temperature=0.0)
    out["text"] = res["choices"][0]["text"]
    model, direct = os.path.realpath(job["good"]), 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != model:
                continue
            flags = next(l for l in open(f"/proc/self/fdinfo/{fd}") if l.startswith("flags:"))
            direct += bool(int(flags.split()[1], 8) & 0o40000)  # O_DIRECT
        except OSError:
            pass
    out["direct_fds"] = direct
except Exception as e:
    out["error"] = str(e)
print(json.dumps(out))
"""


def _child(job: dict, lib_dir: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(job)], capture_output=True, text=True,
                          timeout=300, env=worker_env(lib_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["log"] = done.stderr
    return result


def test_a_failed_load_leaves_no_store_behind(small_models: tuple[Path, Path], zipmoe_model: Path,
                                              tmp_path: Path) -> None:
    """A larger model that fails at its second index, then the tiny model at its exact minimum budget, in one
    process: the failed load's first stores must not count in the tiny model's minimum."""
    from pyzipmoe.runtime.budget import model_memory

    lib_dir = llama_bin_dir()
    _, small = small_models
    raw = bytearray(small.read_bytes())
    g = format.read_gguf(small)
    names = sorted((t.name for t in g.tensors if t.name.endswith(".zipmoe_index")),
                   key=lambda n: (int(n.split(".")[1]), n))
    forge_index(raw, g.by_name[names[-1]], {7: 1 << 20, 9: 1 << 20})  # the last index: a million experts
    forge_integrity(raw, g)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(raw))
    minimum = model_memory(zipmoe_model).minimum
    assert model_memory(small).in_flight_bytes > model_memory(zipmoe_model).in_flight_bytes
    alone = _child({"budget": minimum, "good": str(zipmoe_model)}, lib_dir)
    assert "text" in alone, alone.get("error")
    after = _child({"budget": minimum, "bad": str(bad), "good": str(zipmoe_model)}, lib_dir)
    assert after["bad"] != "loaded"
    assert "zipmoe: " + names[-1].replace(".zipmoe_index", ".weight") in after["log"], after["log"][-2000:]
    assert after.get("text") == alone["text"], after.get("error")


MODES = {"auto": -1, "none": 0, "mmap": 1, "mlock": 2, "mmap+mlock": 3, "dio": 4}


def test_every_load_mode_gives_the_same_tokens_from_cold_reads(zipmoe_model: Path) -> None:
    """The stores read the model through a descriptor of their own, so llama.cpp's load mode (direct I/O
    included) changes nothing: the same greedy text at the minimum budget, where experts are read from disk."""
    from pyzipmoe.runtime.budget import model_memory

    lib_dir = llama_bin_dir()
    budget = model_memory(zipmoe_model, mapped=False).minimum  # holds the whole embedding in every mode
    texts = {}
    for name, mode in MODES.items():
        r = _child({"budget": budget, "mode": mode, "good": str(zipmoe_model)}, lib_dir)
        assert "text" in r, (name, r.get("error"), r["log"][-2000:])
        texts[name] = r["text"]
    assert len(set(texts.values())) == 1 and texts["mmap"], texts
    # the stores' own descriptors are plain: with their own direct I/O off, no descriptor of the model file is
    # O_DIRECT, even where llama.cpp opened it so (a copy of llama.cpp's descriptor would be)
    r = _child({"budget": budget, "mode": MODES["dio"], "good": str(zipmoe_model), "env": {"ZIPMOE_DIRECT_IO": "0"}},
               lib_dir)
    assert r.get("text") == texts["mmap"] and r["direct_fds"] == 0, r


def test_llama_and_verify_refuse_a_version_1_file_with_quantized_experts(zipmoe_model: Path, tmp_path: Path) -> None:
    """Version 1 promises BF16 experts; a file that says version 1 over Q8_0 experts (its record forged to match)
    is damaged metadata: `zipmoe verify` refused it, the loader ran it."""
    from test_expert_types import write_model

    from pyzipmoe.file import convert

    src, packed = tmp_path / "q8.gguf", tmp_path / "q8.zipmoe.gguf"
    write_model(src, {"up": "Q8_0", "gate": "Q8_0", "down": "Q8_0"})
    convert.convert(src, packed, threads=1)
    raw = bytearray(packed.read_bytes())
    at = _kv_value_at(raw, "zipmoe.version")
    assert struct.unpack_from("<I", raw, at)[0] == metadata.TYPED_FORMAT_VERSION
    struct.pack_into("<I", raw, at, metadata.FORMAT_VERSION)
    forge_integrity(raw, format.read_gguf(packed))
    v1 = tmp_path / "q8-v1.zipmoe.gguf"
    v1.write_bytes(bytes(raw))
    with pytest.raises(ZipmoeError, match="zipmoe.version 1 with a Q8_0 expert tensor"):
        verify.verify(v1)
    (r,) = _llama_runs(zipmoe_model, [v1], tmp_path)
    assert r["class"] == "refused" and r["stage"] == "load", r
    assert "zipmoe.version 1 with a q8_0 expert tensor" in r["reason"].lower(), r
