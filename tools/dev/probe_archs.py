#!/usr/bin/env python3
"""Derives pyzipmoe/synth_arch_specs.json: a tiny SYNTHETIC model for every architecture with expert tensors.

For each architecture that gguf-py (the vendored llama.cpp's, build/llama.cpp/gguf-py) lists with `_exps` tensors,
this asks llama.cpp's loader (tools/dev/arch_probe.c, built here against a libllama) what it needs, starting from
the keys in KEY_DEFAULTS that every MoE reads and one placeholder tensor per name gguf-py lists:

- "key not found in model: K": K is added from KEY_DEFAULTS (an architecture that needs a key not in the table
  is excluded, saying which);
- "key K has wrong type T but expected type U": the value is converted;
- "tensor 'X' has wrong shape; expected S": X gets shape S;
- "missing tensor 'X'": X is added (as a placeholder);
- "wrong number of tensors": the placeholders the loader did not take are dropped.

When the model loads, it is evaluated (a prompt and 4 greedy tokens; logits must be finite). An architecture
that the loader or the graph refuses, or that crashes stock llama.cpp, goes to the "excluded" list with
llama.cpp's words. Overrides (OVERRIDES) set keys that the loader reads as optional but a runnable model needs.

    .venv/bin/python tools/dev/probe_archs.py [--lib-dir build/llama-stock/bin] [ARCH ...]
    .venv/bin/python tools/dev/probe_archs.py --write DIR [ARCH ...]    # the models themselves
    .venv/bin/python tools/dev/probe_archs.py --docs                    # docs/architectures.md's table
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pyzipmoe.synth_arch import SPECS_PATH, ArchKey, ArchSpec, ArchTensor, write_arch_model  # noqa: E402

N_LAYER = 4
N_EMBD = 64
N_HEAD = 4
HEAD_DIM = 16
N_CTX = 256

# The keys every generated model gets, whatever its architecture reads (after llama.cpp's own fixture,
# tests/test-llama-archs.cpp, at a smaller scale): small and consistent with each other. Without the "<arch>."
# prefix; a list is written as an array.
KEY_DEFAULTS: dict[str, tuple[str, Any]] = {
    "context_length": ("u32", N_CTX),
    "embedding_length": ("u32", N_EMBD),
    "features_length": ("u32", N_EMBD),
    "block_count": ("u32", N_LAYER),
    "leading_dense_block_count": ("u32", 1),
    "feed_forward_length": ("u32", 64),
    "use_parallel_residual": ("bool", False),
    "logit_scale": ("f32", 1.0),
    "full_attention_interval": ("u32", 2),
    "attention.head_count": ("u32", N_HEAD),
    "attention.head_count_kv": ("u32", 2),
    "attention.key_length": ("u32", HEAD_DIM),
    "attention.value_length": ("u32", HEAD_DIM),
    "rope.dimension_count": ("u32", HEAD_DIM),
    "rope.freq_base": ("f32", 10000.0),
    "attention.max_alibi_bias": ("f32", 8.0),
    "attention.clamp_kqv": ("f32", 8.0),
    "attention.layer_norm_epsilon": ("f32", 1e-5),
    "attention.layer_norm_rms_epsilon": ("f32", 1e-5),
    "attention.group_norm_epsilon": ("f32", 1e-5),
    "attention.group_norm_groups": ("u32", 8),
    "attention.q_lora_rank": ("u32", 64),
    "attention.kv_lora_rank": ("u32", 64),
    "attention.relative_buckets_count": ("u32", 8),
    "attention.sliding_window": ("u32", N_CTX // 8),
    "attention.sliding_window_pattern": ("u32", 2),
    "attention.indexer.head_count": ("u32", 8),
    "attention.indexer.key_length": ("u32", 64),
    "attention.indexer.top_k": ("u32", 131072),
    "attention.indexer.block_size": ("u32", 4),
    "attention.indexer.kpool": ("u32", 4),
    "attention.indexer.kpool_select_tail": ("bool", True),
    "attention.indexer.local_blocks": ("u32", 1),
    "rope.dimension_sections": ("u32", [HEAD_DIM // 4] * 4),
    "expert_feed_forward_length": ("u32", 32),
    "expert_shared_feed_forward_length": ("u32", 48),
    "expert_latent_length": ("u32", 32),
    "interleave_moe_layer_step": ("u32", 2),
    "expert_count": ("u32", 4),
    "expert_used_count": ("u32", 2),
    "expert_shared_count": ("u32", 1),
    "expert_gating_func": ("u32", 2),
    "expert_group_scale": ("f32", 1.0),
    "experts_per_group": ("u32", 1),
    "ssm.inner_size": ("u32", 2 * N_EMBD),
    "ssm.conv_kernel": ("u32", 4),
    "ssm.state_size": ("u32", 16),
    "ssm.time_step_rank": ("u32", N_HEAD),
    "ssm.group_count": ("u32", 2),
    "kda.head_dim": ("u32", HEAD_DIM),
    "kda.safe_gate": ("bool", True),
    "kda.gate_lower_bound": ("f32", -5.0),
    "wkv.head_size": ("u32", HEAD_DIM),
    "shortconv.l_cache": ("u32", 3),
    "residual_scale": ("f32", 1.0),
    "attn_res.block_size": ("u32", 12),
    "activation.situ_beta": ("f32", 4.0),
    "activation.situ_linear_beta": ("f32", 25.0),
}

_HYBRID_HEADS = [0 if i % 2 else N_HEAD for i in range(N_LAYER)]  # odd layers recurrent
_ALTERNATE = [i % 2 for i in range(N_LAYER)]
# multi-head latent attention, after test-llama-archs.cpp at 1/8 of its size: the cache row is the latent
# (kv_lora_rank) and the rope part; a head is 16 no-rope + 8 rope dimensions
_MLA = {"attention.head_count": ("u32", 2), "attention.head_count_kv": ("u32", 1),
        "attention.key_length": ("u32", 72), "attention.value_length": ("u32", 64),
        "rope.dimension_count": ("u32", 8), "attention.key_length_mla": ("u32", 24),
        "attention.value_length_mla": ("u32", 16)}

# Per-architecture changes (as test-llama-archs.cpp makes them, or what a runnable model needs).
OVERRIDES: dict[str, dict[str, tuple[str, Any]]] = {
    "olmoe": {"attention.head_count_kv": ("u32", N_HEAD)},  # its q/k norms span the whole q and k
    "afmoe": {"attention.head_count_kv": ("u32", 2)},
    **{a: dict(_MLA) for a in ("deepseek2", "deepseek32", "glm-dsa", "mistral4", "hy_v4")},
    "deepseek2-ocr": {"attention.head_count_kv": ("u32", N_HEAD)},  # multi-head attention, no latent
    "minimax-m3": {"attention.indexer.head_count": ("u32", 2)},  # one indexer head per key/value head
    "dots3note": {**_MLA, "attention.kv_lora_rank_swa": ("u32", 64), "attention.key_length_swa": ("u32", 72),
                  "attention.value_length_swa": ("u32", 64), "attention.key_length_mla_swa": ("u32", 24),
                  "attention.value_length_mla_swa": ("u32", 16), "rope.freq_base_swa": ("f32", 10000.0),
                  "attention.indexer.types": ("u32", [1 - a for a in _ALTERNATE]),
                  "attention.sliding_window_pattern": ("u32", _ALTERNATE)},
    **{a: {**_MLA, "attention.head_count": ("u32", [0 if i % 2 else 2 for i in range(N_LAYER)]),
           "attention.head_count_kv": ("u32", [0 if i % 2 else 1 for i in range(N_LAYER)])}
       for a in ("kimi-linear", "bailingmoe3", "kimi-k3")},
    **{a: {"attention.head_count": ("u32", _HYBRID_HEADS), "attention.head_count_kv": ("u32", _HYBRID_HEADS)}
       for a in ("jamba", "granitehybrid", "lfm2moe")},
    "nemotron_h_moe": {"attention.head_count": ("u32", _HYBRID_HEADS),
                       "attention.head_count_kv": ("u32", [0, 0, N_HEAD, 0]),
                       "feed_forward_length": ("u32", [0, 0, 0, 64])},
    **{a: {"attention.sliding_window_pattern": ("u32", _ALTERNATE)}
       for a in ("cohere2moe", "mimo2", "step35", "granite_swa", "maple")},
    "maple": {"attention.sliding_window_pattern": ("u32", _ALTERNATE), "swiglu_clamp_exp": ("f32", 7.0)},
    "gemma4": {"embedding_length_per_layer_input": ("u32", N_EMBD // 2), "attention.shared_kv_layers": ("u32", 0),
               "attention.key_length_swa": ("u32", HEAD_DIM), "attention.value_length_swa": ("u32", HEAD_DIM),
               "rope.freq_base_swa": ("f32", 10000.0),
               "attention.sliding_window_pattern": ("bool", [i % 5 != 4 for i in range(5)]), "block_count": ("u32", 5)},
    "llama4": {"block_count": ("u32", 4)},
    "deepseek4": {"attention.head_count": ("u32", 8), "attention.head_count_kv": ("u32", 1),
                  "attention.key_length": ("u32", 8), "attention.value_length": ("u32", 8),
                  "rope.dimension_count": ("u32", 4), "attention.q_lora_rank": ("u32", 16),
                  "attention.output_group_count": ("u32", 8), "attention.output_lora_rank": ("u32", 8),
                  "attention.compress_ratios": ("u32", [0, 0, 4, 128]),
                  "attention.compress_rope_freq_base": ("f32", 160000.0), "hyper_connection.count": ("u32", 4),
                  "hyper_connection.sinkhorn_iterations": ("u32", 2), "hyper_connection.epsilon": ("f32", 1e-6),
                  "hash_layer_count": ("u32", 0), "swiglu_clamp_exp": ("f32", 10.0),
                  "expert_weights_scale": ("f32", 1.0), "expert_weights_norm": ("bool", True),
                  "expert_gating_func": ("u32", 4)},
    # gated delta net: value heads (time_step_rank) of the key head size (state_size)
    **{a: {"ssm.inner_size": ("u32", N_HEAD * 16)} for a in ("qwen3next", "qwen35moe")},
    "qwen4exp": {"ssm.inner_size": ("u32", N_HEAD * 16), "hyper_connection.count": ("u32", 4),
                 "hyper_connection.sinkhorn_iterations": ("u32", 2), "hyper_connection.epsilon": ("f32", 1e-6),
                 "hyper_connection.low_rank": ("u32", 8), "attention.compress_ratios": ("u32", [4] * N_LAYER),
                 "ple.layers": ("u32", [0]), "ple.ngram_size": ("u32", 3), "ple.heads_per_ngram": ("u32", 2),
                 "ple.conv_kernel": ("u32", 4), "ple.eos_token_id": ("u32", 0),
                 "embedding_length_per_layer_input": ("u32", N_EMBD // 4),
                 "ple.layer_multipliers": ("u64", [1, 3, 5]), "ple.head_offsets": ("u64", [h * 320 for h in range(4)]),
                 "ple.head_vocab_sizes": ("u64", [320] * 4), "attention.indexer.head_count": ("u32", 2),
                 "attention.indexer.key_length": ("u32", HEAD_DIM)},
    # its MLA has no rope part (the cache row is the latent alone); KDA heads come from head_count
    "glm5-next": {**_MLA, "attention.key_length": ("u32", 64), "rope.dimension_count": ("u32", 0),
                  "attention.head_count_kv": ("u32", [0 if i % 2 else 1 for i in range(N_LAYER)]),
                  "hyper_connection.count": ("u32", 4), "hyper_connection.sinkhorn_iterations": ("u32", 2),
                  "hyper_connection.epsilon": ("f32", 1e-6), "hyper_connection.low_rank": ("u32", 8),
                  "attention.compress_ratios": ("u32", [4] * N_LAYER)},
    "bailingmoe3_extra": {},
    "nomic-bert-moe": {"tokenizer.ggml.token_type_count": ("u32", 2), "moe_every_n_layers": ("u32", 2)},
    "dflash": {"target_layers": ("u32", [1]), "attention.sliding_window_pattern": ("u32", _ALTERNATE)},
}
OVERRIDES["bailingmoe3"].update({"rope.dimension_sections": ("u32", [1, 1, 2, 0]),
                                 "swiglu_clamp_exp": ("f32", [0.0, 4.0, 0.0, 4.0]),
                                 "swiglu_clamp_shexp": ("f32", [0.0, 5.0, 0.0, 5.0])})
OVERRIDES["hy_v4"].update({"hyper_connection.count": ("u32", 4), "hyper_connection.epsilon": ("f32", 1e-6),
                           "hyper_connection.magnitude": ("f32", 2.0), "swiglu_clamp_exp": ("f32", 10.0),
                           "expert_weights_scale": ("f32", 1.0), "expert_weights_norm": ("bool", True),
                           "attention.indexer.types": ("u32", [1 - a for a in _ALTERNATE])})
del OVERRIDES["bailingmoe3_extra"]

# Tensors whose shape the loader takes from the file instead of checking it: their shape, by name without "blk.N.".
TENSOR_HINTS: dict[str, dict[str, tuple[int, ...]]] = {
    "laguna": {"attn_gate.weight": (N_EMBD, N_HEAD)},  # a gate per head (or per element)
    "qwen4exp": {"per_layer_token_embd.weight": (N_EMBD // 4, 4 * 320)},  # rows of every PLE head
}

# Tensors not to offer an architecture (by name without "blk.N."): optional ones whose presence takes the loader down
# a path its models do not have (kimi-linear reads no q_lora_rank, so a q-lora would have no width; the legacy
# unsplit attn_kv_b of the kimi models does not go with the latent cache their keys describe).
SKIP_TENSORS: dict[str, tuple[str, ...]] = {
    "kimi-linear": ("attn_q_a_norm", "attn_q_a", "attn_q_b", "attn_kv_b"),
    "kimi-k3": ("attn_kv_b",),
    # its full-attention layers (1 and 3) build q, k and v apart; a fused qkv there leaves q unset
    "qwen4exp": ("blk.1.attn_qkv", "blk.3.attn_qkv"),
}

# What llama.cpp's words for a left-out architecture mean, where they do not say it themselves.
EXPLANATIONS: dict[str, str] = {
    "deci": "llama.cpp's deci loader (models/deci.cpp) creates no expert tensors, although gguf-py lists them",
    "dflash": "a speculative drafter: llama.cpp runs it on a target model's hidden states, not on tokens, and its "
              "own fixture (tests/test-llama-archs.cpp) skips it too",
}

# Keys added only when the loader asks for them.
LAZY_KEYS: dict[str, tuple[str, Any]] = {
    "expert_weights_scale": ("f32", 1.0),
    "expert_weights_norm": ("bool", True),
    "nextn_predict_layers": ("u32", 0),
    "moe_every_n_layers": ("u32", 2),
    "attention.causal": ("bool", True),
    "attention.scale": ("f32", 0.25),
    "embedding_scale": ("f32", 1.0),
    "pooling_type": ("u32", 1),
    "swiglu_clamp_exp": ("f32", 7.0),
    "swiglu_clamp_shexp": ("f32", 7.0),
    "hyper_connection.count": ("u32", 2),
    "hyper_connection.sinkhorn_iterations": ("u32", 2),
    "hyper_connection.epsilon": ("f32", 1e-6),
    "attention.key_length_mla": ("u32", 24),
    "attention.value_length_mla": ("u32", 16),
    "target_layers": ("u32", [1]),
}

MAX_STEPS = 600


def vendored_constants() -> ModuleType:
    """gguf-py's constants.py of the vendored llama.cpp (newer than the installed gguf package)."""
    path = REPO / "build" / "llama.cpp" / "gguf-py" / "gguf" / "constants.py"
    spec = importlib.util.spec_from_file_location("vendored_gguf_constants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def moe_archs(c: ModuleType) -> dict[str, list[str]]:
    """Architecture name -> the tensor name templates gguf-py lists for it, for architectures with `_exps` tensors
    (clip, the vision/audio encoder, is no language model)."""
    out = {}
    for arch, tensors in c.MODEL_TENSORS.items():
        names = [c.TENSOR_NAMES[t] for t in tensors if t in c.TENSOR_NAMES]
        name = c.MODEL_ARCH_NAMES[arch]
        if name != "clip" and any("_exps" in n for n in names):
            out[name] = names
    return out


# Architectures whose models get per-expert output scales (`ffn_*_exps.scale`, which llama.cpp takes for any
# architecture but few models have): enough to cover that path without making it every model's.
EXPERT_SCALES = frozenset({"deepseek2", "gpt-oss", "llama", "qwen3moe"})


def candidate_tensors(templates: list[str], n_layer: int, expert_scales: bool = False) -> list[str]:
    """Every tensor name the templates give for n_layer blocks; templates with other placeholders are skipped."""
    names = []
    for tpl in templates:
        if re.search(r"\{(?!bid\})", tpl) or tpl.startswith(("v.", "a.", "mm.", "enc.", "dec.")):
            continue
        for suffix in (".weight", ".bias", ".scale", ""):
            if suffix == ".scale" and tpl.endswith("_exps") and not expert_scales:
                continue
            if "{bid}" in tpl:
                names += [tpl.format(bid=i) + suffix for i in range(n_layer)]
            else:
                names.append(tpl + suffix)
    return list(dict.fromkeys(names))


class Probe:
    """tools/dev/arch_probe.c, compiled against libllama in lib_dir, as a child answering load/eval requests."""

    def __init__(self, lib_dir: Path, exe: Path):
        self.lib_dir, self.exe = lib_dir, exe
        self.proc: subprocess.Popen[str] | None = None

    @staticmethod
    def build(lib_dir: Path, out: Path) -> Path:
        inc = [REPO / "build" / "llama.cpp" / "include", REPO / "build" / "llama.cpp" / "ggml" / "include"]
        cmd = ["cc", "-O1", "-o", str(out), str(REPO / "tools" / "dev" / "arch_probe.c"),
               *[f"-I{d}" for d in inc], f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}", "-lllama", "-lggml", "-lggml-base",
               "-lm"]
        subprocess.run(cmd, check=True)
        return out

    def ask(self, request: str) -> tuple[str, str]:
        """("OK ..."/"ERR ...", "") or ("CRASH", stderr tail) when the child died."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([str(self.exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True,
                                         env={"LD_LIBRARY_PATH": str(self.lib_dir), "PATH": "/usr/bin:/bin",
                                              "GGML_NO_BACKTRACE": "1"})
        assert self.proc.stdin and self.proc.stdout
        try:
            self.proc.stdin.write(request + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        while line := self.proc.stdout.readline():
            if line.startswith(("OK", "ERR")):
                return line.strip(), ""
        self.proc.wait()
        err = self.proc.stderr.read() if self.proc.stderr else ""
        lines = [ln for ln in err.splitlines() if ln.strip()]
        asserts = [ln for ln in lines if "GGML_ASSERT" in ln or "error" in ln.lower() or "terminate" in ln
                   or re.search(r"\.(?:c|cpp):\d+: ", ln)]
        code, self.proc = self.proc.returncode, None
        if asserts:
            return "CRASH", asserts[0].strip()
        return "CRASH", f"it dies without a message ({_status(code)})"


def _status(code: int | None) -> str:
    import signal

    if code is not None and code < 0:
        return signal.Signals(-code).name
    return f"exit status {code}"


def _convert(value: Any, vtype: str) -> Any:
    if isinstance(value, list):
        return [_convert(v, vtype) for v in value]
    return {"f32": float, "bool": bool, "str": str}.get(vtype, int)(value)


_TYPE_NAMES = {"uint32": "u32", "int32": "i32", "float32": "f32", "bool": "bool", "string": "str", "uint64": "u64"}


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    """Whether SKIP_TENSORS names `name`, with or without its block and its suffix."""
    short = re.sub(r"^blk\.\d+\.", "", name)
    return any(n in skip for n in (name, name.rsplit(".", 1)[0], short, short.rsplit(".", 1)[0]))


def probe_arch(probe: Probe, arch: str, templates: list[str], work: Path) -> tuple[ArchSpec | None, str]:
    """(spec, "") or (None, why stock llama.cpp does not run a generated file)."""
    keys: dict[str, tuple[str, Any]] = dict(KEY_DEFAULTS)
    keys.update(OVERRIDES.get(arch, {}))
    hints = TENSOR_HINTS.get(arch, {})
    skip = SKIP_TENSORS.get(arch, ())
    tensors: dict[str, tuple[int, ...] | None] = {n: hints.get(re.sub(r"^blk\.\d+\.", "", n))
                                                  for n in candidate_tensors(templates, N_LAYER, arch in EXPERT_SCALES)
                                                  if not _skipped(n, skip)}
    path = work / f"{arch}.gguf"
    prefix = re.escape(arch) + r"\."
    for _ in range(MAX_STEPS):
        spec = ArchSpec(arch, tuple(ArchKey(k, t, v) for k, (t, v) in keys.items()),
                        tuple(ArchTensor(n, d or (1,)) for n, d in tensors.items()))
        write_arch_model(path, spec, placeholders=[n for n, d in tensors.items() if d is None])
        answer, crash = probe.ask(f"load {path}")
        if answer == "CRASH":
            return None, f"loading crashes: {crash}"
        if answer == "OK":
            return finish(probe, spec, path)
        msg = answer[4:]
        if m := re.search(r"key not found in model: " + prefix + r"(\S+)", msg):
            k = m.group(1)
            if k not in LAZY_KEYS or k in keys:
                return None, f"needs key {arch}.{k}: {msg}"
            keys[k] = LAZY_KEYS[k]
        elif m := re.search(r"key " + prefix + r"(\S+) has wrong type (\w+) but expected type (\w+)", msg):
            k, want = m.group(1), _TYPE_NAMES.get(m.group(3))
            if want is None or keys[k][0] == want:
                return None, msg
            keys[k] = (want, _convert(keys[k][1], want))
        elif m := re.search(r"tensor '([^']+)' has wrong shape; expected ([\d, ]+), got", msg):
            name, dims = m.group(1), tuple(int(x) for x in m.group(2).split(","))
            if tensors.get(name) is not None:
                return None, msg
            tensors[name] = dims
        elif m := re.search(r"missing tensor '([^']+)'|tensor '([^']+)' not found", msg):
            name = m.group(1) or m.group(2)
            if name in tensors:
                return None, msg
            tensors[name] = None
        elif "wrong number of tensors" in msg:
            unused = [n for n, d in tensors.items() if d is None]
            if not unused:
                return None, msg
            for n in unused:
                del tensors[n]
        else:
            return None, msg
    return None, f"no loadable file after {MAX_STEPS} steps"


def finish(probe: Probe, spec: ArchSpec, path: Path) -> tuple[ArchSpec | None, str]:
    if not any(t.is_expert for t in spec.tensors):
        return None, "the loader takes no expert tensor from a generated file"
    write_arch_model(path, spec)
    answer, crash = probe.ask(f"eval {path}")
    if answer == "CRASH":
        return None, f"evaluating crashes: {crash}"
    if not answer.startswith("OK"):
        return None, f"evaluating fails: {answer[4:]}"
    if "NONFINITE" in answer:
        return None, "evaluating gives non-finite logits"
    return spec, ""


def dump_specs(data: dict[str, Any]) -> str:
    """The specs file: one key or tensor a line, so that a change of llama.cpp shows as a readable diff."""
    out = ["{", ' "specs": {']
    archs = list(data["specs"].items())
    for i, (arch, spec) in enumerate(archs):
        out.append(f"  {json.dumps(arch)}: {{")
        out.append('   "keys": [')
        out.append(",\n".join("    " + json.dumps(k) for k in spec["keys"]))
        out.append("   ],")
        out.append('   "tensors": [')
        out.append(",\n".join("    " + json.dumps(t) for t in spec["tensors"]))
        out.append("   ]")
        out.append("  }" + ("," if i < len(archs) - 1 else ""))
    out.append(" },")
    out.append(' "excluded": ' + json.dumps(data["excluded"], indent=2).replace("\n", "\n ") )
    out.append("}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("archs", nargs="*", help="only these architectures (the others keep their entries)")
    p.add_argument("--lib-dir", type=lambda s: Path(s).resolve(), default=REPO / "build" / "llama-stock" / "bin",
                   help="libllama to ask (default: stock llama.cpp, build/llama-stock/bin)")
    p.add_argument("--out", type=Path, default=SPECS_PATH)
    p.add_argument("--dry-run", action="store_true", help="print the outcome, write nothing")
    p.add_argument("--docs", action="store_true", help="only rewrite the table of docs/architectures.md")
    p.add_argument("--write", type=Path, metavar="DIR",
                   help="only write the generated model of each architecture with a spec (or of ARCH ...) to DIR")
    args = p.parse_args(argv)
    if args.docs:
        write_docs()
        return 0
    if args.write:
        from pyzipmoe.synth_arch import load_specs

        specs = load_specs()
        args.write.mkdir(parents=True, exist_ok=True)
        for arch in args.archs or sorted(specs):
            if arch not in specs:
                p.error(f"{arch}: no spec (pyzipmoe/synth_arch_specs.json lists it as excluded, or it is unknown)")
            print(write_arch_model(args.write / f"{arch}.gguf", specs[arch]))
        return 0
    archs = moe_archs(vendored_constants())
    chosen = args.archs or sorted(archs)
    unknown = [a for a in chosen if a not in archs]
    if unknown:
        p.error(f"not architectures with expert tensors in gguf-py: {', '.join(unknown)}")
    data: dict[str, Any] = {"specs": {}, "excluded": {}}
    if args.out.exists() and args.archs:
        data = json.loads(args.out.read_text())
    with tempfile.TemporaryDirectory(prefix="zipmoe-probe-") as tmp:
        work = Path(tmp)
        probe = Probe(args.lib_dir, Probe.build(args.lib_dir, work / "arch_probe"))
        for arch in chosen:
            spec, why = probe_arch(probe, arch, archs[arch], work)
            data["specs"].pop(arch, None)
            data["excluded"].pop(arch, None)
            if spec is not None:
                data["specs"][arch] = spec.to_json()
                print(f"{arch}: ok ({sum(t.is_expert for t in spec.tensors)} expert tensors, "
                      f"{len(spec.tensors)} tensors)", flush=True)
            else:
                why = why.replace(str(REPO / "build" / "llama.cpp") + "/", "")
                if arch in EXPLANATIONS:
                    why = f"{EXPLANATIONS[arch]} ({why})"
                data["excluded"][arch] = why
                print(f"{arch}: EXCLUDED: {why}", flush=True)
    data["specs"] = dict(sorted(data["specs"].items()))
    data["excluded"] = dict(sorted(data["excluded"].items()))
    if not args.dry_run:
        args.out.write_text(dump_specs(data))
    print(f"{len(data['specs'])} architectures run, {len(data['excluded'])} excluded")
    return 0



# ------------------------------------------------------------------------------------ docs/architectures.md

DOCS = REPO / "docs" / "architectures.md"
TABLE_START, TABLE_END = "<!-- table: tools/dev/probe_archs.py --docs -->", "<!-- end of table -->"


def expert_forms(spec: ArchSpec) -> str:
    """What a spec's expert tensors are, in words: the compressed matrices, then what stays plain."""
    base = {re.sub(r"^blk\.\d+\.", "", t.name) for t in spec.tensors}
    mats = [k for k in ("gate", "up", "gate_up", "down") if f"ffn_{k}_exps.weight" in base]
    parts = ["/".join(mats)]
    if any(n.endswith("_exps.bias") for n in base):
        parts.append("biases")
    if any(n.endswith("_exps.scale") for n in base):
        parts.append("scales")
    if "ffn_norm_exps.weight" in base:
        parts.append("expert norm")
    if any("shexp" in n for n in base):
        parts.append("shared expert (plain)")
    if any("chexps" in n for n in base):
        parts.append("chunk experts (plain)")
    if any("exp_probs_b" in n for n in base):
        parts.append("selection bias")
    return ", ".join(parts)


def docs_table(specs: dict[str, ArchSpec], excluded: dict[str, str]) -> str:
    from pyzipmoe.architectures import NOT_VERIFIED, VERIFIED

    rows = ["| Architecture | All checks | Expert tensors | Notes |", "|---|---|---|---|"]
    for arch in sorted(specs.keys() | excluded.keys()):
        if arch in excluded:
            why = excluded[arch].replace("|", "\\|")
            rows.append(f"| `{arch}` | no | | left out: {why} |")
        elif arch in VERIFIED:
            rows.append(f"| `{arch}` | yes | {expert_forms(specs[arch])} | |")
        else:
            rows.append(f"| `{arch}` | no | {expert_forms(specs[arch])} | {NOT_VERIFIED.get(arch, '')} |")
    return "\n".join(rows)


def write_docs() -> None:
    from pyzipmoe.synth_arch import load_exclusions, load_specs

    text = DOCS.read_text()
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    DOCS.write_text(head + TABLE_START + "\n" + docs_table(load_specs(), load_exclusions()) + "\n" + TABLE_END + tail)


if __name__ == "__main__":
    sys.exit(main())
