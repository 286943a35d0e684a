"""A model split across llama.cpp's RPC servers (ggml-rpc-server, --rpc): the same logits as in one process.

Two ggml-rpc-server processes on 127.0.0.1 (different ports) each take one of a tiny model's two MoE layers
(tensor_split 1,2 over its three: the output layer goes with the second; every layer offloaded). On a stock server
(no --zipmoe-model) a zipmoe model's expert ops cannot run (their parameters are the client's pointers;
patches/0008): its experts stay in the client and its expert nodes run on the client's CPU. A zipmoe server
(--zipmoe-model, the same file) computes the experts of its layer from its own copy, under its own budget; the client
keeps no store for them, so only the server can have computed them. Either way, and mixed, the logits of the
prompt and of 16 greedy tokens must be bit-identical to the single-process run's, unbounded and under the tightest
budget (on the client and on each server); a plain BF16 model too (stock RPC), also on zipmoe servers. A zipmoe
server of another file: refused when the model loads. A server killed mid-run, or a zipmoe server whose copy has
damaged experts: the client ends with one line and exit status 1, within seconds (no hang, no abort, no wrong
logits). A server that does not answer: refused before loading.

Each run is a child process (a crash fails one test). These tests need zipmoe's build with the RPC backend
(build/bin/ggml-rpc-server, libllama.so) and llama-cpp-python: without them they are skipped (failed under CI).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import assert_bit_identical, kill_group, llama_bin_dir, stderr_tail, unavailable, worker_env

PROMPT = "the expert model said hello to the world of water and time"
N_GEN = 16
TIMEOUT = 300  # seconds for one child process
KILL_DEADLINE = 30  # seconds from a server's death to the client's exit


# ----------------------------------------------------------------------------------------- servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(bin_dir: Path, log: Path, flags: tuple[str, ...] = ()) -> tuple[subprocess.Popen[bytes], str]:
    """A ggml-rpc-server on 127.0.0.1 (one thread) with `flags` (--zipmoe-model PATH ...), once it accepts
    connections: (process, "host:port")."""
    program = bin_dir / "ggml-rpc-server"
    if not program.is_file():
        unavailable(f"{program} was not built (the build turns GGML_RPC on)")
    port = _free_port()
    proc = subprocess.Popen([str(program), "-H", "127.0.0.1", "-p", str(port), "-t", "1", *flags],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=worker_env(bin_dir))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"ggml-rpc-server exited ({proc.returncode}): {log.read_text()[-2000:]}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    kill_group(proc)
    raise AssertionError(f"ggml-rpc-server did not listen on {port}: {log.read_text()[-2000:]}")


def start_servers(logs: Path, flags: list[tuple[str, ...]]) -> Iterator[str]:
    """A server per entry of flags: yields their endpoints ("host:port,host:port"), kills them after."""
    bin_dir = llama_bin_dir()
    procs = []
    try:
        for i, f in enumerate(flags):
            procs.append(start_server(bin_dir, logs / f"server{i}.log", f))
        yield ",".join(ep for _, ep in procs)
    finally:
        for proc, _ in procs:
            kill_group(proc)


def zipmoe_flags(model: Path, budget: str | None = None) -> tuple[str, ...]:
    """A zipmoe server's flags: its copy of the model, and its budget."""
    return ("--zipmoe-model", str(model), *(("--memory-budget", budget) if budget else ()))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Two stock servers for the module's runs (a server serves one client at a time, and frees its memory after)."""
    yield from start_servers(tmp_path_factory.mktemp("rpc"), [(), ()])


@pytest.fixture(scope="module")
def zipmoe_servers(tmp_path_factory: pytest.TempPathFactory, zipmoe_model: Path) -> Iterator[str]:
    """Two zipmoe servers of zipmoe_model, unbounded."""
    yield from start_servers(tmp_path_factory.mktemp("rpc"), [zipmoe_flags(zipmoe_model)] * 2)


