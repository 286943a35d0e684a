"""`zipmoe serve` without a MODEL, driven as its users drive it: the official `ollama` and `openai` client packages,
raw HTTP for what a client hides (status codes, error shapes, origins), and `zipmoe ps` / `zipmoe stop`. Two tiny
synthetic models of different architectures (different weights, so that mixed-up answers would show) in a store
of the test's own."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import http_json, llama_bin_dir, unavailable

import pyzipmoe
from pyzipmoe.models.directory import ModelDirectory
from pyzipmoe.runtime.runner import stop_group

try:  # the official clients (pyproject's test extra, which tools/setup.sh installs)
    import ollama
    import openai
except ImportError as e:
    unavailable(f"{e.name} is not installed (`bash tools/setup.sh` installs the test extra)")

REPO = Path(pyzipmoe.__file__).resolve().parent.parent
GREEDY = {"temperature": 0, "num_predict": 12}
PROMPT = "the expert model said hello to the world"
# a chat template that starts with the BOS token, as real models' do (pyzipmoe.Llama's chat formatter adds none
# of its own; llama-server adds the vocabulary's unless the template's text starts with it)
TEMPLATE = ('TEMPLATE """{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}'
            'assistant:"""\n')


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZIPMOE_")}
    env["ZIPMOE_MODELS"] = str(root)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


class Server:
    def __init__(self, root: Path, *args: str, cgroup: Path | None = None) -> None:
        """`zipmoe serve` on the store at root; in the memory cgroup `cgroup` (its models' processes with it)."""
        self.root = root
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root.parent / f"server-{self.port}.log"
        argv = [sys.executable, "-m", "pyzipmoe", "serve", "--port", str(self.port), *args]
        if cgroup is not None:  # the shell joins the cgroup, then becomes the server
            argv = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"), *argv]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, env=_env(root), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if http_json(f"{self.url}/api/version", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"the server did not start:\n{self.log.read_text()[-3000:]}")

    def client(self) -> Any:
        return ollama.Client(host=self.url, timeout=120)

    def ps(self) -> dict[str, dict[str, Any]]:
        return {m["name"]: m for m in http_json(f"{self.url}/api/ps")[1]["models"]}

    def pids(self) -> list[int]:
        return [m["zipmoe"]["pid"] for m in http_json(f"{self.url}/api/ps")[1]["models"]]

    def stop(self, grace: float = 10) -> None:
        """SIGTERM (the server stops its models' processes), then SIGKILL to whatever is left of its group."""
        stop_group(self.proc, grace)


def _zipmoe(root: Path, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pyzipmoe", *argv], env=_env(root), capture_output=True, text=True,
                          timeout=timeout, check=False)


def _store(root: Path, tiny_models: dict[str, Path], base: Path) -> ModelDirectory:
    store = ModelDirectory(root)
    store.create("alpha", f"FROM {tiny_models['qwen3moe']}\nPARAMETER num_ctx 256\n", base_dir=base, chunk_n=300,
                 threads=2)
    store.create("beta", f"FROM {tiny_models['olmoe']}\nPARAMETER num_ctx 256\nSYSTEM You are a test.\n{TEMPLATE}",
                 base_dir=base, chunk_n=300, threads=2)
    return store


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    llama_bin_dir()
    base = tmp_path_factory.mktemp("serve")
    _store(base / "models", tiny_models, base)
    s = Server(base / "models")
    yield s
    s.stop()


def _visible(text: str) -> str:
    """An answer as `zipmoe run` prints it: llama-cpp-python drops the bytes of a token that are not whole UTF-8
    characters; llama-server sends them as U+FFFD, and a stream's last ones not at all. (The synthetic models'
    random weights pick byte tokens that real text does not split.)"""
    return text.replace("\ufffd", "")


# ------------------------------------------------------------------------------------------ the store


def test_list_show_version(server: Server) -> None:
    c = server.client()
    names = {m.model for m in c.list().models}
    assert names == {"alpha:latest", "beta:latest"}
    shown = c.show("beta")
    assert "SYSTEM" in shown.modelfile and "bos_token" in (shown.template or "")
    assert shown.details.family == "olmoe" and shown.modelinfo["general.architecture"] == "olmoe"
    assert http_json(f"{server.url}/api/version")[1]["version"]


