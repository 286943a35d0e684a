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
from helpers import REPO, assert_bit_identical, llama_bin_dir, load_tool, stderr_tail, unavailable, worker_env

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

def stateless_eval(llm, tokens, n_gen):
    # a model without memory (diffusion LMs, encoders: no KV cache) sees the whole sequence at each step
    for step in range(n_gen + 1):
        llm._batch.set_batch(batch=tokens, n_past=0, logits_all=True)
        llm._ctx.decode(llm._batch)
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(len(tokens) * llm._n_vocab,))
        logits = logits.reshape(len(tokens), llm._n_vocab).copy()
        if step < n_gen:
            tokens = tokens + [int(np.argmax(logits[-1]))]
    return logits, tokens

out, arrays = [], {}
for i, run in enumerate(job["runs"]):
    res = {"run": run}
    out.append(res)
    try:
        llm = Llama(run["model"], n_ctx=job["n_ctx"], n_threads=run["threads"], n_threads_batch=run["threads"],
                    logits_all=True, seed=0, verbose=False, prefill=False, embedding=job["embed"],
                    **run.get("zipmoe", {}))
    except Exception as e:
        res["error"] = f"load: {type(e).__name__}: {e}"
        continue
    try:
        res["served"] = bool(llm.zipmoe_served)
        if llm.zipmoe_served:
            zipmoe_stats_reset()
        tokens = llm.tokenize(job["prompt"].encode())
        res["prompt"] = [int(t) for t in tokens]
        if job["embed"]:
            arrays[f"run{i}"] = np.array(llm.embed(job["prompt"]), dtype=np.float32).reshape(-1, llm.n_embd())
            res["generated"] = []
        elif llm._ctx.memory is None:
            logits, seq = stateless_eval(llm, list(tokens), job["n_gen"])
            arrays[f"run{i}"] = logits
            res["generated"] = seq[len(tokens):]
        else:
            llm.eval(tokens)
            generated = []
            for _ in range(job["n_gen"]):
                nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                generated.append(nxt)
                llm.eval([nxt])
            arrays[f"run{i}"] = np.array(llm.scores[: llm.n_tokens], dtype=np.float32)
            res["generated"] = generated
        if llm.zipmoe_served:
            res["stats"] = llm.zipmoe_stats()
    except Exception as e:
        res["error"] = f"eval: {type(e).__name__}: {e}"
    finally:
        llm.close()