# ------------------------------------------------------------------------------------------ worker

WORKER = r"""
import json, sys
import numpy as np
job = json.loads(sys.argv[1])
from pyzipmoe.runtime.llama import Llama
llm = Llama(job["model"], n_ctx=128, n_threads=2, n_threads_batch=2, logits_all=True, seed=0, verbose=job["verbose"],
            prefill=False, **job["llama"])
print("loaded", flush=True)
tokens = llm.tokenize(job["prompt"].encode())
llm.eval(tokens)
generated = []
for _ in range(job["n_gen"]):
    nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    generated.append(nxt)
    print("token", nxt, flush=True)
    llm.eval([nxt])
np.save(job["out"], np.array(llm.scores[: llm.n_tokens], dtype=np.float32))
print(json.dumps({"generated": generated}))
llm.close()
"""


def _job(model: Path, out: Path, llama: dict[str, Any], n_gen: int = N_GEN, verbose: bool = False) -> str:
    return json.dumps({"model": str(model), "out": str(out), "llama": llama, "prompt": PROMPT, "n_gen": n_gen,
                       "verbose": verbose})


def run(model: Path, out: Path, llama: dict[str, Any], verbose: bool = False) -> tuple[list[int], np.ndarray, str]:
    """The prompt's and N_GEN greedy tokens' logits of `model` loaded with `llama` (Llama's arguments) in a child:
    (generated tokens, float32 logits [positions, n_vocab], its stderr)."""
    done = subprocess.run([sys.executable, "-c", WORKER, _job(model, out, llama, verbose=verbose)],
                          env=worker_env(llama_bin_dir()), capture_output=True, text=True, timeout=TIMEOUT,
                          check=False)
    assert done.returncode == 0, f"the worker failed ({done.returncode}) on {model}:\n{stderr_tail(done.stderr)}"
    return json.loads(done.stdout.strip().splitlines()[-1])["generated"], np.load(out), done.stderr


def _split(servers: str) -> dict[str, Any]:
    return {"rpc_servers": servers, "tensor_split": [1.0, 2.0], "n_gpu_layers": -1}


# ------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("budget", [None, "minimum"])
def test_zipmoe_split_across_two_servers_is_bit_identical(zipmoe_model: Path, servers: str, budget: str | None,
                                                          tmp_path: Path) -> None:
    """A MoE layer on each server: the experts run on the client's CPU (one log line says so), the logits and
    the greedy tokens are the single-process run's, bit for bit, also under the tightest budget."""
    from pyzipmoe.runtime.budget import model_memory

    zipmoe = {} if budget is None else {"memory_budget": str(model_memory(zipmoe_model).minimum)}
    ref_tokens, ref, _ = run(zipmoe_model, tmp_path / "one.npy", zipmoe)
    tokens, got, err = run(zipmoe_model, tmp_path / "rpc.npy", {**zipmoe, **_split(servers)}, verbose=True)
    assert tokens == ref_tokens
    assert_bit_identical(got, ref, f"zipmoe over RPC (budget {budget})")
    said = [ln for ln in err.splitlines() if "experts of layers on RPC devices" in ln]
    assert len(said) == 1 and "run on its CPU" in said[0], stderr_tail(err)
    # a layer did go to each server (else this compares the single-process run with itself)
    for endpoint in servers.split(","):
        assert any(endpoint in ln and "KV buffer size" in ln for ln in err.splitlines()), stderr_tail(err)


