#!/usr/bin/env python3
"""Multi-token steps under a memory budget: n-gram speculation and parallel slots against single-token generation.

What it measures. llama-server runs a zipmoe GGUF inside a cgroup v1 memory limit of a fraction of the BF16 file's
size (--budgets, default 40,75 %; ZIPMOE_MEMORY_BUDGET = limit - --overhead), in three configurations, one server
at a time, interleaved (single, ngram, np4 at each budget, then the next budget, --repeat times), since the machine
is shared and its speed drifts:

  single  `llama-server -np 1`: greedy generation (temperature 0, --gen tokens) of a repetitive prompt (it asks to
          repeat a passage, the passage given twice) and of an ordinary one; tokens/s from the server's own timings
          (predicted_per_second: the generation steps, not the prompt).
  ngram   `llama-server -np 1 --spec-type ngram-simple ...` (SPECS: ngram, llama.cpp's 12-token lookup, and
  ngram1  ngram1, a 1-token lookup): the same requests, each step verifying the tokens an n-gram of the context
          drafts, or one token when it drafts none.
  ngram1b ngram1 with `--spec-backoff 16` (patches/0007): after steps that kept none of their drafted tokens the
          server skips the lookup's next 1, 2, 4, ... up to 16 drafts; a kept draft token ends that.
  synth   `llama-server -np 1` with llama.cpp's synthetic acceptance (--spec-synth-len 3, benchmarking only): a
          1-token lookup drafts up to 4 tokens and a seeded coin accepts them, 3 tokens a step on average, whatever
          the model says. The steps are real verification steps of accepted drafts, as repetitive text gives them;
          the text is not the model's greedy text (stock's, under the same seed, is the reference).
  dsynth  the same with a draft model (a tiny SYNTHETIC BF16 MoE of the preset's vocabulary, DRAFT_SHAPE), which
          drafts 4 tokens at every step: every step verifies 5 tokens and keeps 3 on average.
  np4     `llama-server -np 4`: one request alone, then four concurrent requests (four different prompts);
          aggregate tokens/s = the four requests' generated tokens over the longest one's generation time.

--configs picks configurations. --before DIR runs each one also on the programs of DIR (a build of the code before
a change), back to back with this build's, in turns, and reports after / before.

Each configuration's text must be stock llama.cpp's in the same configuration (the BF16 source, no limit, run
once first): MATCH / DIFF. Stock's own speculative text may differ from its single-token text: llama.cpp's
batched kernels round differently from its one-token ones, and a verification step can flip a near tie.

Before the measured requests each server answers one short untimed request (its cache fills, its page cache
warms). Ratios: ngram / single on each prompt, np4's four / its one.

Targets (issue 36): speculation on repetitive text >= 1.3x single-token tg at 40 %, never below 0.95x on ordinary
text (ngram1b: rejected drafts backed off); -np 4 aggregate tg at 40 % >= 2x a single slot. Each repetition's
ratio is one run against one run; a target at one budget takes the median over repetitions, one at every budget
("never below") the lowest of the budgets' medians.

The weights are SYNTHETIC (tools/dev/make_synth.py --preset PRESET, converted with `pyzipmoe convert`): random
weights generate text that does not repeat its prompt as a real model's does (its continuation of a passage
given twice is no copy of it): ngram's 12-token lookup finds nothing to draft, and ngram1 drafts wherever a token
recurs and is mostly rejected, which measures what rejected drafts cost under a budget (ngram1) and what the
backoff saves of it (ngram1b), not what a real model's repetitive text would gain: synth stands in for that.
np4's ratio is what steps of four accepted tokens are worth.
Needs root (cgroups, drop_caches),
as tools/bench/bench_budget.py, whose helpers it uses.

Example:
  sudo .venv/bin/python tools/bench/bench_multitoken.py --preset 1g --budgets 40,75 --repeat 2 --gen 48
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_budget as bb  # noqa: E402
import results as result_files  # noqa: E402

from pyzipmoe.atomic import replacing  # noqa: E402
from pyzipmoe.runtime.runner import library_path  # noqa: E402

REPO = bb.REPO
DEFAULT_WORKDIR = REPO / "build" / "bench-multitoken"
# llama.cpp's n-gram lookup (12 tokens: it drafts on text that repeats) and a 1-token lookup (it drafts wherever a
# token recurs, mostly wrong on ordinary text: what rejected drafts cost under a budget)
NGRAM1 = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1", "--spec-ngram-simple-size-m", "8",
          "--spec-ngram-simple-min-hits", "1", "--spec-draft-n-min", "0", "--spec-draft-n-max", "8"]
SPECS = {
    "ngram": ["--spec-type", "ngram-simple", "--spec-draft-n-max", "8"],
    "ngram1": NGRAM1,
    # ngram1 backing off after rejected drafts (patches/0007: it skips up to 16 drafts), so that a lookup that keeps
    # missing costs few multi-token steps
    "ngram1b": [*NGRAM1, "--spec-backoff", "16"],
    # llama.cpp's synthetic acceptance (benchmarking only): a 1-token lookup drafts up to 4 tokens and a seeded coin
    # accepts them, 3 tokens a step on average, whatever the model says: the steps a repetitive text's accepted drafts
    # make, which this SYNTHETIC model's own text never gives; its text is not the model's greedy text
    "synth": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1", "--spec-ngram-simple-size-m", "4",
              "--spec-ngram-simple-min-hits", "1", "--spec-draft-n-min", "0", "--spec-draft-n-max", "4",
              "--spec-synth-len", "3"],
    # the same acceptance with a draft model ({draft}: DRAFT_SHAPE of the preset, a tiny BF16 MoE of the same
    # vocabulary), which drafts 4 tokens at every step: every step verifies 5 tokens and keeps 3 on average
    "dsynth": ["--spec-type", "draft-simple", "-md", "{draft}", "--spec-draft-n-max", "4", "--spec-draft-n-min", "0",
               "--spec-draft-p-min", "0", "--spec-synth-len", "3"],
}
# the draft model's shape beside its preset's vocabulary and experts (as many: a store of fewer experts would make
# every step of the target route "all of a store's experts", a batch's)
DRAFT_SHAPE = {"n_layer": 1, "n_embd": 128, "n_ff_exp": 64, "n_head": 2, "n_head_kv": 1, "head_dim": 64, "seed": 1}
CONFIGS = ("single", *SPECS, "np4")
PASSAGE = ("The river runs past the old mill and under the stone bridge, where the children wait for the boats "
           "to come home in the evening light.")
PROMPTS = {
    "repetitive": f"Repeat the following passage exactly.\n{PASSAGE}\n{PASSAGE}\n",
    "ordinary": "Once upon a time, in a small town by the sea, there lived a baker who",
}
PARALLEL_PROMPTS = [PROMPTS["ordinary"], "The expert said hello to the world and then",
                    "Water and time are the two things that", "In the first chapter of the book, we"]
WARMUP = "Hello"
TARGETS = (("ngram/single repetitive at 40%", 40, "ngram:repetitive", 1.3),
           ("synth/single at 40% (accepted steps of 3 tokens, standing in for repetitive text)", 40,
            "synth:repetitive", 1.3),
           ("dsynth/single at 40% (draft model, 3 of 5 tokens kept a step, standing in for repetitive text)", 40,
            "dsynth:repetitive", 1.3),
           ("ngram/single ordinary", None, "ngram:ordinary", 0.95),
           ("ngram1/single ordinary (drafts wherever a token recurs, no backoff)", None, "ngram1:ordinary", 0.95),
           ("ngram1b/single ordinary (ngram1, --spec-backoff 16)", None, "ngram1b:ordinary", 0.95),
           ("np4/np1 aggregate at 40%", 40, "np4", 2.0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class LimitedServer:
    """llama-server in a fresh memory cgroup (bench_budget.Cgroup), cold page cache; stopped by close(), which
    returns the cgroup's stats (peak usage, OOM kills)."""

    def __init__(self, model: Path, limit: int | None, budget: int | None, parent: Path, log: Path, threads: int,
                 ctx: int, args: list[str], timeout: float, bin_dir: Path = REPO / "build" / "bin"):
        program = bin_dir / "llama-server"
        if not program.is_file():
            raise bb.BenchError(f"{program} was not built")
        self.cg = bb.Cgroup(parent, limit)
        port = free_port()
        self.url, self.log = f"http://127.0.0.1:{port}", log
        self.argv = [str(program), "-m", str(model), "--port", str(port), "-t", str(threads), "-c", str(ctx),
                     "--temp", "0", *args]
        libs = library_path(program.parent, os.environ)
        env = {**os.environ, "LD_LIBRARY_PATH": libs, **({"ZIPMOE_MEMORY_BUDGET": str(budget)} if budget else {})}
        bb.drop_page_cache()
        with open(log, "wb") as err:
            # (as bench_budget.run_limited: the shell puts itself in the cgroup, then becomes the server)
            join = 'for f in $0; do echo $$ > "$f" || exit 125; done; exec "$@"'
            self.proc = subprocess.Popen(["/bin/sh", "-c", join, " ".join(self.cg.procs), *self.argv], env=env,
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                stats = self.close()
                raise bb.BenchError(f"llama-server exited with {self.proc.returncode} ({stats}): "
                                    f"{log.read_text(errors='replace')[-600:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.2)
        self.close()
        raise bb.BenchError(f"llama-server was not ready within {timeout:.0f} s")

    def complete(self, prompt: str, n_predict: int, timeout: float) -> dict[str, Any]:
        return post(self.url + "/completion", {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "seed": 0,
                                               "cache_prompt": False}, timeout)

    def close(self) -> dict[str, int]:
        from pyzipmoe.runtime.runner import stop_group

        stop_group(self.proc)
        stats = self.cg.stats()
        self.cg.remove()
        return stats


def timing(body: dict[str, Any]) -> dict[str, Any]:
    t = body.get("timings", {})
    return {"content": body.get("content", ""), "n": t.get("predicted_n", 0), "ms": t.get("predicted_ms", 0.0),
            "tps": t.get("predicted_per_second", 0.0), "draft_n": t.get("draft_n", 0),
            "draft_accepted": t.get("draft_n_accepted", 0)}


def run_config(config: str, model: Path, limit: int | None, budget: int | None, parent: Path,
               args: argparse.Namespace, stem: str, bin_dir: Path = REPO / "build" / "bin") -> dict[str, Any]:
    """One server of `config` under `limit` (None: none), the programs of bin_dir: its requests' timings, or its
    failure."""
    draft = str(args.workdir / f"{args.preset}-draft.gguf")
    extra = {"single": ["-np", "1"], "np4": ["-np", "4"],
             **{k: ["-np", "1", *(a.replace("{draft}", draft) for a in v)] for k, v in SPECS.items()}}[config]
    ctx = 4 * (args.gen + 256) if config == "np4" else args.gen + 256
    log = args.workdir / "logs" / f"{stem}.err"
    log.parent.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"config": config, "limit_bytes": limit, "budget_bytes": budget, "log": str(log)}
    try:
        server = LimitedServer(model, limit, budget, parent, log, args.threads, ctx, extra, args.timeout, bin_dir)
    except bb.BenchError as e:
        return {**out, "status": "failed", "message": str(e)}
    out["argv"] = server.argv
    try:
        server.complete(WARMUP, 8, args.timeout)
        if config == "np4":
            out["one"] = timing(server.complete(PROMPTS["ordinary"], args.gen, args.timeout))
            t0 = time.monotonic()
            with ThreadPoolExecutor(4) as pool:
                four = [timing(b) for b in pool.map(lambda p: server.complete(p, args.gen, args.timeout),
                                                    PARALLEL_PROMPTS)]
            out["four_wall_s"] = time.monotonic() - t0
            out["four"] = four
            longest = max(r["ms"] for r in four)
            out["aggregate_tps"] = sum(r["n"] for r in four) / (longest / 1000) if longest > 0 else 0.0
        else:
            for name, prompt in PROMPTS.items():
                out[name] = timing(server.complete(prompt, args.gen, args.timeout))
        out["status"] = "ok"
    except (urllib.error.URLError, OSError, ValueError) as e:
        out["status"], out["message"] = "failed", f"{type(e).__name__}: {e}"
    finally:
        out.update(server.close())
    if out.get("oom_kill", 0) > 0 and out["status"] != "ok":
        out["status"] = "oom"
    return out


def ensure_draft(workdir: Path, preset: str) -> Path:
    """workdir/PRESET-draft.gguf, the draft model (SYNTHETIC: the preset's vocabulary and experts, DRAFT_SHAPE)."""
    from dataclasses import replace

    from pyzipmoe import synth

    path = workdir / f"{preset}-draft.gguf"
    if not path.is_file():
        part = path.with_name(path.name + ".part")
        synth.write_config(part, replace(synth.PRESETS[preset], **DRAFT_SHAPE))
        part.replace(path)
    return path


def run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    parent = bb.check_environment(args.cgroup_parent)
    bf16, model = bb.ensure_models(args.workdir, args.preset, args.routing, 2, False, args.codec)
    size = bf16.stat().st_size
    # stock llama.cpp on the BF16 source, no limit: the text each configuration must give (llama.cpp's batched
    # kernels round differently from its one-token ones, so a verified draft may change stock's text too)
    res_stock = {}
    specs = [c for c in args.configs if c in SPECS]
    if "dsynth" in specs:
        ensure_draft(args.workdir, args.preset)
    for config in ("single", *specs):
        bb.say(f"stock {config} (the reference text) ...")
        r = run_config(config, bf16, None, None, parent, args, f"{args.preset}-stock-{config}")
        if r["status"] != "ok":
            raise bb.BenchError(f"stock llama-server {config}: {r.get('message')}")
        res_stock[config] = {name: r[name]["content"] for name in PROMPTS}
    res: dict[str, Any] = {"command": result_files.command_line(result_files.script_argv(__file__, argv)),
                           "stock": res_stock, "preset": args.preset, "routing": args.routing, "model": str(model),
                           "bf16_bytes": size, "overhead_bytes": args.overhead, "gen": args.gen,
                           "specs": {k: SPECS[k] for k in specs}, "before": str(args.before) if args.before else None,
                           "prompts": PROMPTS, "parallel_prompts": PARALLEL_PROMPTS, "synthetic": True, "runs": []}
    # with --before, each configuration runs on both builds back to back, in turns (before first, then after first)
    variants = [("this", REPO / "build" / "bin")] if not args.before else [("before", args.before),
                                                                           ("after", REPO / "build" / "bin")]
    n = 0
    for rep in range(args.repeat):
        for pct in args.budgets:
            limit = int(size * pct / 100)
            for config in args.configs:
                for variant, bin_dir in variants if n % 2 == 0 else variants[::-1]:
                    bb.say(f"[{rep + 1}/{args.repeat}] {pct:g}% {config} {variant} ...")
                    r = run_config(config, model, limit, limit - args.overhead, parent, args,
                                   f"{args.preset}-{pct:g}-{config}-{rep}-{variant}", bin_dir)
                    r.update(rep=rep, budget_pct=pct, variant=variant)
                    res["runs"].append(r)
                    if args.json:  # (after each run: a stopped benchmark keeps what it measured)
                        with replacing(args.json, 0o644, "w") as f:
                            f.write(json.dumps(res, indent=1) + "\n")
                n += 1
    return res


def variants(res: dict[str, Any]) -> list[str]:
    """The builds measured, in the order the report gives them (before, after; or this build alone)."""
    names = {r.get("variant", "this") for r in res["runs"]}
    return [v for v in ("before", "after", "this") if v in names]


def ratios(res: dict[str, Any], variant: str = "this") -> list[dict[str, Any]]:
    """Per budget and repetition, for one build: spec / single per prompt (and whether the text matched), np4 four
    / one."""
    rows = []
    for pct in sorted({r["budget_pct"] for r in res["runs"]}):
        for rep in sorted({r["rep"] for r in res["runs"]}):
            got = {r["config"]: r for r in res["runs"] if r["budget_pct"] == pct and r["rep"] == rep and
                   r["status"] == "ok" and r.get("variant", "this") == variant}
            row: dict[str, Any] = {"budget_pct": pct, "rep": rep}
            single, np4 = got.get("single"), got.get("np4")
            stock = res.get("stock", {})
            for spec, name in [(spec, name) for spec in res["specs"] for name in PROMPTS]:
                sp, key = got.get(spec), f"{spec}:{name}"
                if single and sp and single[name]["tps"] > 0:
                    row[key] = sp[name]["tps"] / single[name]["tps"]
                    row[key + "_match"] = (sp[name]["content"] == stock.get(spec, {}).get(name) and
                                           single[name]["content"] == stock.get("single", {}).get(name))
                    row[key + "_accepted"] = f"{sp[name]['draft_accepted']}/{sp[name]['draft_n']}"
                    row[key + "_tps"] = (single[name]["tps"], sp[name]["tps"])
            if np4 and np4["one"]["tps"] > 0:
                row["np4"] = np4["aggregate_tps"] / np4["one"]["tps"]
                row["np4_tps"] = (np4["one"]["tps"], np4["aggregate_tps"])
                row["np4_match"] = np4["one"]["content"] == stock.get("single", {}).get("ordinary")
            rows.append(row)
    return rows


def print_report(res: dict[str, Any]) -> None:
    print(f"SYNTHETIC weights: preset {res['preset']} ({res['routing']} routing), BF16 {res['bf16_bytes'] / 2**20:.0f} "
          f"MiB, {res['gen']} tokens a request; budget = limit - {res['overhead_bytes'] / 2**20:.0f} MiB "
          f"(the machine's state: the result file's notes)")
    for spec, spec_args in res["specs"].items():
        print(f"{spec}: {' '.join(spec_args)}")
    if res.get("before"):
        print(f"before: the programs of {res['before']}; after: this build; each configuration ran on both back to "
              "back, in turns")
    print("text: MATCH where zipmoe's text is stock llama.cpp's (BF16 source, no limit) in the same configuration")
    stock = res.get("stock", {})
    for spec, name in [(spec, name) for spec in res["specs"] for name in PROMPTS]:
        if name in stock.get(spec, {}) and stock[spec][name] != stock["single"][name]:
            synthetic = ", and synthetic acceptance keeps drafts the model would not" if "synth" in spec else ""
            print(f"  stock's own {name} text with {spec} is NOT its single-token text (llama.cpp's batched kernels "
                  f"round differently{synthetic})")
    tables = {v: ratios(res, v) for v in variants(res)}
    print(f"{'build':>6} {'budget':>6} {'rep':>3} {'spec':>7} | {'repetitive t/s single->spec':>28} {'x':>5} "
          f"{'acc/draft':>9} {'text':>5} | {'ordinary t/s single->spec':>26} {'x':>5} {'acc/draft':>9} {'text':>5}")
    for variant, rows in tables.items():
        for row, spec in [(row, spec) for row in rows for spec in res["specs"]]:
            cells = []
            for key in (f"{spec}:{name}" for name in PROMPTS):
                if key in row:
                    a, b = row[key + "_tps"]
                    cells.append(f"{a:>12.2f} -> {b:>12.2f} {row[key]:>5.2f} {row[key + '_accepted']:>9} "
                                 f"{'MATCH' if row[key + '_match'] else 'DIFF':>5}")
                else:
                    cells.append(f"{'-':>28} {'-':>5} {'-':>9} {'-':>5}")
            print(f"{variant:>6} {row['budget_pct']:>5g}% {row['rep']:>3} {spec:>7} | " + " | ".join(cells))
    print(f"{'build':>6} {'budget':>6} {'rep':>3} | {'np4 t/s one -> four':>20} {'x':>5} {'text':>5}")
    for variant, rows in tables.items():
        for row in rows:
            if "np4" in row:
                a, b = row["np4_tps"]
                print(f"{variant:>6} {row['budget_pct']:>5g}% {row['rep']:>3} | {a:>8.2f} -> {b:>8.2f} "
                      f"{row['np4']:>5.2f} {'MATCH' if row['np4_match'] else 'DIFF':>5}")
    if "before" in tables and "after" in tables:
        print("after / before tokens/s, median over repetitions (single: both prompts; spec: both prompts; np4: "
              "the four requests' aggregate):")
        for pct in sorted({r["budget_pct"] for r in res["runs"]}):
            cells = []
            for config in dict.fromkeys(r["config"] for r in res["runs"]):
                vals = {v: [] for v in ("before", "after")}
                for r in res["runs"]:
                    if r["budget_pct"] == pct and r["config"] == config and r["status"] == "ok" and \
                            r.get("variant") in vals:
                        vals[r["variant"]] += ([r["aggregate_tps"]] if config == "np4" else
                                               [r[name]["tps"] for name in PROMPTS])
                if vals["before"] and vals["after"]:
                    b, a = statistics.median(vals["before"]), statistics.median(vals["after"])
                    cells.append(f"{config} {b:.2f} -> {a:.2f} ({a / b:.2f}x)" if b > 0 else f"{config} -")
            print(f"  {pct:g}%: " + ", ".join(cells))
    for r in res["runs"]:
        if r["status"] != "ok":
            print(f"{r.get('variant', 'this')} {r['budget_pct']:g}% {r['config']} rep {r['rep']}: {r['status']}: "
                  f"{r.get('message', '')[:300]}")
    peaks = [f"{r.get('variant', 'this')} {r['budget_pct']:g}% {r['config']} {r.get('peak_bytes', 0) / 2**20:.0f}/"
             f"{r['limit_bytes'] / 2**20:.0f}" for r in res["runs"] if r["rep"] == 0]
    print("peak/limit MiB (rep 0): " + ", ".join(peaks))
    for variant, rows in tables.items():
        print(f"targets, {variant} (median over repetitions; a target at every budget: the lowest budget's median):")
        for label, pct, key, goal in TARGETS:
            medians = {b: statistics.median(vals) for b in sorted({row["budget_pct"] for row in rows})
                       if (pct is None or b == pct)
                       and (vals := [row[key] for row in rows if key in row and row["budget_pct"] == b])}
            if not medians:
                print(f"  {label}: not measured")
                continue
            at = min(medians, key=medians.get)
            what = "median" if pct is not None else f"lowest median ({at:g}%)"
            value = medians[at]
            print(f"  {label} >= {goal}: {what} {value:.2f}x {'met' if value >= goal else 'NOT met'}")


def _configs(text: str) -> list[str]:
    names = [c for c in text.split(",") if c]
    bad = [c for c in names if c not in CONFIGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown configuration(s) {bad}; choose from {','.join(CONFIGS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    from pyzipmoe.synth import PRESETS

    p.add_argument("--preset", choices=sorted(PRESETS), default="1g", help="synthetic model (default: %(default)s)")
    p.add_argument("--routing", choices=("uniform", "skewed"), default="uniform")
    p.add_argument("--budgets", type=bb._budgets, default=bb._budgets("40,75"), metavar="P,P,...",
                   help="memory limits, %% of the BF16 file (default: 40,75)")
    p.add_argument("--overhead", type=bb._size, default=256 * bb.MIB, metavar="SIZE",
                   help="limit - budget: KV cache, compute buffers, the program (default: 256MiB)")
    p.add_argument("--gen", type=int, default=48, help="tokens a request generates (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=2, metavar="N", help="interleaved repetitions (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600, metavar="S", help="per server start and request")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="models and logs (default: %(default)s)")
    p.add_argument("--codec", choices=("huff", "esc", "zstd"), default=None,
                   help="the converter's codec (default: esc where SIMD decodes it, else huff)")
    p.add_argument("--cgroup-parent", metavar="PATH", help="memory cgroup to make the runs' cgroups in")
    p.add_argument("--configs", type=_configs, default=list(CONFIGS), metavar="C,C,...",
                   help=f"configurations to run, of {','.join(CONFIGS)} (default: all)")
    p.add_argument("--before", type=Path, metavar="DIR",
                   help="a build's bin directory (llama-server and its libraries) of the code before a change: every "
                        "configuration also runs on it, interleaved with this build's")
    p.add_argument("--json", type=Path, metavar="FILE", help="every run's raw results (rewritten after each run)")
    p.add_argument("--report", type=Path, metavar="FILE", help="print the tables of an earlier --json, no runs")
    p.add_argument("--note", action="append", default=[], metavar="TEXT",
                   help="a line for the result file's notes (what the builds were, what the machine did); repeatable")
    result_files.add_arguments(p)
    args = p.parse_args(argv)
    args.codec = args.codec or bb.default_bench_codec()
    try:
        res = json.loads(args.report.read_text()) if args.report else run(args, argv)
    except bb.BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print_report(res)
    notes, day = None, None
    if args.report:  # the numbers were taken when the JSON was last written
        notes = [f"the tables of {args.report}, printed by --report"
                 + (f"; measured by `{res['command']}`" if "command" in res else "")]
        day = datetime.date.fromtimestamp(args.report.stat().st_mtime)
    notes = (notes or []) + args.note or None
    result_files.write(args, "multitoken", result_files.printed(print_report, res),
                       weights=f"{result_files.SYNTHETIC} (tools/dev/make_synth.py, preset {res['preset']})",
                       json_path=args.report or args.json, notes=notes, day=day,
                       argv=result_files.script_argv(__file__, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