def test_unknown_model_is_a_404_and_malformed_json_a_400(server: Server) -> None:
    import urllib.error
    import urllib.request

    def post(path: str, data: bytes) -> tuple[int, Any]:
        req = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    for path in ("/api/generate", "/api/chat", "/api/show"):
        status, body = post(path, json.dumps({"model": "nosuch", "prompt": "x", "messages": []}).encode())
        assert status == 404 and body == {"error": "model 'nosuch' not found"}, (path, status, body)
        status, body = post(path, b"{not json")
        assert status == 400 and "invalid JSON" in body["error"], (path, status, body)
    status, body = post("/api/generate", json.dumps({"model": "/etc/passwd", "prompt": "x"}).encode())
    assert status == 400 and "invalid model name" in body["error"]  # a request cannot name a file
    status, body = post("/v1/chat/completions", json.dumps({"model": "nosuch", "messages": []}).encode())
    assert status == 404 and body["error"]["message"] == "model 'nosuch' not found"
    status, body = post("/api/embed", json.dumps({"model": "alpha", "input": 3}).encode())
    assert status == 400 and "input must be a string or a list of strings" in body["error"]
    for path, hint in (("/api/pull", "zipmoe import"), ("/api/push", "zipmoe export")):
        status, body = post(path, json.dumps({"model": "alpha"}).encode())
        assert status == 501 and hint in body["error"]
    with pytest.raises(ollama.ResponseError) as e:
        server.client().generate("nosuch", "hi")
    assert e.value.status_code == 404
    # none of it disturbed the models
    assert server.client().generate("alpha", PROMPT, options=GREEDY).done


def test_num_ctx_beyond_the_model_is_a_clear_error(server: Server) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        server.client().generate("alpha", PROMPT, options={**GREEDY, "num_ctx": 10**7})
    assert e.value.status_code == 400 and "trained for" in e.value.error


def test_browser_origins(server: Server) -> None:
    import urllib.error
    import urllib.request

    def get(origin: str) -> tuple[int, str | None]:
        req = urllib.request.Request(f"{server.url}/api/version", headers={"Origin": origin})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.headers.get("Access-Control-Allow-Origin")
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("Access-Control-Allow-Origin")

    assert get("http://localhost:5173") == (200, "http://localhost:5173")
    assert get("https://evil.example") == (403, None)


# ------------------------------------------------------------------------------------------ generation


