#!/usr/bin/env python3
"""Network bytes of a model split across llama.cpp's RPC servers: a synthetic BF16 MoE GGUF (stock RPC) against
its zipmoe GGUF, on stock servers (experts kept on the client, patches/0008) and on zipmoe servers (each computes
its layers' experts from its own copy, ggml-rpc-server --zipmoe-model), same build, same split.

Two ggml-rpc-server processes on 127.0.0.1 take half the layers each (tensor_split 1,1, every layer offloaded);
the client reaches each through a byte-counting TCP relay in this process, so every byte between client and
servers is counted, each way. Measured per model: bytes at load (client -> servers: the weights uploaded), bytes
of the prompt's evaluation, bytes per generated token (the mean over --gen greedy tokens), and each server's peak
resident memory (VmHWM). The client runs in a child process (llama-cpp-python on zipmoe's libllama).

What it shows: with zipmoe no expert crosses the network at load (the difference between the zipmoe rows' load and
the BF16 row's is the experts' size). On stock servers every MoE layer on a server sends its activations to the
client and back each token; zipmoe servers compute the experts where their layer is, so per token they send what
stock RPC sends for the BF16 file. --server-budget gives the zipmoe servers a memory budget: their peak resident
memory is reported against it.

Examples:
  python3 tools/bench/bench_rpc.py                          # small preset (61 MiB BF16), 16 tokens
  python3 tools/bench/bench_rpc.py --preset tiny --gen 8 --no-results
  python3 tools/bench/bench_rpc.py --server-budget minimum  # each zipmoe server at the model's minimum budget
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results.py, beside this script
import results as result_files  # noqa: E402

DEFAULT_WORKDIR = REPO / "build" / "bench-rpc"
PROMPT = "the expert model said hello to the world of water and time"
TIMEOUT = 900


class Relay:
    """A TCP relay 127.0.0.1:port -> upstream that counts the bytes it carries each way (all connections)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.up = 0    # client -> server
        self.down = 0  # server -> client
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return self.up, self.down

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while data := src.recv(1 << 20):
                dst.sendall(data)
                with self._lock:
                    if up:
                        self.up += len(data)
                    else:
                        self.down += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()


WORKER = r"""
import json, sys
import numpy as np
job = json.loads(sys.argv[1])
from pyzipmoe.runtime.llama import Llama
llm = Llama(job["model"], n_ctx=256, n_threads=job["threads"], n_threads_batch=job["threads"], seed=0, verbose=False,
            rpc_servers=job["servers"], tensor_split=[1.0, 1.0], n_gpu_layers=-1)
print("loaded", flush=True); sys.stdin.readline()
llm.eval(llm.tokenize(job["prompt"].encode()))
print("prompt", flush=True); sys.stdin.readline()
for _ in range(job["gen"]):
    llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
print("generated", flush=True); sys.stdin.readline()
llm.close()
"""