@pytest.mark.parametrize("kind", ["stock", "zipmoe"])
def test_plain_model_split_across_two_servers_is_bit_identical(tiny_model: Path, kind: str,
                                                               request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A plain BF16 model over stock servers, and over zipmoe servers (which serve it as stock ones do): stock RPC
    (its experts go to the servers), the same logits."""
    servers = request.getfixturevalue("servers" if kind == "stock" else "zipmoe_servers")
    ref_tokens, ref, _ = run(tiny_model, tmp_path / "one.npy", {})
    tokens, got, err = run(tiny_model, tmp_path / "rpc.npy", _split(servers), verbose=True)
    assert tokens == ref_tokens
    assert_bit_identical(got, ref, f"plain BF16 model over {kind} RPC servers")
    assert "experts of layers on RPC devices" not in err and "computes the experts" not in err


SAYS_REMOTE = "computes the experts of its layers from its own copy"


@pytest.mark.parametrize("budget", [None, "minimum"])
def test_zipmoe_servers_compute_their_experts_bit_identical(zipmoe_model: Path, budget: str | None,
                                                           tmp_path: Path) -> None:
    """Two zipmoe servers (--zipmoe-model, the same file), each under the same budget as the client: each computes
    its layer's experts (the client keeps no store for them: its log says so for each server, and nothing stays
    on its CPU), and the logits and greedy tokens are the single-process run's, bit for bit."""
    from pyzipmoe.runtime.budget import model_memory

    size = None if budget is None else str(model_memory(zipmoe_model).minimum)
    zipmoe = {} if size is None else {"memory_budget": size}
    ref_tokens, ref, _ = run(zipmoe_model, tmp_path / "one.npy", zipmoe)
    for servers in start_servers(tmp_path, [zipmoe_flags(zipmoe_model, size)] * 2):
        tokens, got, err = run(zipmoe_model, tmp_path / "rpc.npy", {**zipmoe, **_split(servers)}, verbose=True)
        assert tokens == ref_tokens
        assert_bit_identical(got, ref, f"zipmoe servers (budget {budget})")
        for endpoint in servers.split(","):
            said = [ln for ln in err.splitlines() if SAYS_REMOTE in ln and endpoint in ln]
            assert len(said) == 1, stderr_tail(err)
            assert any(endpoint in ln and "KV buffer size" in ln for ln in err.splitlines()), stderr_tail(err)
        assert "experts of layers on RPC devices" not in err
        for log in (tmp_path / "server0.log", tmp_path / "server1.log"):  # each server's own cache, its budget
            said = [ln for ln in log.read_text().splitlines() if "zipmoe: memory budget" in ln]
            assert len(said) == (budget is not None), log.read_text()[-2000:]
            assert "filled the cache tiers" not in log.read_text()  # (not every layer's experts at load)


def test_stock_and_zipmoe_server_mixed_is_bit_identical(zipmoe_model: Path, tmp_path: Path) -> None:
    """A stock server and a zipmoe server: the stock one's layer computes its experts on the client (the fallback's
    line), the zipmoe one's on that server; the same logits as in one process."""
    ref_tokens, ref, _ = run(zipmoe_model, tmp_path / "one.npy", {})
    for servers in start_servers(tmp_path, [(), zipmoe_flags(zipmoe_model)]):
        stock, zipmoe = servers.split(",")
        tokens, got, err = run(zipmoe_model, tmp_path / "rpc.npy", _split(servers), verbose=True)
        assert tokens == ref_tokens
        assert_bit_identical(got, ref, "a stock and a zipmoe server")
        assert len([ln for ln in err.splitlines() if "experts of layers on RPC devices" in ln]) == 1, stderr_tail(err)
        assert [ln for ln in err.splitlines() if SAYS_REMOTE in ln and zipmoe in ln], stderr_tail(err)
        assert not [ln for ln in err.splitlines() if SAYS_REMOTE in ln and stock in ln], stderr_tail(err)


