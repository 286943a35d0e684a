#!/usr/bin/env python3
"""End-to-end speed of zipmoe in llama.cpp: a synthetic BF16 MoE GGUF against its zipmoe GGUF, same build.

Measures prompt processing (pp: one batch of --prompt tokens) and generation (tg: --gen single-token decode
steps from an empty context, random tokens as llama-bench does) in tokens/s, through llama-cpp-python on
zipmoe's libllama, for
  BF16    cold  first run after loading the BF16 GGUF
          warm  after a warmup prompt (the baseline: BF16 as llama.cpp runs it every day)
  zipmoe  cold  first run after loading the zipmoe GGUF, unbounded expert cache: experts are decoded as
                the router first asks for them (pp: nearly all at once; tg: a few per token)
          warm  after warmup prompts have materialised every expert the router picks (until all are resident
                or two more prompts add none; the runtime's counters show how many, and that the measurements
                decoded none)
and prints each against BF16 warm, all from the same run. Every cold measurement runs in a fresh process;
as root, the page cache is dropped before it (echo 1 > /proc/sys/vm/drop_caches), so it includes reading
the file; otherwise the file is probably still cached from the previous step (the output says which).
Warm numbers are the median of --reps repetitions.

The models (preset 1g by default: ~1.05 GiB of BF16, 10 layers of 32 experts) are generated with
pyzipmoe.synth and converted into --workdir, and reused by later runs until the code that writes them
changes (a .stamp file next to each records it).

Examples:
  python3 tools/bench/bench_e2e.py                          # 1g preset, all cores, 512-token prompt, 64 tokens
  python3 tools/bench/bench_e2e.py --threads 8 --reps 5
  python3 tools/bench/bench_e2e.py --preset small --prompt 128 --gen 16   # a quick smoke test (~64 MB model)
  python3 tools/bench/bench_e2e.py --json > e2e.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results.py and failures.py, beside this script
import results as result_files  # noqa: E402
from failures import one_line_errors  # noqa: E402

DEFAULT_WORKDIR = REPO / "build" / "bench-e2e"
WORKER_TIMEOUT = 3600


class BenchError(Exception):
    pass


# ------------------------------------------------------------------------------------------ the models


# the code that writes the cached models, under pyzipmoe/: a change to it makes them again
SYNTH_SOURCES = ["synth.py"]
CONVERT_SOURCES = ["file/convert.py", "file/expert_forms.py", "file/fileio.py", "file/sizes.py", "file/writer.py",
                   "file/metadata.py", "file/codec.py", "_native.py"]


def _stamp(sources: list[str], extra: str) -> str:
    """What a cached file depends on: the code that wrote it and its settings."""
    h = hashlib.sha256(extra.encode())
    for name in sources:
        h.update((REPO / "pyzipmoe" / name).read_bytes())
    return h.hexdigest()


def _fresh(path: Path, stamp: str) -> bool:
    marker = path.with_name(path.name + ".stamp")
    return path.is_file() and marker.is_file() and marker.read_text().strip() == stamp


def _mark(path: Path, stamp: str) -> None:
    path.with_name(path.name + ".stamp").write_text(stamp + "\n")


def ensure_models(workdir: Path, preset: str, arch: str, threads: int, regenerate: bool,
                  say: Any) -> tuple[Path, Path]:
    """The BF16 GGUF and its zipmoe GGUF in workdir, made again only when the code that writes them (or the
    preset) changed since they were made, or when asked to."""
    from pyzipmoe.file import convert
    from pyzipmoe import synth

    workdir.mkdir(parents=True, exist_ok=True)
    bf16 = workdir / f"{preset}-{arch}.gguf"
    packed = workdir / f"{preset}-{arch}.zipmoe.gguf"
    config = synth.for_arch(synth.PRESETS[preset], arch)
    bf16_stamp = _stamp(SYNTH_SOURCES, repr(config))
    packed_stamp = _stamp(CONVERT_SOURCES, bf16_stamp)
    if regenerate or not _fresh(bf16, bf16_stamp):
        say(f"generating {bf16} (synthetic, preset {preset}) ...")
        t = time.perf_counter()
        synth.write_config(bf16, config)
        _mark(bf16, bf16_stamp)
        say(f"  {bf16.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - t:.1f} s")
    if regenerate or not _fresh(packed, packed_stamp):
        say(f"converting it to {packed} ...")
        report = convert.convert(bf16, packed, threads=threads)
        _mark(packed, packed_stamp)
        say(f"  {report.output_size / 2**30:.2f} GiB in {report.seconds:.1f} s")
    return bf16, packed


def drop_page_cache() -> str | None:
    """Drops the page cache; returns why it could not, or None."""
    if os.geteuid() != 0:
        return "not root"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError as e:
        return f"/proc/sys/vm/drop_caches: {e.strerror or e}"
    return None


# -------------------------------------------------------------------------------------- measurements


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """Runs in a child process: load the model, then one kind of measurement."""
    import numpy as np

    from pyzipmoe.runtime.llama import Llama, zipmoe_stats

    t0 = time.perf_counter()
    llm = Llama(job["model"], n_ctx=job["prompt"] + job["gen"] + 8, n_batch=job["prompt"], n_ubatch=job["prompt"],
                n_threads=job["threads"], n_threads_batch=job["threads"], verbose=False, zipmoe_cache="unbounded")
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0}
    n_vocab = llm.n_vocab()
    rng = np.random.default_rng(job["seed"])
    bos = llm.token_bos()

    def tokens(n: int) -> list[int]:
        return [bos] + [int(t) for t in rng.integers(259, n_vocab, n - 1)]  # past the special and byte tokens

    prompt = tokens(job["prompt"])
    gen = [int(t) for t in rng.integers(259, n_vocab, job["gen"])]

    def pp() -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        return len(prompt) / (time.perf_counter() - t)

    def tg() -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval([bos])
        for tok in gen[:-1]:
            llm.eval([tok])
        return len(gen) / (time.perf_counter() - t)

    def stats() -> dict[str, float] | None:
        return zipmoe_stats() if llm.is_zipmoe else None

    total, bf16_bytes = None, 0
    if llm.is_zipmoe:
        from pyzipmoe.file.reader import open_zipmoe

        infos = [c.expert.info for c in open_zipmoe(job["model"]).compressed]
        total = sum(i.n_expert for i in infos)
        bf16_bytes = sum(i.n_expert * i.n_per_expert * 2 for i in infos)
        zipmoe_stats(reset=True)

    def resident(s: dict[str, float]) -> int:
        """Experts kept decoded (runtimes that count bytes, not experts: in proportion to the BF16 size)."""
        if "experts_resident" in s:
            return int(s["experts_resident"])
        return round(total * s.get("hot_bytes", 0) / bf16_bytes)
    try:
        if job["kind"] == "cold-pp":
            out["pp"] = [pp()]
            out["stats"] = stats()
        elif job["kind"] == "cold-tg":
            out["tg"] = [tg()]
            out["stats"] = stats()
        else:  # warm
            # warmup: the measured work itself (so that it decodes nothing), then random prompts until every
            # expert is resident or two more prompts add none: a router may never pick some experts (the
            # synthetic models have a few of these, trained models too)
            pp()
            tg()
            rounds, stale, kept = 0, 0, -1
            while rounds < 32 and stale < 2:
                llm.reset()
                llm.eval(tokens(job["prompt"]))
                rounds += 1
                s = stats()
                if s is None or resident(s) >= total:
                    break
                stale = stale + 1 if resident(s) == kept else 0
                kept = resident(s)
            out["warmup_rounds"] = rounds
            out["stats_after_warmup"] = s
            out["resident_after_warmup"] = None if s is None else resident(s)
            if llm.is_zipmoe:
                zipmoe_stats(reset=True)
            out["pp"] = [pp() for _ in range(job["reps"])]
            out["tg"] = [tg() for _ in range(job["reps"])]
            out["stats"] = stats()  # warm: nothing should have been decoded
    finally:
        llm.close()
    out["experts_total"] = total
    return out


def measure(job: dict[str, Any], cold: bool) -> dict[str, Any]:
    from pyzipmoe.runtime.config import RUNTIME_ENV

    dropped = drop_page_cache() if cold else "warm"
    env = {k: v for k, v in os.environ.items() if k not in RUNTIME_ENV}  # an unbounded cache, always
    done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True,
                          env=env, timeout=WORKER_TIMEOUT, check=False)
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        raise BenchError(f"{job['kind']} run of {job['model']} failed: {lines[-1] if lines else done.returncode}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["page_cache"] = "dropped" if dropped is None else f"not dropped ({dropped})"
    return result


class OtherLoad:
    """CPU time used by other processes while the benchmark runs (Linux): all busy time in /proc/stat minus
    this process's and its children's."""

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
        own = sum(os.times()[:4])  # user + system, of this process and its waited-for children
        return busy, own, time.monotonic()

    def result(self) -> float | None:
        """Average number of CPUs other processes kept busy."""
        end = self._sample()
        if self.start is None or end is None or end[2] <= self.start[2]:
            return None
        return max(0.0, (end[0] - self.start[0]) - (end[1] - self.start[1])) / (end[2] - self.start[2])


def _median(xs: list[float] | None) -> float | None:
    return statistics.median(xs) if xs else None


def run(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    from pyzipmoe import llama_lib_dir

    lib = llama_lib_dir()
    if lib is None:
        raise BenchError("zipmoe's llama.cpp is not built (no build/bin/libllama.so); run `bash tools/setup.sh`")
    bf16, packed = ensure_models(args.workdir, args.preset, args.arch, args.threads, args.regenerate, say)
    others = OtherLoad()
    base = {"prompt": args.prompt, "gen": args.gen, "threads": args.threads, "reps": args.reps, "seed": args.seed}
    runs: dict[str, dict[str, Any]] = {}
    for name, path in (("bf16", bf16), ("zipmoe", packed)):
        for kind in ("cold-pp", "cold-tg", "warm"):
            say(f"{name}: {kind} ...")
            r = measure({**base, "model": str(path), "kind": kind}, cold=kind != "warm")
            key = f"{name}_{'cold' if kind != 'warm' else 'warm'}"
            merged = runs.setdefault(key, {"file": str(path), "file_size": path.stat().st_size})
            for field in ("pp", "tg"):
                if field in r:
                    merged[field] = r[field]
                    merged[f"{field}_stats"] = r.get("stats")
            merged.setdefault("load_s", r["load_s"])
            merged["page_cache"] = r["page_cache"]
            if kind == "warm":
                for field in ("warmup_rounds", "stats_after_warmup", "resident_after_warmup"):
                    merged[field] = r.get(field)
            merged["experts_total"] = r.get("experts_total")
    for r in runs.values():
        r["pp_tps"], r["tg_tps"] = _median(r.get("pp")), _median(r.get("tg"))
    ref = runs["bf16_warm"]
    ratios = {f"{key}_{m}": runs[key][f"{m}_tps"] / ref[f"{m}_tps"]
              for key in ("zipmoe_cold", "zipmoe_warm", "bf16_cold") for m in ("pp", "tg")}
    ratios["zipmoe_cold_vs_bf16_cold_pp"] = runs["zipmoe_cold"]["pp_tps"] / runs["bf16_cold"]["pp_tps"]
    ratios["zipmoe_cold_vs_bf16_cold_tg"] = runs["zipmoe_cold"]["tg_tps"] / runs["bf16_cold"]["tg_tps"]
    return {"preset": args.preset, "arch": args.arch, "threads": args.threads, "prompt_tokens": args.prompt,
            "gen_tokens": args.gen, "reps": args.reps, "libllama": str(lib), "runs": runs, "ratios": ratios,
            "cpus": os.cpu_count(), "other_processes_cpus": others.result()}


def print_report(res: dict[str, Any]) -> None:
    p, g = res["prompt_tokens"], res["gen_tokens"]
    runs, ratios = res["runs"], res["ratios"]
    header = ("model", "size", "load", f"pp{p} t/s", "vs BF16 warm", f"tg{g} t/s", "vs BF16 warm", "page cache")
    rows = []
    for key, label in (("bf16_cold", "BF16, cold"), ("bf16_warm", "BF16, warm"), ("zipmoe_cold", "zipmoe, cold"),
                       ("zipmoe_warm", "zipmoe, warm")):
        r = runs[key]
        if key == "bf16_warm":
            rel = ("1.00x", "1.00x")
        else:
            rel = (f"{ratios[key + '_pp']:.2f}x", f"{ratios[key + '_tg']:.2f}x")
        rows.append((label, f"{r['file_size'] / 2**30:.2f} GiB", f"{r['load_s']:.2f} s", f"{r['pp_tps']:.1f}", rel[0],
                     f"{r['tg_tps']:.2f}", rel[1], r["page_cache"]))
    widths = [max(len(str(x[i])) for x in [header, *rows]) for i in range(len(header))]
    for line in [header, *rows]:
        print("  ".join([f"{line[0]:<{widths[0]}}", *(f"{c:>{w}}" for c, w in zip(line[1:], widths[1:]))]))
    cold, warm = runs["zipmoe_cold"], runs["zipmoe_warm"]
    total = cold.get("experts_total")
    for m in ("pp", "tg"):
        s = cold.get(f"{m}_stats")
        if s:
            print(f"zipmoe cold {m}: {s['experts_decoded']} of {total} experts decoded "
                  f"({s['bytes_decoded'] / 2**30:.2f} GiB BF16, {s['decode_seconds']:.2f} s of decoding summed "
                  f"over threads)")
    n = warm.get("resident_after_warmup")
    if n is not None:
        during = (warm.get("pp_stats") or {}).get("experts_decoded")
        never = "" if n >= total else f" (the other {total - n} were never routed to: two more prompts added none)"
        print(f"zipmoe warm: {n} of {total} experts resident after {warm['warmup_rounds']} warmup prompt(s){never}; "
              f"experts decoded during the measurements: {during}")
    print(f"zipmoe cold vs BF16 cold: pp {ratios['zipmoe_cold_vs_bf16_cold_pp']:.2f}x, "
          f"tg {ratios['zipmoe_cold_vs_bf16_cold_tg']:.2f}x")
    print(f"{res['preset']} {res['arch']}, {res['threads']} threads, median of {res['reps']} (warm) / 1 (cold); "
          f"libllama {res['libllama']}")
    others = res["other_processes_cpus"]
    if others is not None:
        note = ("; the numbers are noisy, rerun on an idle machine" if others > 0.2 else "")
        print(f"other processes kept {others:.2f} of {res['cpus']} CPUs busy on average during the run{note}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    from pyzipmoe.synth import PRESETS

    p.add_argument("--preset", choices=sorted(PRESETS), default="1g", help="synthetic model size (default: 1g)")
    p.add_argument("--arch", choices=("qwen3moe", "olmoe"), default="qwen3moe",
                   help="architecture (default: %(default)s)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR,
                   help="where the models live, kept between runs (default: %(default)s)")
    p.add_argument("--regenerate", action="store_true", help="generate and convert the models again")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads (default: all CPUs, %(default)s)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens of the pp test (default: %(default)s)")
    p.add_argument("--gen", type=int, default=64, help="tokens of the tg test (default: %(default)s)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of the warm measurements (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    result_files.add_arguments(p)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    for name in ("threads", "prompt", "gen", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    say = (lambda s: print(s, file=sys.stderr)) if args.json else print
    with one_line_errors("bench_e2e", BenchError, subprocess.TimeoutExpired):
        res = run(args, say)
    result_files.report(args, "e2e", res, print_report,
                        weights=f"{result_files.SYNTHETIC} (pyzipmoe.synth, preset {args.preset})",
                        script=__file__, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