def test_generate_streamed_and_not_and_stop_strings(server: Server) -> None:
    c = server.client()
    whole = c.generate("alpha", PROMPT, options=GREEDY)
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 12 and whole.model == "alpha:latest"
    parts = list(c.generate("alpha", PROMPT, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].eval_count == 12
    assert _visible("".join(p.response for p in parts)) == _visible(whole.response)
    stop = _visible(whole.response)[3:5]
    cut = c.generate("alpha", PROMPT, options={**GREEDY, "stop": [stop]})
    assert cut.done_reason == "stop" and _visible(cut.response) == _visible(whole.response).split(stop)[0]


def test_chat_streamed_and_not(server: Server) -> None:
    c = server.client()
    msgs = [{"role": "user", "content": PROMPT}]
    whole = c.chat("beta", msgs, options=GREEDY)
    assert whole.message.role == "assistant" and whole.done and whole.eval_count == 12
    parts = list(c.chat("beta", msgs, options=GREEDY, stream=True))
    assert parts[-1].done and _visible("".join(p.message.content for p in parts)) == _visible(whole.message.content)


# packages made from alpha for the test below: a TEMPLATE without {{ bos_token }} (the vocabulary adds BOS: llama-
# server's prompt starts with it), and a SYSTEM line without a TEMPLATE (the GGUF has none: llama.cpp's chatml)
DERIVED = {"nobos": {"from": "alpha", "template": "{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
                                                  "{% endfor %}assistant:"},
           "sysonly": {"from": "alpha", "system": "You are a test."}}


@pytest.mark.parametrize("model", ["alpha", "beta", "nobos", "sysonly"])
def test_greedy_tokens_identical_to_zipmoe_run(server: Server, model: str) -> None:
    """alpha has no TEMPLATE, SYSTEM or MESSAGE: both complete the prompt as it is; beta's prompt is one chat turn
    after its SYSTEM line, in its TEMPLATE; nobos's and sysonly's formatted as llama-server formats them (a BOS
    where the vocabulary adds one, chatml for a model without a template), by `zipmoe run` too. /api/chat of the
    same turn answers the same."""
    client = server.client()
    if model in DERIVED:
        status, answer = http_json(f"{server.url}/api/create", {"model": model, "stream": False, **DERIVED[model]})
        assert status == 200, answer
    try:
        ran = _zipmoe(server.root, "run", model, PROMPT, "-n", "12", "--temp", "0")
        assert ran.returncode == 0, ran.stderr[-2000:]
        expected = ran.stdout.rstrip("\n")
        served = client.generate(model, PROMPT, options=GREEDY)
        assert served.eval_count == 12 and _visible(served.response)
        # llama-cpp-python goes on past max_tokens while the text ends in a part of a UTF-8 character (17 tokens
        # here): the server's 12 tokens begin its text, and 24 go past it
        assert expected.startswith(_visible(served.response))
        longer = client.generate(model, PROMPT, options={**GREEDY, "num_predict": 24})
        assert _visible(longer.response).startswith(expected)
        if model != "alpha":  # a chat turn: /api/chat formats it the same way
            chat = client.chat(model, [{"role": "user", "content": PROMPT}], options=GREEDY)
            assert _visible(chat.message.content) == _visible(served.response)
    finally:
        if model in DERIVED:
            client.delete(model)  # (unloaded first)


def test_embed_starts_the_model_for_embeddings_and_it_still_completes(server: Server) -> None:
    """/api/embed starts the model's process again with llama-server's --embeddings (mean pooling: a generative
    model has none of its own); the process then answers completions too, with the same greedy tokens, and is not
    started again for them. /api/embeddings (not normalised), `dimensions` and OpenAI's /v1/embeddings agree."""
    import math

    c = server.client()
    before = c.generate("alpha", PROMPT, options=GREEDY).response
    pid = server.ps()["alpha:latest"]["zipmoe"]["pid"]
    answer = c.embed("alpha", [PROMPT, "something else entirely"])
    width = c.show("alpha").modelinfo["qwen3moe.embedding_length"]
    assert len(answer.embeddings) == 2 and all(len(v) == width for v in answer.embeddings)
    assert all(math.isclose(math.hypot(*v), 1.0, rel_tol=1e-4) for v in answer.embeddings)
    assert answer.embeddings[0] != answer.embeddings[1] and answer.prompt_eval_count > 0
    embedding_pid = server.ps()["alpha:latest"]["zipmoe"]["pid"]
    assert embedding_pid != pid
    # one text alone (llama.cpp's numbers depend on what else is in the batch: the two above came in one)
    first = c.embed("alpha", PROMPT).embeddings[0]
    raw = c.embeddings(model="alpha", prompt=PROMPT).embedding
    norm = math.hypot(*raw)
    assert norm > 0 and all(math.isclose(a / norm, b, rel_tol=1e-3, abs_tol=1e-5) for a, b in zip(raw, first))
    short = c.embed("alpha", PROMPT, dimensions=8).embeddings[0]
    head = math.hypot(*first[:8])
    assert len(short) == 8 and all(math.isclose(a, b / head, rel_tol=1e-3, abs_tol=1e-5)
                                   for a, b in zip(short, first))
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused").embeddings.create(model="alpha", input=PROMPT)
    assert all(math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-5) for a, b in zip(oai.data[0].embedding, first))
    assert c.generate("alpha", PROMPT, options=GREEDY).response == before
    assert server.ps()["alpha:latest"]["zipmoe"]["pid"] == embedding_pid


def test_openai_client_names_models_by_store_name(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    assert {m.id for m in client.models.list()} == {"alpha:latest", "beta:latest"}
    answer = client.chat.completions.create(model="beta", messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=12, temperature=0)
    assert answer.model == "beta:latest" and answer.usage.completion_tokens == 12
    ours = server.client().chat("beta", [{"role": "user", "content": PROMPT}], options=GREEDY)
    assert answer.choices[0].message.content == ours.message.content  # the same SYSTEM line, the same template
    chunks = list(client.chat.completions.create(model="beta", messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=12, temperature=0, stream=True))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert _visible(streamed) == _visible(ours.message.content)


def test_two_models_alternately_and_concurrently(server: Server) -> None:
    c = server.client()
    expected = {m: c.generate(m, PROMPT, options=GREEDY).response for m in ("alpha", "beta")}
    assert expected["alpha"] != expected["beta"]
    for m in ("alpha", "beta", "alpha", "beta"):
        assert c.generate(m, PROMPT, options=GREEDY).response == expected[m]
    got: list[tuple[str, str]] = []
    errors: list[BaseException] = []

    def ask(m: str) -> None:
        try:
            got.append((m, server.client().generate(m, PROMPT, options=GREEDY).response))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(m,)) for m in ("alpha", "beta") * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(got) == 8
    assert all(text == expected[m] for m, text in got)
    # both stayed loaded: switching between models that fit costs no reload
    assert {"alpha:latest", "beta:latest"} <= set(server.ps())


