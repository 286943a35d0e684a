"""Every Mixture-of-Experts architecture of the vendored llama.cpp, from a tiny SYNTHETIC model of each.

One case per architecture that gguf-py lists with expert tensors (names as llama.cpp spells them). For an
architecture in pyzipmoe.architectures.VERIFIED, on its generated model (pyzipmoe.synth_arch):

- stock llama.cpp loads the plain GGUF and evaluates it (finite logits that are not all alike);
- `convert` compresses its expert tensors, and the zipmoe file verifies against it and unpacks byte-identical;
- zipmoe's build on the zipmoe file, without a budget, at the minimum budget and between, with 1 and 2 threads,
  gives the logits of every position (the prompt and 16 greedy tokens) and the greedy tokens of stock llama.cpp on
  the plain file, bit for bit, with every compressed expert tensor served by zipmoe;
- zipmoe's build on the plain file under a budget does too.

Architectures that stock llama.cpp cannot run from a generated file are skipped with the reason
docs/architectures.md gives (pyzipmoe/synth_arch_specs.json, "excluded"); architectures that stock runs but zipmoe
does not are expected failures (strict: fixing one fails the test until VERIFIED lists it). Each architecture's
work runs in two child processes (stock's libllama and zipmoe's), so a crash fails one case.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import REPO, assert_bit_identical, llama_bin_dir, load_tool, stderr_tail, worker_env

from pyzipmoe.architectures import NOT_VERIFIED, VERIFIED
from pyzipmoe.paths import stock_bin_dir
from pyzipmoe.synth_arch import load_exclusions, load_specs, write_arch_model

SPECS = load_specs()
EXCLUDED = load_exclusions()
ARCHS = sorted(SPECS.keys() | EXCLUDED.keys())
PROMPT = "the expert said hello to the world"
N_GEN = 16
N_CTX = 128
CHUNK_N = 256  # values per chunk: several chunks per expert of the tiny models
TIMEOUT = 300

WORKER = r"""
import json, sys
import numpy as np
job = json.loads(sys.argv[1])
from pyzipmoe.runtime.llama import Llama, zipmoe_stats_reset

out, arrays = [], {}
for i, run in enumerate(job["runs"]):
    res = {"run": run}
    out.append(res)
    try:
        llm = Llama(run["model"], n_ctx=job["n_ctx"], n_threads=run["threads"], n_threads_batch=run["threads"],
                    logits_all=True, seed=0, verbose=False, prefill=False, **run.get("zipmoe", {}))
    except Exception as e:
        res["error"] = f"load: {type(e).__name__}: {e}"
        continue
    try:
        res["served"] = bool(llm.zipmoe_served)
        if llm.zipmoe_served:
            zipmoe_stats_reset()
        tokens = llm.tokenize(job["prompt"].encode())
        llm.eval(tokens)
        generated = []
        for _ in range(job["n_gen"]):
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            generated.append(nxt)
            llm.eval([nxt])
        arrays[f"run{i}"] = np.array(llm.scores[: llm.n_tokens], dtype=np.float32)
        res.update(prompt=[int(t) for t in tokens], generated=generated)
        if llm.zipmoe_served:
            res["stats"] = llm.zipmoe_stats()
    except Exception as e:
        res["error"] = f"eval: {type(e).__name__}: {e}"
    finally:
        llm.close()
