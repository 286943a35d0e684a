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

# Values of the keys llama.cpp may ask for (without the "<arch>." prefix): small, and consistent with each other.
KEY_DEFAULTS: dict[str, tuple[str, Any]] = {
    "context_length": ("u32", 256),
    "embedding_length": ("u32", N_EMBD),
    "block_count": ("u32", N_LAYER),
    "feed_forward_length": ("u32", 64),
    "expert_feed_forward_length": ("u32", 32),
    "expert_shared_feed_forward_length": ("u32", 32),
    "expert_count": ("u32", 4),
    "expert_used_count": ("u32", 2),
    "expert_shared_count": ("u32", 1),
    "expert_group_count": ("u32", 2),
    "expert_group_used_count": ("u32", 1),
    "expert_weights_scale": ("f32", 1.0),
    "expert_weights_norm": ("bool", True),
    "expert_gating_func": ("u32", 1),
    "leading_dense_block_count": ("u32", 1),
    "moe_every_n_layers": ("u32", 2),
    "interleave_moe_layer_step": ("u32", 2),
    "full_attention_interval": ("u32", 2),
    "nextn_predict_layers": ("u32", 0),
    "attention.head_count": ("u32", N_HEAD),
    "attention.head_count_kv": ("u32", 2),
    "attention.key_length": ("u32", HEAD_DIM),
    "attention.value_length": ("u32", HEAD_DIM),
    "attention.layer_norm_rms_epsilon": ("f32", 1e-6),
    "attention.layer_norm_epsilon": ("f32", 1e-5),
    "attention.q_lora_rank": ("u32", 32),
    "attention.kv_lora_rank": ("u32", 16),
    "attention.key_length_mla": ("u32", 24),
    "attention.value_length_mla": ("u32", 16),
    "attention.sliding_window": ("u32", 8),
    "attention.sliding_window_pattern": ("u32", 2),
    "attention.causal": ("bool", True),
    "attention.clamp_kqv": ("f32", 8.0),
    "attention.group_norm_epsilon": ("f32", 1e-5),
    "attention.group_norm_groups": ("u32", 1),
    "rope.dimension_count": ("u32", HEAD_DIM),
    "rope.freq_base": ("f32", 10000.0),
    "ssm.conv_kernel": ("u32", 4),
    "ssm.inner_size": ("u32", 128),
    "ssm.state_size": ("u32", 16),
    "ssm.time_step_rank": ("u32", 4),
    "ssm.group_count": ("u32", 1),
    "logit_scale": ("f32", 1.0),
    "embedding_scale": ("f32", 1.0),
    "residual_scale": ("f32", 1.0),
    "attention.scale": ("f32", 0.25),
    "shortconv.l_cache": ("u32", 3),
    "pooling_type": ("u32", 1),
}

# Keys an architecture gets from the start (what the loader reads as optional but a runnable model needs).
OVERRIDES: dict[str, dict[str, tuple[str, Any]]] = {}

BASE_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length",
             "expert_feed_forward_length", "expert_count", "expert_used_count", "attention.head_count",
             "attention.head_count_kv", "attention.key_length", "attention.value_length",
             "attention.layer_norm_rms_epsilon", "rope.dimension_count", "rope.freq_base")

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


def candidate_tensors(templates: list[str], n_layer: int) -> list[str]:
    """Every tensor name the templates give for n_layer blocks; templates with other placeholders are skipped."""
    names = []
    for tpl in templates:
        if re.search(r"\{(?!bid\})", tpl) or tpl.startswith(("v.", "a.", "mm.", "enc.", "dec.")):
            continue
        for suffix in (".weight", ".bias", ".scale", ""):
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
        self.proc = None
        lines = [ln for ln in err.splitlines() if ln.strip()]
        asserts = [ln for ln in lines if "GGML_ASSERT" in ln or "error" in ln.lower() or "terminate" in ln]
        return "CRASH", (asserts[0] if asserts else "no message").strip()


def _convert(value: Any, vtype: str) -> Any:
    if isinstance(value, list):
        return [_convert(v, vtype) for v in value]
    return {"f32": float, "bool": bool, "str": str}.get(vtype, int)(value)


_TYPE_NAMES = {"uint32": "u32", "int32": "i32", "float32": "f32", "bool": "bool", "string": "str", "uint64": "u64"}


def probe_arch(probe: Probe, arch: str, templates: list[str], work: Path) -> tuple[ArchSpec | None, str]:
    """(spec, "") or (None, why stock llama.cpp does not run a generated file)."""
    keys: dict[str, tuple[str, Any]] = {k: KEY_DEFAULTS[k] for k in BASE_KEYS}
    keys.update(OVERRIDES.get(arch, {}))
    tensors: dict[str, tuple[int, ...] | None] = {n: None for n in candidate_tensors(templates, N_LAYER)}
    path = work / f"{arch}.gguf"
    prefix = re.escape(arch) + r"\."
    for _ in range(MAX_STEPS):
        spec = ArchSpec(arch, tuple(ArchKey(k, t, v) for k, (t, v) in keys.items()),
                        tuple(ArchTensor(n, d or (1,)) for n, d in tensors.items()))
        write_arch_model(path, spec, placeholders=[n for n, d in tensors.items() if d is None])
        answer, crash = probe.ask(f"load {path}")
        if answer == "CRASH":
            return None, f"the loader aborts: {crash}"
        if answer == "OK":
            return finish(probe, spec, path)
        msg = answer[4:]
        if m := re.search(r"key not found in model: " + prefix + r"(\S+)", msg):
            k = m.group(1)
            if k not in KEY_DEFAULTS or k in keys:
                return None, f"needs key {arch}.{k}: {msg}"
            keys[k] = KEY_DEFAULTS[k]
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
        elif m := re.search(r"missing tensor '([^']+)'", msg):
            name = m.group(1)
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
        return None, f"evaluating aborts: {crash}"
    if not answer.startswith("OK"):
        return None, f"evaluating fails: {answer[4:]}"
    if "NONFINITE" in answer:
        return None, "evaluating gives non-finite logits"
    return spec, ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("archs", nargs="*", help="only these architectures (the others keep their entries)")
    p.add_argument("--lib-dir", type=lambda s: Path(s).resolve(), default=REPO / "build" / "llama-stock" / "bin",
                   help="libllama to ask (default: stock llama.cpp, build/llama-stock/bin)")
    p.add_argument("--out", type=Path, default=SPECS_PATH)
    p.add_argument("--dry-run", action="store_true", help="print the outcome, write nothing")
    args = p.parse_args(argv)
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
                data["excluded"][arch] = why
                print(f"{arch}: EXCLUDED: {why}", flush=True)
    data["specs"] = dict(sorted(data["specs"].items()))
    data["excluded"] = dict(sorted(data["excluded"].items()))
    if not args.dry_run:
        args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{len(data['specs'])} architectures run, {len(data['excluded'])} excluded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