# ------------------------------------------------------------------------------------------ loading and unloading


def test_ps_keep_alive_and_stop(server: Server) -> None:
    c = server.client()
    c.generate("alpha", PROMPT, options=GREEDY, keep_alive=-1)
    ps = server.ps()["alpha:latest"]
    assert ps["expires_at"].startswith("0001-") and ps["zipmoe"]["budget"] > 0 and ps["context_length"] == 256
    listed = c.ps()
    assert "alpha:latest" in {m.model for m in listed.models}
    shown = _zipmoe(server.root, "ps", "--port", str(server.port))
    assert shown.returncode == 0 and "alpha:latest" in shown.stdout and "forever" in shown.stdout
    c.generate("alpha", PROMPT, options=GREEDY, keep_alive=0)
    assert "alpha:latest" not in server.ps()
    c.generate("alpha", PROMPT, options=GREEDY, keep_alive="1s")
    assert "alpha:latest" in server.ps()
    deadline = time.monotonic() + 10
    while "alpha:latest" in server.ps() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "alpha:latest" not in server.ps()
    c.generate("beta", PROMPT, options=GREEDY)
    stopped = _zipmoe(server.root, "stop", "beta", "--port", str(server.port))
    assert stopped.returncode == 0, stopped.stderr
    assert "beta:latest" not in server.ps()
    missing = _zipmoe(server.root, "stop", "nosuch", "--port", str(server.port))
    assert missing.returncode != 0 and missing.stderr.startswith("zipmoe: error: model 'nosuch' not found")


def test_copy_and_delete(server: Server) -> None:
    c = server.client()
    assert c.copy("alpha", "gamma:v1").status == "success"
    assert "gamma:v1" in {m.model for m in c.list().models}
    assert c.generate("gamma:v1", PROMPT, options=GREEDY).response == c.generate("alpha", PROMPT,
                                                                                  options=GREEDY).response
    assert c.delete("gamma:v1").status == "success"
    assert "gamma:v1" not in {m.model for m in c.list().models} and "gamma:v1" not in server.ps()
    with pytest.raises(ollama.ResponseError) as e:
        c.generate("gamma:v1", PROMPT)
    assert e.value.status_code == 404
    assert c.generate("alpha", PROMPT, options=GREEDY).done  # its blobs are alpha's: still there


def test_zipmoe_ps_without_a_server_says_so(tmp_path: Path) -> None:
    done = _zipmoe(tmp_path, "ps", "--port", str(_port()))
    assert done.returncode == 2 and done.stderr.startswith("zipmoe: error: no zipmoe server answers at")
    assert done.stderr.count("\n") == 1


# ------------------------------------------------------------------------------------------ one budget