np.savez(job["out"], **arrays)
print(json.dumps(out))
"""


def run_models(lib_dir: Path, runs: list[dict[str, Any]], out: Path) -> tuple[list[dict[str, Any]], dict]:
    """Each run ({"model", "threads", "zipmoe": Llama's zipmoe arguments}) in one child on the libllama in lib_dir:
    the prompt and N_GEN greedy tokens; (reports, logits of run i as "run{i}")."""
    job = {"runs": runs, "prompt": PROMPT, "n_gen": N_GEN, "n_ctx": N_CTX, "out": str(out)}
    done = subprocess.run([sys.executable, "-c", WORKER, json.dumps(job)], env=worker_env(lib_dir),
                          capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert done.returncode == 0, f"the worker died (exit status {done.returncode}):\n{stderr_tail(done.stderr)}"
    reports = json.loads(done.stdout.strip().splitlines()[-1])
    with np.load(out) as z:
        return reports, {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def ours() -> Path:
    return llama_bin_dir()


@pytest.fixture(scope="module")
def stock() -> Path:
    stock_bin = stock_bin_dir()
    if not (stock_bin / "libllama.so").is_file():
        pytest.skip(f"no stock llama.cpp build at {stock_bin} (`bash tools/dev/build_stock.sh` builds it)")
    return stock_bin


def _case(arch: str) -> Any:
    if arch in EXCLUDED:
        return pytest.param(arch, marks=pytest.mark.skip(reason=f"stock llama.cpp does not run it: {EXCLUDED[arch]}"))
    if arch in NOT_VERIFIED:
        return pytest.param(arch, marks=pytest.mark.xfail(strict=True, reason=NOT_VERIFIED[arch]))
    return arch


def test_every_architecture_with_expert_tensors_has_a_case() -> None:
    """The cases are gguf-py's architectures with `_exps` tensors (the vendored llama.cpp's), each with a spec or a
    reason, and each spec'd one is VERIFIED or says why not."""
    constants = REPO / "build" / "llama.cpp" / "gguf-py" / "gguf" / "constants.py"
    if not constants.is_file():
        pytest.skip(f"{constants} is not there (tools/dev/fetch_llama.sh extracts it)")
    probe = load_tool("dev/probe_archs.py")
    assert ARCHS == sorted(probe.moe_archs(probe.vendored_constants()))
    assert not SPECS.keys() & EXCLUDED.keys()
    assert VERIFIED | NOT_VERIFIED.keys() == SPECS.keys() and not VERIFIED & NOT_VERIFIED.keys()


@pytest.mark.parametrize("arch", [_case(a) for a in ARCHS])
def test_architecture(arch: str, ours: Path, stock: Path, tmp_path: Path) -> None:
    from pyzipmoe.file.convert import convert
    from pyzipmoe.file.verify import unpack, verify
    from pyzipmoe.runtime.budget import model_memory

    plain, packed, restored = tmp_path / "plain.gguf", tmp_path / "zipmoe.gguf", tmp_path / "restored.gguf"
    spec = SPECS[arch]
    write_arch_model(plain, spec)
    n_experts = sum(t.is_expert for t in spec.tensors)
    report = convert(plain, packed, chunk_n=CHUNK_N, threads=1)
    assert len(report.tensors) == n_experts, [t.name for t in report.tensors]
    verify(packed, plain, threads=1)
    unpack(packed, restored, threads=1)
    assert restored.read_bytes() == plain.read_bytes()

    ref_reports, ref = run_models(stock, [{"model": str(plain), "threads": t} for t in (1, 2)], tmp_path / "s.npz")
    for i, r in enumerate(ref_reports):
        assert "error" not in r, r
        logits = ref[f"run{i}"]
        assert logits.shape[0] == len(r["prompt"]) + N_GEN and np.isfinite(logits).all(), arch
        assert np.ptp(logits, axis=1).min() > 0 and not (logits[0] == logits[-1]).all(), f"{arch}: degenerate"

    need, plain_need = model_memory(packed), model_memory(plain)
    budgets = {"none": {}, "minimum": {"memory_budget": str(need.minimum)},
               "between": {"memory_budget": str(need.minimum + need.expert_bytes // 2)}}
    runs = [{"model": str(packed), "threads": t, "zipmoe": z, "what": f"zipmoe file, budget {b}, {t} threads"}
            for b, z in budgets.items() for t in (1, 2)]
    runs += [{"model": str(plain), "threads": t, "what": f"plain file under a budget, {t} threads",
              "zipmoe": {"memory_budget": str(plain_need.minimum + plain_need.expert_bytes // 2)}} for t in (1, 2)]
    reports, got = run_models(ours, runs, tmp_path / "o.npz")
    for i, (run, r) in enumerate(zip(runs, reports, strict=True)):
        what = f"{arch}: {run['what']}"
        assert "error" not in r, (what, r)
        k = run["threads"] - 1
        assert r["prompt"] == ref_reports[k]["prompt"], what
        assert_bit_identical(got[f"run{i}"], ref[f"run{k}"], f"{what} vs stock")
        assert r["generated"] == ref_reports[k]["generated"], what
        assert r["served"], what
        stats = r["stats"]
        if run["model"] == str(packed):
            assert stats["stores"] == n_experts, (what, stats)  # every compressed expert tensor served by zipmoe
            assert stats["experts_decoded"] > 0, (what, stats)
        if run["zipmoe"].get("memory_budget") == str(need.minimum):
            assert stats["evictions"] > 0, (what, stats)  # the cache held fewer experts than were used
