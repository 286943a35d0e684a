#!/usr/bin/env python3
"""Memory pressure in a container (issue 38): pyzipmoe.Llama with memory_budget="auto" in a cgroup v1 memory limit,
generating greedily while a neighbour process in the same cgroup takes memory, then gives it back. Reports the
cache's size over time (the monitor's budget and the runtime's resident bytes, per token), whether anything was
OOM-killed, and whether the tokens are the unconstrained run's (the BF16 model's where --bf16 is given, else the
same zipmoe file without a budget).

    sudo python tools/bench/bench_pressure.py --preset small --neighbour grow --plot
    sudo python tools/bench/bench_pressure.py --model m.zipmoe.gguf --bf16 m.gguf --limit 600MB --neighbour instant

--limit: the container's limit (default: what the process holds before loading, measured in the cgroup, plus the
model's whole budget, the margin and 24 MiB: "auto" starts with every expert decoded). The neighbour takes a
third of the limit: `grow` by --step every 0.5 s, `instant` at once; it holds it --hold seconds, then leaves.
Needs root and the cgroup v1 memory controller. Writes its dated result via tools/bench/results.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROMPT = "the expert model said hello to the world of water and time, and then the people"
MiB = 1 << 20

WORKER = r"""
import json, os, sys, time
import numpy as np
job = json.loads(sys.argv[1])
from pyzipmoe import _native
from pyzipmoe.file.reader import open_zipmoe
from pyzipmoe.runtime.budget import model_memory
from pyzipmoe.runtime.llama import Llama, zipmoe_stats
def put(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.rename(path + ".tmp", path)
def wait_for(path):
    while not os.path.exists(path):
        time.sleep(0.02)
if job.get("baseline"):
    if job["model"].endswith(".zipmoe.gguf"):
        model_memory(open_zipmoe(job["model"]))
    put(job["baseline"], {})
    wait_for(job["limited"])
kw = {"memory_budget": job["budget"]} if job.get("budget") else {}
llm = Llama(job["model"], n_ctx=job["n_ctx"], n_threads=job["threads"], n_threads_batch=job["threads"], seed=0,
            verbose=False, **kw)
mon = llm.zipmoe_monitor
loaded = mon.budget if mon else None  # what auto chose at load, before any re-plan
def resident():
    s = zipmoe_stats()
    return int(s["hot_bytes"] + s["warm_bytes"] + s["sm_bytes"])
llm.eval(llm.tokenize(job["prompt"].encode()))
if job.get("ready"):
    put(job["ready"], {"budget": mon.budget if mon else None, "resident": resident() if mon else 0})
gen, series, t0 = [], [], time.monotonic()
for i in range(job["n_gen"]):
    logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
    tok = int(np.argmax(logits))
    gen.append(tok)
    llm.eval([tok])
    if mon is not None:
        series.append((round(time.monotonic() - t0, 3), mon.budget, resident()))
    if job.get("pace"):
        time.sleep(job["pace"])
    if job.get("stop") and os.path.exists(job["stop"]):
        break
out = {"generated": gen, "series": series, "loaded_budget": loaded,
       "replans": [b for b, _ in mon.replans] if mon else [], "signals": list(mon.signals) if mon else [],
       "wakeups": mon.wakeups if mon else 0, "floor": mon.floor if mon else None}
llm.close()
print(json.dumps(out))
"""

NEIGHBOUR = r"""
import json, os, sys, time
job = json.loads(sys.argv[1])
chunks, t0 = [], time.monotonic()
log = []
while sum(len(c) for c in chunks) < job["target"]:
    chunks.append(bytearray(min(job["step"], job["target"] - sum(len(c) for c in chunks))))
    log.append((round(time.monotonic() - t0, 3), sum(len(c) for c in chunks)))
    if sum(len(c) for c in chunks) < job["target"]:
        time.sleep(job["every"])
time.sleep(job["hold"])
print(json.dumps({"log": log}))
"""


def cg_read(cg: Path, name: str) -> int:
    return int((cg / name).read_text().split()[0])


def cg_in_use(cg: Path) -> int:
    stats = dict(ln.split() for ln in (cg / "memory.stat").read_text().splitlines())
    return cg_read(cg, "memory.usage_in_bytes") - int(stats.get("total_inactive_file", 0)) - int(
        stats.get("total_active_file", 0))


def oom_kills(cg: Path) -> int:
    for line in (cg / "memory.oom_control").read_text().splitlines():
        k, _, v = line.partition(" ")
        if k == "oom_kill":
            return int(v)
    return 0


def env_for(build: Path) -> dict[str, str]:
    from pyzipmoe.runtime.config import RUNTIME_ENV

    env = {k: v for k, v in os.environ.items() if k not in RUNTIME_ENV}
    env["LLAMA_CPP_LIB_PATH"] = str(build / "bin")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_worker(job: dict[str, Any], env: dict[str, str], cg: Path | None = None) -> subprocess.Popen[str]:
    prefix = ("/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cg / "cgroup.procs")) if cg else ()
    return subprocess.Popen([*prefix, sys.executable, "-c", WORKER, json.dumps(job)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def wait_file(path: Path, proc: subprocess.Popen[str]) -> None:
    while not path.exists():
        if proc.poll() is not None:
            raise SystemExit(f"the worker ended first (exit status {proc.returncode}):\n{proc.stderr.read()[-2000:]}")
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a zipmoe GGUF (default: the --preset's, made in a temporary folder)")
    p.add_argument("--bf16", type=Path, help="its BF16 GGUF, for the reference tokens")
    p.add_argument("--preset", default="small", help="synthetic preset when --model is not given (default small)")
    p.add_argument("--limit", help="the container's limit (e.g. 600MB); default: see above")
    p.add_argument("--neighbour", choices=("grow", "instant", "none"), default="grow")
    p.add_argument("--step", default=None, help="the neighbour's growth each 0.5 s (default: a sixth of its share)")
    p.add_argument("--hold", type=float, default=5.0, help="seconds the neighbour holds its share (default 5)")
    p.add_argument("--n-gen", type=int, default=400)
    p.add_argument("--pace", type=float, default=0.03, help="seconds between tokens (default 0.03)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, help="write the samples here")
    p.add_argument("--plot", type=Path, nargs="?", const=Path("bench-pressure.png"),
                   help="plot the cache's size over time (matplotlib)")
    results.add_arguments(p)
    args = p.parse_args(argv)

    import pyzipmoe
    from pyzipmoe.runtime.budget import model_memory, parse_size
    from pyzipmoe.runtime.memory import own_cgroup_dir

    parent = own_cgroup_dir("memory")
    if os.geteuid() != 0 or parent is None:
        raise SystemExit("needs root and the cgroup v1 memory controller")
    build = pyzipmoe.build_dir()
    tmp = Path(tempfile.mkdtemp(prefix="bench-pressure-"))
    if args.model is None:
        from pyzipmoe import synth
        from pyzipmoe.file import convert

        args.bf16 = tmp / f"{args.preset}.gguf"
        args.model = tmp / f"{args.preset}.zipmoe.gguf"
        synth.write_config(args.bf16, synth.PRESETS[args.preset])
        convert.convert(args.bf16, args.model, threads=args.threads)
    need = model_memory(args.model)
    env = env_for(build)
    common = {"prompt": PROMPT, "n_ctx": 1024, "threads": args.threads, "n_gen": args.n_gen}

    ref_model = args.bf16 or args.model
    ref_proc = run_worker({**common, "model": str(ref_model)}, env)
    out, err = ref_proc.communicate()
    if ref_proc.returncode != 0:
        raise SystemExit(f"the reference run failed:\n{err[-2000:]}")
    reference = json.loads(out.strip().splitlines()[-1])["generated"]

    cg = parent / f"zipmoe-bench-pressure-{os.getpid()}"
    cg.mkdir()
    samples: list[tuple[float, int, int]] = []
    try:
        job = {**common, "model": str(args.model), "budget": "auto", "pace": args.pace,
               "baseline": str(tmp / "baseline"), "limited": str(tmp / "limited"), "ready": str(tmp / "ready"),
               "stop": str(tmp / "stop")}
        proc = run_worker(job, env, cg)
        wait_file(tmp / "baseline", proc)
        time.sleep(0.2)
        base = cg_in_use(cg)
        limit = parse_size(args.limit) if args.limit else base + need.whole + (32 << 20) + (24 << 20)
        (cg / "memory.limit_in_bytes").write_text(str(limit))
        (tmp / "limited").write_text("1")
        wait_file(tmp / "ready", proc)
        t0 = time.monotonic()
        target = limit // 3
        step = target if args.neighbour == "instant" else (parse_size(args.step) if args.step else target // 6)
        neighbour = None
        if args.neighbour != "none":
            time.sleep(1.0)
            nb = {"target": target, "step": step, "every": 0.5, "hold": args.hold}
            neighbour = subprocess.Popen(["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cg / "cgroup.procs"),
                                          sys.executable, "-c", NEIGHBOUR, json.dumps(nb)], text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        while proc.poll() is None:
            samples.append((round(time.monotonic() - t0, 3), cg_in_use(cg), cg_read(cg, "memory.usage_in_bytes")))
            if neighbour is not None and neighbour.poll() is not None and not (tmp / "stop").exists():
                # the neighbour left: let the cache grow back for a few seconds, then end the run
                gone = time.monotonic()
                while time.monotonic() - gone < 5 and proc.poll() is None:
                    time.sleep(0.25)
                (tmp / "stop").write_text("1")
            time.sleep(0.25)
        out, err = proc.communicate()
        nb_rc = neighbour.wait() if neighbour is not None else None
        oom = oom_kills(cg)
        failcnt = cg_read(cg, "memory.failcnt")
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    got = json.loads(out.strip().splitlines()[-1]) if proc.returncode == 0 else None
    same = got is not None and got["generated"] == reference[: len(got["generated"])]

    with results.Tee() as tee:
        print(f"model {args.model.name}: minimum {need.minimum / MiB:.1f} MiB, whole {need.whole / MiB:.1f} MiB; "
              f"container {limit / MiB:.1f} MiB (the process held {base / MiB:.1f} MiB before loading); "
              f"neighbour {args.neighbour}: {target / MiB:.1f} MiB in steps of {step / MiB:.1f} MiB every 0.5 s, "
              f"held {args.hold:.0f} s")
        if got is None:
            print(f"zipmoe process: exit status {proc.returncode} ({'OOM-killed' if proc.returncode == -9 else 'failed'})"
                  f"; {err.strip().splitlines()[-1] if err.strip() else ''}")
        else:
            print(f"zipmoe process: exit 0; auto chose {got['loaded_budget'] / MiB:.1f} MiB at load; "
                  f"{len(got['generated'])} tokens, {'identical to' if same else 'DIFFERENT from'} the unconstrained "
                  f"run's; re-plans {len(got['replans'])}; kernel signals {got['signals'] or 'none'}, "
                  f"woken {got['wakeups']} times; floor: {got['floor'] or 'not reached'}")
        print(f"neighbour: exit status {nb_rc}; cgroup oom_kill {oom}, failcnt {failcnt}")
        print()
        print(f"{'t (s)':>7} {'budget MiB':>11} {'cache MiB':>10}")
        if got is not None:
            last = -1.0
            for t, budget, resident in got["series"]:
                if t - last >= 0.5:
                    print(f"{t:7.2f} {budget / MiB:11.1f} {resident / MiB:10.1f}")
                    last = t
    data = {"limit": limit, "base": base, "need": {"minimum": need.minimum, "whole": need.whole},
            "neighbour": args.neighbour, "target": target, "step": step, "oom_kill": oom, "same_tokens": same,
            "worker": got, "cgroup_samples": samples, "exit_status": proc.returncode}
    if args.json:
        args.json.write_text(json.dumps(data))
    if args.plot and got is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot", file=sys.stderr)
        else:
            t = [s[0] for s in got["series"]]
            fig, ax = plt.subplots(figsize=(8, 4))
            ax.plot(t, [s[1] / MiB for s in got["series"]], label="budget (monitor)")
            ax.plot(t, [s[2] / MiB for s in got["series"]], label="cache resident")
            ax.set_xlabel("seconds into generation")
            ax.set_ylabel("MiB")
            ax.set_title(f"auto in a {limit / MiB:.0f} MiB cgroup, neighbour {args.neighbour} to {target / MiB:.0f} MiB")
            ax.legend()
            fig.tight_layout()
            fig.savefig(args.plot)
            print(f"wrote {args.plot}", file=sys.stderr)
    results.write(args, "pressure", tee.text, weights=results.SYNTHETIC if results.synthetic_gguf(args.model) or
                  args.model.parent == tmp else f"{args.model}", json_path=args.json)
    return 0 if got is not None and same and oom == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