def test_one_budget_shared_by_the_loaded_models(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """A budget that holds both models' minimums but not both whole: both stay loaded, the one answering gets the
    room and the other shrinks to what is left; the shares never add up to more than the budget. A budget below
    the two minimums: loading one unloads the other (the least recently used), and both answer in turn."""
    from pyzipmoe.runtime.budget import model_memory

    llama_bin_dir()
    store = _store(tmp_path / "models", tiny_models, tmp_path)
    need = {n: model_memory(store.open(n).model_path) for n in ("alpha", "beta")}
    budget = need["alpha"].minimum + need["beta"].minimum + max(need["alpha"].expert_bytes,
                                                               need["beta"].expert_bytes) // 2
    s = Server(store.root, "--memory-budget", str(budget))
    try:
        c = s.client()
        expected = {m: c.generate(m, PROMPT, options=GREEDY).response for m in ("alpha", "beta")}
        for answering, idle in (("alpha", "beta"), ("beta", "alpha")):
            assert c.generate(answering, PROMPT, options=GREEDY).response == expected[answering]
            ps = s.ps()
            shares = {m: ps[f"{m}:latest"]["zipmoe"]["budget"] for m in ("alpha", "beta")}
            assert sum(shares.values()) <= budget
            assert shares[answering] == min(need[answering].whole, budget - need[idle].minimum)
            assert shares[idle] == budget - shares[answering]
            assert ps[f"{idle}:latest"]["zipmoe"]["resident"] <= shares[idle]
    finally:
        s.stop()
    small = max(need["alpha"].minimum, need["beta"].minimum) + 1
    s = Server(store.root, "--memory-budget", str(small))
    try:
        c = s.client()
        for m in ("alpha", "beta", "alpha"):
            assert c.generate(m, PROMPT, options=GREEDY).response == expected[m]
            assert set(s.ps()) == {f"{m}:latest"}
    finally:
        s.stop()


def test_create_from_a_stored_model_and_not_from_a_file(server: Server, tiny_models: dict[str, Path]) -> None:
    c = server.client()
    c.create("delta", from_="alpha", system="You are brief.", parameters={"temperature": 0, "num_predict": 5},
             template="{{ bos_token }}{% for m in messages %}{{ m.role }}> {{ m.content }}\n{% endfor %}bot>")
    shown = c.show("delta")
    assert "You are brief." in shown.modelfile and "num_predict" in shown.parameters
    answer = c.generate("delta", PROMPT)
    assert answer.eval_count == 5  # its PARAMETER num_predict applies
    with pytest.raises(ollama.ResponseError) as e:
        c.create("epsilon", from_=str(tiny_models["qwen3moe"]))
    assert e.value.status_code == 400 and "cannot name a file" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        c.create("epsilon", from_="nosuch")
    assert e.value.status_code == 404
    assert c.delete("delta").status == "success"


def test_format_and_tools_reach_llama_server(server: Server) -> None:
    c = server.client()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for fmt in (schema, "json"):
        answer = c.generate("alpha", PROMPT, format=fmt, options={"temperature": 0, "num_predict": 48})
        if answer.done_reason == "stop":  # (within 48 tokens) the grammar made it JSON
            parsed = json.loads(answer.response)
            assert isinstance(parsed, dict) and (fmt == "json" or isinstance(parsed["ok"], bool))
        else:
            assert answer.response.lstrip().startswith("{")
    tool = {"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {
                                                 "type": "string"}}, "required": ["city"]}}}
    for stream in (False, True):
        got = c.chat("beta", [{"role": "user", "content": "weather in Paris?"}], tools=[tool], options=GREEDY,
                     stream=stream)
        last = list(got)[-1] if stream else got
        assert last.done


def _gone(pids: list[int], seconds: float = 15) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split(") ")[-1][:1] not in ("Z", "X"):
                        alive.append(pid)
            except OSError:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("grace", [10, 0])
def test_the_models_stop_with_the_server(tiny_models: dict[str, Path], tmp_path: Path, grace: float) -> None:
    """Stopped (SIGTERM) or killed (SIGKILL), the server leaves no model's process behind."""
    llama_bin_dir()
    store = _store(tmp_path / "models", tiny_models, tmp_path)
    s = Server(store.root)
    try:
        for m in ("alpha", "beta"):
            s.client().generate(m, PROMPT, options=GREEDY)
        pids = s.pids()
        assert len(pids) == 2
    finally:
        s.stop(grace)
    assert _gone(pids)


def test_a_model_s_process_answers_only_the_server(server: Server) -> None:
    """A web page that finds a model's llama-server on the loopback cannot call it: it takes the server's key
    only, so every request goes through the server's origin check."""
    server.client().generate("alpha", PROMPT, options=GREEDY)
    pid = server.ps()["alpha:latest"]["zipmoe"]["pid"]
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    port = int(argv[argv.index(b"--port") + 1])
    assert http_json(f"http://127.0.0.1:{port}/completion", {"prompt": "hi", "n_predict": 1})[0] == 401
    assert b"--api-key" not in argv  # (the key is not on its command line, where `ps` would show it)