np.savez(job["out"], **arrays)
print(json.dumps(out))
"""

# Embedding models: llama.cpp computes embeddings, not logits, for them; their embeddings are compared instead.
EMBEDDING = {"llama-embed", "nomic-bert-moe"}


def run_models(lib_dir: Path, runs: list[dict[str, Any]], out: Path, embed: bool = False
               ) -> tuple[list[dict[str, Any]], dict]:
    """Each run ({"model", "threads", "zipmoe": Llama's zipmoe arguments}) in one child on the libllama in lib_dir:
    the prompt and N_GEN greedy tokens; (reports, logits of run i as "run{i}", for every position). embed: the
    prompt's embeddings instead (an embedding model)."""
    job = {"runs": runs, "prompt": PROMPT, "n_gen": N_GEN, "n_ctx": N_CTX, "out": str(out), "embed": embed}
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
        unavailable(f"no stock llama.cpp build at {stock_bin} (`bash tools/dev/build_stock.sh` builds it)")
    return stock_bin


def _case(arch: str) -> Any:
    if arch in EXCLUDED:
        return pytest.param(arch, marks=pytest.mark.skip(reason=f"left out: {EXCLUDED[arch]}"))
    if arch in NOT_VERIFIED:
        return pytest.param(arch, marks=pytest.mark.xfail(strict=True, reason=NOT_VERIFIED[arch]))
    return arch


def test_every_architecture_with_expert_tensors_has_a_case() -> None:
    """The cases are gguf-py's architectures with `_exps` tensors (the vendored llama.cpp's), each with a spec or a
    reason, and each spec'd one is VERIFIED or says why not."""
    constants = REPO / "build" / "llama.cpp" / "gguf-py" / "gguf" / "constants.py"
    if not constants.is_file():
        unavailable(f"{constants} is not there (tools/dev/fetch_llama.sh extracts it)")
    probe = load_tool("dev/probe_archs.py")
    assert ARCHS == sorted(probe.moe_archs(probe.vendored_constants()))
    assert not SPECS.keys() & EXCLUDED.keys()
    assert VERIFIED | NOT_VERIFIED.keys() == SPECS.keys() and not VERIFIED & NOT_VERIFIED.keys()


@pytest.mark.parametrize("arch", [_case(a) for a in ARCHS])
def test_architecture(arch: str, ours: Path, stock: Path, tmp_path: Path) -> None:
    spec = SPECS[arch]
    plain = write_arch_model(tmp_path / "plain.gguf", spec)
    check_model(arch, plain, sum(t.is_expert for t in spec.tensors), ours, stock, tmp_path)


QUANTIZED = [("gpt-oss", "MXFP4_MOE"), ("qwen2moe", "F16"), ("glm4moe", "Q8_0")]


@pytest.mark.parametrize("arch, qtype", QUANTIZED)
def test_quantized_experts(arch: str, qtype: str, ours: Path, stock: Path, tmp_path: Path) -> None:
    """The same checks on the model quantized by llama-quantize: MXFP4 (gpt-oss's own expert type) and Q8_0
    experts are stored raw, F16 ones split and coded."""
    from pyzipmoe.file.gguf import read_gguf
    from pyzipmoe.synth import quantize

    spec = SPECS[arch]
    bf16 = write_arch_model(tmp_path / "bf16.gguf", spec)
    try:
        plain = quantize(bf16, tmp_path / "plain.gguf", qtype, program=ours / "llama-quantize", threads=1)
    except FileNotFoundError as e:  # llama-quantize, which the build makes
        unavailable(str(e))
    types = {t.ggml_type for t in read_gguf(plain).tensors if t.name.endswith("_exps.weight")}
    assert types and all(t not in (0, 30) for t in types), types  # no F32/BF16 experts left
    check_model(f"{arch} {qtype}", plain, sum(t.is_expert for t in spec.tensors), ours, stock, tmp_path)


def check_model(label: str, plain: Path, n_experts: int, ours: Path, stock: Path, tmp_path: Path) -> None:
    """convert/verify/unpack `plain`, then zipmoe's runs of both files against stock's run of `plain`."""
    from pyzipmoe.file.convert import convert
    from pyzipmoe.file.verify import unpack, verify
    from pyzipmoe.runtime.budget import model_memory

    packed, restored = tmp_path / "zipmoe.gguf", tmp_path / "restored.gguf"
    report = convert(plain, packed, chunk_n=CHUNK_N, threads=1)
    assert len(report.tensors) == n_experts, [t.name for t in report.tensors]
    verify(packed, plain, threads=1)
    unpack(packed, restored, threads=1)
    assert restored.read_bytes() == plain.read_bytes()

    embed = label.split()[0] in EMBEDDING
    ref_reports, ref = run_models(stock, [{"model": str(plain), "threads": t} for t in (1, 2)], tmp_path / "s.npz",
                                  embed)
    for i, r in enumerate(ref_reports):
        assert "error" not in r, r
        logits = ref[f"run{i}"]
        rows = logits.shape[0] if embed else len(r["prompt"]) + N_GEN
        assert logits.shape[0] == rows and np.isfinite(logits).all(), (label, logits.shape)
        assert np.ptp(logits, axis=1).min() > 0 and not (logits[0] == logits[-1]).all(), f"{label}: degenerate"

    need, plain_need = model_memory(packed), model_memory(plain)
    budgets = {"none": {}, "minimum": {"memory_budget": str(need.minimum)},
               "between": {"memory_budget": str(need.minimum + need.expert_bytes // 2)}}
    runs = [{"model": str(packed), "threads": t, "zipmoe": z, "what": f"zipmoe file, budget {b}, {t} threads"}
            for b, z in budgets.items() for t in (1, 2)]
    runs += [{"model": str(plain), "threads": t, "what": f"plain file under a budget, {t} threads",
              "zipmoe": {"memory_budget": str(plain_need.minimum + plain_need.expert_bytes // 2)}} for t in (1, 2)]
    reports, got = run_models(ours, runs, tmp_path / "o.npz", embed)
    for i, (run, r) in enumerate(zip(runs, reports, strict=True)):
        what = f"{label}: {run['what']}"
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


# ------------------------------------------------------------------------------- convert's expert forms


def _spec_with(arch: str, extra: tuple[Any, ...] = (), rename: str | None = None) -> Any:
    from dataclasses import replace

    spec = SPECS[arch]
    return replace(spec, arch=rename or arch, tensors=spec.tensors + tuple(extra))


@pytest.mark.parametrize("name, dims", [
    ("blk.0.ffn_up_exps.weight", (64, 32)),  # an expert matrix that is not 3-D
    ("blk.0.ffn_lora_exps.weight", (64, 8, 4)),  # an expert tensor of a kind zipmoe does not know
    ("blk.0.ffn_down_exps.bias", (64, 4, 2)),  # a bias of more than 2 dimensions
])
def test_convert_refuses_an_unknown_expert_tensor_form_naming_it(tmp_path: Path, name: str, dims: tuple[int, ...]
                                                                 ) -> None:
    from pyzipmoe.errors import UnsupportedError
    from pyzipmoe.file.convert import convert
    from pyzipmoe.synth_arch import ArchTensor

    base = SPECS["qwen3moe"]
    tensors = tuple(t for t in base.tensors if t.name != name) + (ArchTensor(name, dims),)
    from dataclasses import replace
    src = write_arch_model(tmp_path / "odd.gguf", replace(base, tensors=tensors))
    with pytest.raises(UnsupportedError) as e:
        convert(src, tmp_path / "out.gguf", threads=1)
    message = str(e.value)
    assert "\n" not in message and name in message and "does not know" in message, message
    assert not (tmp_path / "out.gguf").exists()


def test_convert_keeps_expert_biases_scales_and_norms_plain(tmp_path: Path) -> None:
    """gpt-oss's expert biases, per-expert input scales and arctic's expert norm are kept as they are, only the 3-D
    expert matrices are compressed, and the source is restored byte for byte."""
    from pyzipmoe.file.convert import convert
    from pyzipmoe.file.verify import verify
    from pyzipmoe.synth_arch import ArchTensor

    n_expert = next(t.dims[-1] for t in SPECS["qwen3moe"].tensors if t.is_expert)
    input_scales = _spec_with("qwen3moe", [ArchTensor(f"blk.{i}.ffn_{k}_exps.input_scale", (n_expert,))
                                           for i in range(2) for k in ("gate", "up", "down")])
    for arch, spec in (("gpt-oss", SPECS["gpt-oss"]), ("arctic", SPECS["arctic"]), ("qwen3moe", input_scales)):
        side = [t.name for t in spec.tensors if "_exps" in t.name and not t.is_expert]
        assert side, arch
        src = write_arch_model(tmp_path / f"{arch}.gguf", spec)
        report = convert(src, tmp_path / f"{arch}.zipmoe.gguf", threads=1, warn=lambda note: None)
        assert sorted(t.name for t in report.tensors) == sorted(t.name for t in spec.tensors if t.is_expert)
        verify(tmp_path / f"{arch}.zipmoe.gguf", src, threads=1)  # restores the source byte for byte


def test_convert_warns_once_for_an_architecture_it_was_not_checked_on(tmp_path: Path) -> None:
    from pyzipmoe.architectures import VERIFIED
    from pyzipmoe.file.convert import convert

    notes: list[str] = []
    known = write_arch_model(tmp_path / "known.gguf", SPECS["qwen3moe"])
    convert(known, tmp_path / "known.zipmoe.gguf", threads=1, warn=notes.append)
    assert notes == [] and "qwen3moe" in VERIFIED
    other = write_arch_model(tmp_path / "other.gguf", _spec_with("qwen3moe", rename="qwen3moe-unchecked"))
    report = convert(other, tmp_path / "other.zipmoe.gguf", threads=1, warn=notes.append)
    assert len(notes) == 1 and "qwen3moe-unchecked" in notes[0] and "docs/architectures.md" in notes[0], notes
    assert report.warnings == tuple(notes)
    done = subprocess.run([sys.executable, "-m", "pyzipmoe", "convert", str(other), str(tmp_path / "cli.gguf"),
                           "--threads", "1"], capture_output=True, text=True, check=False, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("zipmoe: warning: architecture qwen3moe-unchecked") == 1, done.stderr


def test_docs_table_lists_what_holds_per_architecture() -> None:
    """docs/architectures.md has a row per architecture: VERIFIED ones as passing, the others with their reason."""
    text = (REPO / "docs" / "architectures.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line for line in text.splitlines()
            if line.startswith("| `")}
    assert sorted(rows) == ARCHS
    for arch in VERIFIED:
        assert "yes" in rows[arch].split("|")[2], rows[arch]
    for arch in EXCLUDED.keys() | NOT_VERIFIED.keys():
        assert "yes" not in rows[arch].split("|")[2], rows[arch]


def test_generated_models_are_reproducible_and_say_synthetic(tmp_path: Path) -> None:
    from gguf import GGUFReader

    spec = SPECS["gpt-oss"]
    a = write_arch_model(tmp_path / "a.gguf", spec)
    b = write_arch_model(tmp_path / "b.gguf", spec)
    assert a.read_bytes() == b.read_bytes()
    assert write_arch_model(tmp_path / "c.gguf", spec, seed=1).read_bytes() != a.read_bytes()
    reader = GGUFReader(a)
    assert "SYNTHETIC" in reader.fields["general.name"].contents()
    assert "SYNTHETIC" in reader.fields["general.description"].contents()
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    assert shapes == {t.name: list(t.dims) for t in spec.tensors}
    experts = [t for t in reader.tensors if t.name.endswith("_exps.weight")]
    assert experts and all(t.tensor_type.name == "BF16" for t in experts)