def test_zipmoe_server_of_another_file_is_refused_when_the_model_loads(zipmoe_models: dict[tuple[str, str], Path],
                                                                       tmp_path: Path) -> None:
    """A zipmoe server started with one zipmoe file, and a process that loads it (accepted) and then another file
    (the same model with another codec: another integrity record) on the same server: the second load fails with
    one line naming the server and the server's file, before any layer goes there."""
    mine, other = zipmoe_models["qwen3moe", "huff"], zipmoe_models["qwen3moe", "zstd"]
    for servers in start_servers(tmp_path, [zipmoe_flags(mine)]):
        code = ("import sys\nfrom pyzipmoe.runtime.llama import Llama, ZipmoeLoadError\n"
                f"Llama({str(mine)!r}, rpc_servers={servers!r}, n_gpu_layers=-1, verbose=False).close()\n"
                "print('accepted', flush=True)\n"
                f"try:\n    Llama({str(other)!r}, rpc_servers={servers!r}, n_gpu_layers=-1, verbose=False)\n"
                "except ZipmoeLoadError as e:\n    print('refused:', e)\n    sys.exit(3)\n")
        done = subprocess.run([sys.executable, "-c", code], env=worker_env(llama_bin_dir()), capture_output=True,
                              text=True, timeout=TIMEOUT, check=False)
        assert done.returncode == 3 and done.stdout.startswith("accepted"), done.stdout + done.stderr
        assert f"the RPC server {servers} serves another zipmoe model ({mine.name})" in done.stdout, done.stdout


def test_zipmoe_server_refuses_a_file_it_cannot_serve(tiny_model: Path, tmp_path: Path) -> None:
    """--zipmoe-model with a plain GGUF, or a path that does not open: one line, exit status 1, before listening."""
    program = llama_bin_dir() / "ggml-rpc-server"
    for path, says in ((tiny_model, "not a zipmoe GGUF"), (tmp_path / "missing.gguf", "No such file")):
        done = subprocess.run([str(program), "-p", str(_free_port()), "--zipmoe-model", str(path)],
                              env=worker_env(llama_bin_dir()), capture_output=True, text=True, timeout=60, check=False)
        lines = done.stderr.splitlines()
        assert done.returncode == 1 and len(lines) == 1, done.stdout + done.stderr
        assert lines[0].startswith(f"zipmoe: error: --zipmoe-model {path}: ") and says in lines[0], lines


def test_zipmoe_server_with_a_damaged_expert_closes_the_connection(zipmoe_model: Path,
                                                                  copy_of: Callable[[Path], Path],
                                                                  flip_bit: Callable[[Path, int], None],
                                                                  tmp_path: Path) -> None:
    """The second server's copy has damaged experts in its layer (blk.1; a bit of each expert's first chunk: the
    integrity record covers the metadata and dense tensors, and a chunk is checked when it is decoded): that server
    names the expert in its log and closes the client's connection, and goes on serving; the client ends with one
    line and exit status 1 (ggml-rpc cannot report an error to its caller), not with wrong logits."""
    from pyzipmoe.file.reader import open_zipmoe

    damaged = copy_of(zipmoe_model)
    c = open_zipmoe(damaged).compressed_by_name["blk.1.ffn_down_exps.weight"]
    for e in range(c.expert.info.n_expert):
        flip_bit(damaged, c.region_file_offset(e) + c.expert.span(e).exp_offset + 5)
    for servers in start_servers(tmp_path, [zipmoe_flags(zipmoe_model), zipmoe_flags(damaged)]):
        done = subprocess.run([sys.executable, "-c", WORKER, _job(zipmoe_model, tmp_path / "x.npy", _split(servers))],
                              env=worker_env(llama_bin_dir()), capture_output=True, text=True, timeout=TIMEOUT,
                              check=False)
        assert done.returncode == 1, f"exit status {done.returncode}:\n{stderr_tail(done.stderr)}"
        lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error: ggml-rpc: lost the connection")]
        assert len(lines) == 1, stderr_tail(done.stderr)
        said = [ln for ln in (tmp_path / "server1.log").read_text().splitlines() if ln.startswith("zipmoe: error:")]
        assert len(said) == 1 and "blk.1.ffn_down_exps" in said[0], said
        host, port = servers.split(",")[1].split(":")
        socket.create_connection((host, int(port)), timeout=5).close()  # (still serving)


