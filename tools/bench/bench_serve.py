#!/usr/bin/env python3
"""What the store server's Ollama layer costs: `zipmoe serve` (without MODEL, /api/chat streamed) against
llama-server's own /v1/chat/completions on the same model, budget, context, threads and request, and what
switching between two loaded models costs.

Rows (each a streamed chat turn, greedy, --gen tokens; medians of --reps interleaved rounds):
  llama-server   llama-server -m <the stored model's blob>, its /v1/chat/completions (the baseline)
  zipmoe /api    zipmoe serve, Ollama's /api/chat (the front translating to the same llama-server endpoint)
  zipmoe /v1     zipmoe serve, OpenAI's /v1/chat/completions passed through
  router         (--router) llama-server's router mode (--models-dir), its /v1/chat/completions: the proxy hop
                 a router adds, which the store server does without
  switch         zipmoe serve, /api/chat alternating between two loaded models (copies of the model): the first
                 token after a switch, and whether any model's process was started again (reloads)
First token: from sending the request to the first byte of generated text, at the client. Tokens/s: the tokens
after the first over the time from the first to the last, at the client (what a user sees; llama-server's own
timings are reported beside it; client/server: the first over the second, the share of llama-server's own rate
that reaches the client, which the machine's noise in the computation leaves alone). Outside llama-server: a request's wall time at the client less llama-server's
own prompt and generation time (its timings): HTTP, queueing, templating, and the layer; on a machine shared with
other work the computation's time varies far more than this does. Front CPU per token: the CPU time (user and
system, /proc/PID/stat) the `zipmoe serve` process itself spent on a row's requests, over the tokens it passed on:
what the layer takes from the model's computation where the cores are all busy (where a core is free, nothing);
as a share of a token's time at the baseline's tokens/s, the most the layer can cost in tokens/s.

The model (preset small by default) is generated with pyzipmoe.synth into --workdir and stored in a store there.

Examples:
  python3 tools/bench/bench_serve.py                      # small preset, 64 tokens, 10 rounds
  python3 tools/bench/bench_serve.py --preset tiny --gen 128 --reps 20 --router
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
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

DEFAULT_WORKDIR = REPO / "build" / "bench-serve"
PROMPT = "Tell me about the experts of a mixture of experts model, one by one."
NUM_CTX = 512


class BenchError(Exception):
    pass


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(port: int, path: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"a server exited ({proc.returncode}): {log.read_text()[-500:]}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", path)
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise BenchError(f"a server did not start in {timeout:.0f} s: {log.read_text()[-500:]}")


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def stream(port: int, path: str, body: dict[str, Any]) -> dict[str, float]:
    """One streamed request: seconds to the first text, tokens, seconds from the first to the last text."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise BenchError(f"{path}: HTTP {r.status}: {r.read()[:300]!r}")
    first = last = None
    pieces, server_tps, server_ms = 0, 0.0, 0.0
    for raw in r:
        line = raw.strip()
        if line.startswith(b"data:"):
            line = line[5:].strip()
            if line == b"[DONE]":
                break
        if not line:
            continue
        event = json.loads(line)
        text = event.get("response") or (event.get("message") or {}).get("content") or "".join(
            (ch.get("delta") or {}).get("content") or "" for ch in event.get("choices") or ())
        if text:
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            pieces += 1
        timings = event.get("timings")
        if timings:
            server_tps = float(timings.get("predicted_per_second") or 0)
            server_ms = float(timings.get("prompt_ms") or 0) + float(timings.get("predicted_ms") or 0)
        if event.get("eval_count") and event.get("eval_duration"):
            server_tps = event["eval_count"] / (event["eval_duration"] / 1e9)
            server_ms = (event["eval_duration"] + event.get("prompt_eval_duration", 0)) / 1e6
    end = time.perf_counter()
    c.close()
    if first is None or last is None:
        raise BenchError(f"{path}: no text came back")
    # what the request cost beyond llama-server's own prompt and generation time: HTTP, queueing, templates and,
    # through the store server, its layer; unlike tokens/s, the machine's noise in the computation is not in it
    return {"first": first - t0, "pieces": pieces, "tps": (pieces - 1) / (last - first) if last > first else 0.0,
            "server_tps": server_tps, "outside_ms": (end - t0) * 1e3 - server_ms}


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far (not its children's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    from pyzipmoe import synth
    from pyzipmoe.models.directory import ModelDirectory
    from pyzipmoe.runtime import runner
    from pyzipmoe.runtime.budget import model_memory
    from pyzipmoe.runtime.controller import runtime_environment

    load0 = os.getloadavg()[0]
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    bf16 = work / f"{args.preset}.gguf"
    if not bf16.is_file():
        say(f"generating {bf16} (SYNTHETIC, preset {args.preset}) ...")
        synth.write_config(bf16, synth.PRESETS[args.preset])
    store = ModelDirectory(work / "models")
    if not store.exists(args.preset):
        say("storing it (converted) ...")
        store.create(args.preset, f"FROM {bf16}\nPARAMETER num_ctx {NUM_CTX}\n", base_dir=work, threads=args.threads)
    store.copy(args.preset, f"{args.preset}-copy")
    package = store.open(args.preset)
    blob = str(package.model_path)
    need = model_memory(blob)
    budget = int(need.whole * args.budget_share)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZIPMOE_")}
    env["ZIPMOE_MODELS"] = str(store.root)
    server_env = runner.environment(None, env)
    server_env.update(runtime_environment(blob, budget=budget))
    common = ["-np", "1", "-c", str(NUM_CTX), "-t", str(args.threads)]
    procs: list[subprocess.Popen[bytes]] = []
    ports: dict[str, int] = {}
    try:
        ports["direct"] = _port()
        procs.append(_start([str(runner.program("llama-server")), "-m", blob, "--port", str(ports["direct"]),
                             "--alias", args.preset, *common], server_env, work / "direct.log"))
        _wait(ports["direct"], "/health", procs[-1], work / "direct.log")
        ports["zipmoe"] = _port()
        procs.append(_start([sys.executable, "-m", "pyzipmoe", "serve", "--port", str(ports["zipmoe"]),
                             "--memory-budget", str(budget * (2 if args.switch else 1)), "--parallel", "1",
                             "-t", str(args.threads)], {**env, "PYTHONPATH": str(REPO)}, work / "zipmoe.log"))
        _wait(ports["zipmoe"], "/api/version", procs[-1], work / "zipmoe.log")
        front = procs[-1]
        if args.router:
            models_dir = work / "router-models"
            models_dir.mkdir(exist_ok=True)
            link = models_dir / f"{args.preset}.gguf"
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(blob)
            ports["router"] = _port()
            procs.append(_start([str(runner.program("llama-server")), "--models-dir", str(models_dir), "--port",
                                 str(ports["router"]), *common], server_env, work / "router.log"))
            _wait(ports["router"], "/health", procs[-1], work / "router.log")
        msgs = [{"role": "user", "content": PROMPT}]
        oai = {"messages": msgs, "max_tokens": args.gen, "temperature": 0, "stream": True, "model": args.preset}
        rows: dict[str, tuple[int, str, dict[str, Any]]] = {
            "llama-server": (ports["direct"], "/v1/chat/completions", oai),
            "zipmoe /api": (ports["zipmoe"], "/api/chat", {"model": args.preset, "messages": msgs, "stream": True,
                                                           "options": {"temperature": 0, "num_predict": args.gen}}),
            "zipmoe /v1": (ports["zipmoe"], "/v1/chat/completions", oai),
        }
        if args.router:
            rows["router"] = (ports["router"], "/v1/chat/completions", oai)
        for name, (port, path, body) in rows.items():  # loads, and warms the caches
            stream(port, path, body)
            stream(port, path, body)
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in rows}
        for rep in range(args.reps):
            order = list(rows) if rep % 2 == 0 else list(reversed(rows))
            for name in order:
                port, path, body = rows[name]
                c0 = _cpu_seconds(front.pid)
                sample = stream(port, path, body)
                sample["front_cpu"] = _cpu_seconds(front.pid) - c0 if port == ports["zipmoe"] else 0.0
                samples[name].append(sample)
        switch: dict[str, Any] = {}
        if args.switch:
            api = rows["zipmoe /api"][2]
            pair = (args.preset, f"{args.preset}-copy")
            stream(ports["zipmoe"], "/api/chat", {**api, "model": pair[1]})
            pids = _pids(ports["zipmoe"])
            firsts = [stream(ports["zipmoe"], "/api/chat", {**api, "model": pair[i % 2]})["first"]
                      for i in range(2 * args.reps)]
            switch = {"first": statistics.median(firsts), "reloads": int(_pids(ports["zipmoe"]) != pids),
                      "pids": pids}
    finally:
        for p in procs:
            runner.stop_group(p, 10)
    summary = {name: {k: statistics.median(s[k] for s in samples[name]) for k in ("first", "tps", "server_tps",
                                                                                  "pieces", "outside_ms")}
               for name in samples}
    for name, s in samples.items():  # summed: the CPU clock ticks in 10 ms steps, far coarser than a request
        summary[name]["front_cpu_per_token"] = sum(x["front_cpu"] for x in s) / max(1, sum(x["pieces"] for x in s))
    return {"preset": args.preset, "gen": args.gen, "reps": args.reps, "threads": args.threads, "budget": budget,
            "whole": need.whole, "rows": summary, "samples": samples, "switch": switch,
            "load": [load0, os.getloadavg()[0]]}


