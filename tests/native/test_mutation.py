"""Mutation tests of whole zipmoe GGUFs: damaged files are refused or give bit-exact results, never wrong ones.

Tiny zipmoe GGUFs (huff/qwen3moe and zstd/olmoe, several chunks per expert) get seeded random damage: bit
flips anywhere in the file, flips and byte changes aimed at the metadata and at the hashed tensors (dense
tensors, indexes), runs of zeroed bytes, and truncations. Each damaged file is loaded by zipmoe's llama.cpp
(through llama-cpp-python, in a forked child: tests/native/mutation_worker.py), which evaluates a prompt with all
logits and generates greedily. Every run must either

* be refused (a load error or an llama_decode error), or
* give logits and tokens bit-identical to the undamaged file's (damage in bytes no output depends on: padding,
  experts the prompt never routes to);

and never crash, hang or silently give different output. Damage to the metadata or to a hashed tensor must be
refused by the integrity record, with a zipmoe message naming it.

ZIPMOE_MUTATIONS sets the number of damaged files (default 1000, shared by the two models; they run in two
processes, one per CPU of a CI machine). These tests need zipmoe's llama.cpp build and llama-cpp-python.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from pyzipmoe.file import gguf as format
from pyzipmoe.file import metadata

WORKER = Path(__file__).with_name("mutation_worker.py")
N_MUTATIONS = int(os.environ.get("ZIPMOE_MUTATIONS", "1000"))
MODELS = (("qwen3moe", "huff"), ("olmoe", "zstd"))


def _hashed_ranges(g: format.GGUFFile) -> list[tuple[int, int, str]]:
    """(start, end, what) of every byte the integrity record covers."""
    ranges = [(0, g.data_start, "metadata")]
    ranges += [(t.file_offset, t.file_offset + t.nbytes, t.name) for t in g.tensors
               if not t.name.endswith(metadata.DATA_SUFFIX)]
    return ranges


def make_mutations(path: Path, n: int, seed: int) -> list[list]:
    """n seeded mutations of the file at path, as [kind, offset, arg] (see mutation_worker.py)."""
    data = path.read_bytes()
    g = format.read_gguf(path)
    size = len(data)
    hashed = [r for r in _hashed_ranges(g) if r[1] > r[0]]
    rng = random.Random(seed)
    out: list[list] = []
    while len(out) < n:
        roll = rng.random()
        if roll < 0.35:  # a bit anywhere
            out.append(["flip", rng.randrange(size), 1 << rng.randrange(8)])
        elif roll < 0.55:  # a bit of the metadata: header, key/value pairs, tensor infos
            out.append(["flip", rng.randrange(g.data_start), 1 << rng.randrange(8)])
        elif roll < 0.65:  # a metadata byte set to another value
            at = rng.randrange(g.data_start)
            out.append(["set", at, (data[at] + rng.randrange(1, 256)) % 256])
        elif roll < 0.75:  # a bit of a dense tensor or an index
            start, end, _ = rng.choice(hashed[1:])
            out.append(["flip", rng.randrange(start, end), 1 << rng.randrange(8)])
        elif roll < 0.87:  # a run of zeros anywhere
            out.append(["zero", rng.randrange(size), rng.randrange(1, 65)])
        else:  # a truncated file
            out.append(["trunc", rng.randrange(size), 0])
    return out


def _changes_hashed_bytes(data: bytes, mutation: list, ranges: list[tuple[int, int, str]]) -> bool:
    kind, offset, arg = mutation
    if kind == "trunc":
        return True
    end = offset + (arg if kind == "zero" else 1)
    if kind == "zero" and not any(data[offset:end]):
        return False
    return any(offset < r_end and r_start < end for r_start, r_end, _ in ranges)


@pytest.fixture(scope="module")
def campaign(zipmoe_models: dict[tuple[str, str], Path], tmp_path_factory: pytest.TempPathFactory,
             llama_lib_dir: Path) -> dict:
    """Runs the damaged files of both models, one worker process per model, in parallel."""
    lib_dir = llama_lib_dir
    work = tmp_path_factory.mktemp("mutation")
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(lib_dir), OMP_NUM_THREADS="1")
    procs, jobs = {}, {}
    for i, key in enumerate(MODELS):
        model = zipmoe_models[key]
        n = N_MUTATIONS // len(MODELS) + (i < N_MUTATIONS % len(MODELS))
        jobs[key] = {"model": str(model), "mutations": make_mutations(model, n, seed=1000 + i),
                     "workdir": str(work), "timeout": 60}
        job_path = work / f"job-{i}.json"
        job_path.write_text(json.dumps(jobs[key]))
        procs[key] = subprocess.Popen([sys.executable, str(WORKER), str(job_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=1500)
        assert proc.returncode == 0, f"the mutation worker for {key} failed ({proc.returncode}):\n{err[-3000:]}"
        results[key] = json.loads(out.strip().splitlines()[-1])
    return {"jobs": jobs, "results": results}


def test_damaged_files_are_refused_or_bit_exact(campaign: dict) -> None:
    counts: Counter[str] = Counter()
    bad = []
    for key, res in campaign["results"].items():
        for r in res["results"]:
            counts[r["class"]] += 1
            if r["class"] not in ("ok", "refused"):
                bad.append((key, r))
    total = sum(counts.values())
    print(f"\nmutation test: {total} damaged files: {counts['refused']} refused, {counts['ok']} bit-exact, "
          f"{counts['wrong']} wrong, {counts['crash']} crashed, {counts['hang']} hung")
    assert total == N_MUTATIONS
    assert not bad, f"{len(bad)} damaged files crashed, hung or gave different output; first: {bad[:5]}"
    assert counts["refused"] and counts["ok"]  # both outcomes are exercised


def test_damage_to_checked_bytes_is_always_refused(campaign: dict) -> None:
    """The integrity record covers the metadata and every tensor but the data companions: damage there never
    loads, and the refusal names what is damaged (or llama.cpp's own parser refused the file first)."""
    not_refused, unexplained = [], []
    for key, res in campaign["results"].items():
        model = Path(campaign["jobs"][key]["model"])
        data, ranges = model.read_bytes(), _hashed_ranges(format.read_gguf(model))
        for r in res["results"]:
            if not _changes_hashed_bytes(data, r["mutation"], ranges):
                continue
            if r["class"] != "refused" or r["stage"] != "load":
                not_refused.append((key, r))
            elif not any(k in r["reason"] for k in ("zipmoe", "gguf", "llama_model_load", "error loading")):
                unexplained.append((key, r))
    assert not not_refused, f"damage to checked bytes was not refused at load: {not_refused[:5]}"
    assert not unexplained, f"refusals without a reason: {unexplained[:5]}"


def test_integrity_names_what_is_damaged(campaign: dict) -> None:
    reasons = [r["reason"] for res in campaign["results"].values() for r in res["results"]]
    assert any("the metadata (header, key/value pairs and tensor infos" in m for m in reasons)
    assert any(m for m in reasons if "tensor '" in m and "is damaged" in m)
    assert any("checksum mismatch" in m for m in reasons)  # an expert chunk, at decode