def test_two_models_in_a_memory_cgroup_answer_in_turn_within_it(small_models: tuple[Path, Path],
                                                              cgroup_parent: Path, tmp_path: Path) -> None:
    """Two models whose whole sizes together exceed the server's budget, in a memory cgroup of the budget plus
    the processes' own memory: both answer in turn, as they answer alone, and nothing is OOM-killed."""
    from pyzipmoe.runtime.budget import model_memory
    from pyzipmoe.runtime.memory import make_memory_cgroup, remove_cgroup

    llama_bin_dir()
    _, packed = small_models
    store = ModelDirectory(tmp_path / "models")
    store.create("one", f"FROM {packed}\nPARAMETER num_ctx 256\n", base_dir=tmp_path)
    store.create("two", f"FROM {packed}\nPARAMETER num_ctx 256\nSYSTEM You are a test.\n{TEMPLATE}",
                 base_dir=tmp_path)
    need = model_memory(packed)
    budget = 2 * need.minimum + need.expert_bytes // 2
    assert 2 * need.whole > budget
    alone = Server(store.root, "--parallel", "1")
    try:
        expected = {m: alone.client().generate(m, PROMPT, options=GREEDY).response for m in ("one", "two")}
    finally:
        alone.stop()
    overhead = 192 * 2**20  # the server's Python, two llama-servers, their KV caches and compute buffers
    cgroup = make_memory_cgroup(cgroup_parent / f"zipmoe-serve-test-{os.getpid()}", budget + overhead)
    s = Server(store.root, "--memory-budget", str(budget), "--parallel", "1", cgroup=cgroup)
    try:
        c = s.client()
        for m in ("one", "two", "one", "two"):
            assert c.generate(m, PROMPT, options=GREEDY).response == expected[m]
            ps = s.ps()
            assert set(ps) == {"one:latest", "two:latest"} or set(ps) == {f"{m}:latest"}
            assert sum(p["zipmoe"]["budget"] for p in ps.values()) <= budget
        oom = dict(line.split() for line in (cgroup / "memory.oom_control").read_text().splitlines())
        assert int(oom.get("oom_kill", 0)) == 0 and s.proc.poll() is None
    finally:
        s.stop()
        remove_cgroup(cgroup)


def test_requests_that_arrive_while_their_model_loads_wait_for_it(tiny_models: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    llama_bin_dir()
    store = _store(tmp_path / "models", tiny_models, tmp_path)
    s = Server(store.root)
    try:
        got: list[str] = []
        threads = [threading.Thread(target=lambda: got.append(s.client().generate("alpha", PROMPT,
                                                                                  options=GREEDY).response))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(got) == 4 and len(set(got)) == 1
        pids = s.pids()
        assert len(pids) == 1  # one load served them all
        os.kill(pids[0], 9)  # a model's process that dies is started again by the next request
        assert _gone(pids)
        assert s.client().generate("alpha", PROMPT, options=GREEDY).response == got[0]
        assert s.pids() != pids
    finally:
        s.stop()


def test_a_client_that_goes_away_frees_its_slot(tmp_path: Path) -> None:
    """With one slot, a request right after a client dropped its endless stream is answered at once: the stream
    was cancelled in the model's process too (else the slot would be busy until the 32k-token context filled)."""
    import dataclasses
    import urllib.request

    from pyzipmoe import synth

    llama_bin_dir()
    src = tmp_path / "long.gguf"
    synth.write_config(src, dataclasses.replace(synth.PRESETS["tiny"], n_ctx=32768))
    store = ModelDirectory(tmp_path / "models")
    store.create("long", f"FROM {src}\nPARAMETER num_ctx 32768\n", base_dir=tmp_path, chunk_n=300, threads=2)
    s = Server(store.root, "--parallel", "1")
    try:
        s.client().generate("long", PROMPT, options=GREEDY)  # loaded
        # (through /v1, which passes llama-server's own ignore_eos: the synthetic model would end on its own)
        body = json.dumps({"model": "long", "prompt": PROMPT, "max_tokens": 30000, "ignore_eos": True,
                           "stream": True}).encode()
        req = urllib.request.Request(f"{s.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            for _ in range(6):
                assert r.readline()
        time.sleep(0.5)
        t0 = time.monotonic()
        answer = s.client().generate("long", PROMPT, options=GREEDY)
        assert answer.eval_count == 12 and time.monotonic() - t0 < 3
        assert s.ps()["long:latest"]["zipmoe"]["active"] == 0
    finally:
        s.stop()