def _pids(port: int) -> dict[str, int]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/api/ps")
    return {m["name"]: m["zipmoe"]["pid"] for m in json.loads(c.getresponse().read())["models"]}


def print_report(res: dict[str, Any]) -> None:
    base = res["rows"]["llama-server"]
    print(f"preset {res['preset']}, {res['gen']} tokens a turn, {res['threads']} threads, budget "
          f"{res['budget'] / 2**20:.1f} MiB (the whole model: {res['whole'] / 2**20:.1f} MiB); medians of "
          f"{res['reps']} interleaved rounds")
    print(f"{'':14} {'first token':>12} {'vs baseline':>12} {'tokens/s':>10} {'vs baseline':>12} "
          f"{'server tok/s':>13} {'its range':>14} {'client/server':>14}")
    for name, r in res["rows"].items():
        tps = [x["server_tps"] for x in res["samples"][name]]
        # tokens/s at the client over the same process's own: what the path from llama-server to the client keeps
        # of its rate, which the machine's noise in the computation leaves alone
        kept = f"{r['tps'] / r['server_tps'] * 100:13.1f}%" if r["server_tps"] else f"{'':>14}"
        print(f"{name:14} {r['first'] * 1e3:9.2f} ms {(r['first'] - base['first']) * 1e3:+9.2f} ms "
              f"{r['tps']:10.1f} {(r['tps'] / base['tps'] - 1) * 100 if base['tps'] else 0:+11.1f}% "
              f"{r['server_tps']:13.1f} {min(tps):6.0f}-{max(tps):<7.0f} {kept}")
    print()
    print(f"{'':14} {'outside llama-server':>21} {'vs baseline':>12}   (a request's wall time less llama-server's own "
          "prompt and generation time)")
    for name, r in res["rows"].items():
        print(f"{name:14} {r['outside_ms']:18.2f} ms {r['outside_ms'] - base['outside_ms']:+9.2f} ms")
    print()
    print(f"{'':14} {'front CPU a token':>18} {'of a token at baseline speed':>30}")
    for name, r in res["rows"].items():
        if "front_cpu_per_token" in r and name.startswith("zipmoe"):
            cpu = r["front_cpu_per_token"]
            print(f"{name:14} {cpu * 1e6:15.0f} us {cpu * base['tps'] * 100:29.2f}%")
    load = res.get("load")
    if load:
        print(f"load average (1 min) before and after: {load[0]:.2f}, {load[1]:.2f} on {os.cpu_count()} CPUs; "
              "'server tok/s' is llama-server's own timing, which no HTTP layer touches: its range is the "
              "machine's noise")
    if res["switch"]:
        s = res["switch"]
        print(f"switching between two loaded models: first token {s['first'] * 1e3:.2f} ms (median), "
              f"processes started again: {s['reloads']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    from pyzipmoe.synth import PRESETS

    p.add_argument("--preset", choices=sorted(PRESETS), default="small", help="synthetic model (default: %(default)s)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="models and logs (default: %(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads (default: %(default)s)")
    p.add_argument("--gen", type=int, default=64, help="tokens a turn (default: %(default)s)")
    p.add_argument("--reps", type=int, default=10, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--budget-share", type=float, default=1.0,
                   help="the budget as a share of the whole model, for each server (default: %(default)s)")
    p.add_argument("--router", action="store_true", help="also measure llama-server's router mode")
    p.add_argument("--no-switch", dest="switch", action="store_false", help="skip the switching measurement")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    result_files.add_arguments(p)
    args = p.parse_args(argv)
    say = (lambda s: print(s, file=sys.stderr)) if args.json else print
    with one_line_errors("bench_serve", BenchError, subprocess.TimeoutExpired):
        res = run(args, say)
    result_files.report(args, "serve", res, print_report,
                        weights=f"{result_files.SYNTHETIC} (pyzipmoe.synth, preset {args.preset})",
                        script=__file__, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