def start_server(bin_dir: Path, env: dict[str, str], flags: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(bin_dir / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", "1", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"bench_rpc: ggml-rpc-server did not listen on {port}")


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(model: Path, label: str, flags: list[str], args: argparse.Namespace, bin_dir: Path,
            env: dict[str, str]) -> dict[str, Any]:
    """One model over two fresh servers started with flags: bytes each way at each step, per token, and the
    servers' peak RSS."""
    servers = [start_server(bin_dir, env, flags) for _ in range(2)]
    relays = [Relay(("127.0.0.1", port)) for _, port in servers]
    job = {"model": str(model), "servers": ",".join(f"127.0.0.1:{r.port}" for r in relays), "prompt": PROMPT,
           "gen": args.gen, "threads": args.threads}
    client = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(job)], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    marks: dict[str, tuple[int, int]] = {}
    try:
        for step in ("loaded", "prompt", "generated"):
            line = client.stdout.readline().strip()
            if line != step:
                raise SystemExit(f"bench_rpc: the client failed before '{step}':\n{client.stderr.read()[-3000:]}")
            time.sleep(0.2)  # (the relay threads finish forwarding what arrived)
            ups, downs = zip(*(r.counts() for r in relays))
            marks[step] = (sum(ups), sum(downs))
            client.stdin.write("\n")
            client.stdin.flush()
        client.wait(timeout=TIMEOUT)
        rss = [peak_rss(p.pid) for p, _ in servers]
    finally:
        for p, _ in servers:
            p.kill()
            p.wait()
        for r in relays:
            r.close()
    (lu, ld), (pu, pd), (gu, gd) = marks["loaded"], marks["prompt"], marks["generated"]
    return {"model": label, "load_up": lu, "load_down": ld, "prompt_up": pu - lu, "prompt_down": pd - ld,
            "token_up": (gu - pu) / args.gen, "token_down": (gd - pd) / args.gen, "server_peak_rss": rss}


def report(rows: list[dict[str, Any]], expert_bytes: int, server_budget: int | None) -> str:
    def mib(n: float) -> str:
        return f"{n / 2**20:.2f} MiB"

    lines = [f"{'model, servers':34} {'load ->srv':>12} {'load <-srv':>12} {'prompt ->':>11} {'prompt <-':>11} "
             f"{'token ->':>10} {'token <-':>10}  server peak RSS"]
    for r in rows:
        lines.append(f"{r['model']:34} {mib(r['load_up']):>12} {mib(r['load_down']):>12} "
                     f"{r['prompt_up'] / 1024:>9.1f} K {r['prompt_down'] / 1024:>9.1f} K "
                     f"{r['token_up'] / 1024:>8.1f} K {r['token_down'] / 1024:>8.1f} K  "
                     + ", ".join(mib(x) for x in r["server_peak_rss"]))
    lines.append(f"(the BF16 file's experts: {mib(expert_bytes)}; ->srv: client to servers, <-srv: back; "
                 "token: mean bytes per generated token, both servers together)")
    stock = rows[0]["token_up"] + rows[0]["token_down"]
    for r in rows[1:]:
        if stock > 0:
            lines.append(f"{r['model']} / {rows[0]['model']}: {(r['token_up'] + r['token_down']) / stock:.2f}x bytes "
                         f"per token; at load {mib(rows[0]['load_up'] - r['load_up'])} less to the servers")
    if server_budget is not None:
        # a zipmoe server's overhead beyond its budget: what a stock server holding the same layers without their
        # experts peaks at (the layers' uploaded weights, their KV cache, the compute buffers, the process)
        for peak, overhead in zip(rows[-1]["server_peak_rss"], rows[1]["server_peak_rss"], strict=True):
            verdict = "within" if peak <= server_budget + overhead else "OVER"
            lines.append(f"zipmoe server: peak RSS {mib(peak)}, budget {mib(server_budget)} + overhead "
                         f"{mib(overhead)} (a stock server's peak with the same layers) = "
                         f"{mib(server_budget + overhead)}: {verdict}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", help="pyzipmoe.synth preset (default: %(default)s)")
    p.add_argument("--gen", type=int, default=16, help="greedy tokens generated (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="client threads (default: %(default)s)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="where the models go")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON too")
    p.add_argument("--server-budget", help="the zipmoe servers' --memory-budget (a size, or minimum: the model's "
                   "least; default: unbounded)")
    result_files.add_arguments(p)
    args = p.parse_args(argv)

    from pyzipmoe import synth
    from pyzipmoe.file import convert
    from pyzipmoe.paths import bin_dir
    from pyzipmoe.runtime.budget import model_memory, parse_size
    from pyzipmoe.runtime.runner import environment

    bins = bin_dir()
    if not (bins / "ggml-rpc-server").is_file():
        raise SystemExit(f"bench_rpc: {bins / 'ggml-rpc-server'} was not built (`bash tools/setup.sh`)")
    args.workdir.mkdir(parents=True, exist_ok=True)
    bf16, packed = args.workdir / f"{args.preset}.gguf", args.workdir / f"{args.preset}.zipmoe.gguf"
    if not packed.is_file():
        synth.write_config(bf16, synth.PRESETS[args.preset])
        convert.convert(bf16, packed, threads=2)
    env = {**environment("unbounded"), "LLAMA_CPP_LIB_PATH": str(bins)}
    budget = None
    zipmoe_server = ["--zipmoe-model", str(packed)]
    if args.server_budget:
        budget = model_memory(packed).minimum if args.server_budget == "minimum" else parse_size(args.server_budget)
        zipmoe_server += ["--memory-budget", str(budget)]
    rows = [measure(bf16, f"{bf16.name}, stock", [], args, bins, env),
            measure(packed, f"{packed.name}, stock", [], args, bins, env),
            measure(packed, f"{packed.name}, zipmoe", zipmoe_server, args, bins, env)]
    expert_bytes = model_memory(packed).expert_bytes
    table = report(rows, expert_bytes, budget)
    print(table, end="")
    if args.json:
        print(json.dumps(rows))
    result_files.write(args, "rpc", table, weights=f"{result_files.SYNTHETIC} (pyzipmoe.synth, preset {args.preset})",
                       argv=result_files.script_argv(__file__, argv),
                       notes=["two ggml-rpc-server processes on 127.0.0.1, tensor_split 1,1, every layer offloaded; "
                              "bytes counted by a relay between client and each server; stock: ggml-rpc-server, "
                              "zipmoe: ggml-rpc-server --zipmoe-model (the same zipmoe file)"
                              + (f" --memory-budget {budget}" if budget is not None else "")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