@pytest.mark.parametrize("kind", ["stock", "zipmoe"])
def test_server_killed_mid_run_ends_the_client_with_one_line(zipmoe_model: Path, kind: str, tmp_path: Path) -> None:
    """One of the two servers (stock, or zipmoe ones computing the experts) is killed after the client's first
    generated token: the client exits with status 1 and a line saying the connection to an RPC server was lost,
    within KILL_DEADLINE seconds (no hang, no SIGABRT with a backtrace)."""
    bin_dir = llama_bin_dir()
    flags = zipmoe_flags(zipmoe_model) if kind == "zipmoe" else ()
    procs = [start_server(bin_dir, tmp_path / f"server{i}.log", flags) for i in range(2)]
    client = None
    try:
        job = _job(zipmoe_model, tmp_path / "x.npy", _split(",".join(ep for _, ep in procs)), n_gen=10_000)
        client = subprocess.Popen([sys.executable, "-c", WORKER, job], env=worker_env(bin_dir),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        first = ""
        while not first.startswith("token"):
            first = client.stdout.readline()
            assert first, f"the client ended before generating: {stderr_tail(client.stderr.read())}"
        kill_group(procs[1][0])
        killed = time.monotonic()
        try:
            _, err = client.communicate(timeout=KILL_DEADLINE)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the client still runs {KILL_DEADLINE} s after its server died")
        assert time.monotonic() - killed < KILL_DEADLINE
        assert client.returncode == 1, f"exit status {client.returncode}:\n{stderr_tail(err)}"
        lines = [ln for ln in err.splitlines() if ln.startswith("error: ggml-rpc: lost the connection")]
        assert len(lines) == 1, stderr_tail(err)
    finally:
        if client is not None and client.poll() is None:
            kill_group(client)
        for proc, _ in procs:
            kill_group(proc)


def test_unreachable_server_is_refused_before_loading(zipmoe_model: Path, tmp_path: Path) -> None:
    """An endpoint nobody listens on: ZipmoeLoadError naming it (ggml-rpc itself would end the process)."""
    port = _free_port()
    code = ("import sys\nfrom pyzipmoe.runtime.llama import Llama, ZipmoeLoadError\n"
            f"try:\n    Llama({str(zipmoe_model)!r}, rpc_servers='127.0.0.1:{port}', verbose=False)\n"
            "except ZipmoeLoadError as e:\n    print('refused:', e)\n    sys.exit(3)\n")
    done = subprocess.run([sys.executable, "-c", code], env=worker_env(llama_bin_dir()), capture_output=True,
                          text=True, timeout=TIMEOUT, check=False)
    assert done.returncode == 3, done.stdout + done.stderr
    assert f"cannot connect to the RPC server 127.0.0.1:{port}" in done.stdout


def test_cli_passes_rpc_and_split_to_llama_programs() -> None:
    """zipmoe run / serve give llama-cli and llama-server --rpc, every layer offloaded and the split; the one-shot
    path gives pyzipmoe.Llama the same as arguments."""
    from pyzipmoe.cli.programs import _common_llama_flags, _rpc_options, split_list

    args = argparse.Namespace(threads=None, ctx_size=None, rpc="h1:1,h2:2", tensor_split=split_list("3,1"))
    flags = _common_llama_flags(args)
    assert flags == ["--rpc", "h1:1,h2:2", "-ngl", "all", "-ts", "3,1"]
    assert _rpc_options(args) == {"rpc_servers": "h1:1,h2:2", "tensor_split": [3.0, 1.0]}
    assert _common_llama_flags(argparse.Namespace(threads=None, ctx_size=None, rpc=None, tensor_split=None)) == []
    with pytest.raises(argparse.ArgumentTypeError):
        split_list("1,x")
