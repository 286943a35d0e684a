"""Multi-token steps under a tiny budget: llama-server's n-gram speculation and draft-model speculation (a step
verifies several drafted tokens) and parallel slots (-np 4: a step serves four requests) give the same greedy tokens
as plain one-token generation, every tier evicting and reading again; --spec-backoff (patches/0007) drafts less
after rejected drafts and changes nothing else."""

from __future__ import annotations

import re
import socket
import subprocess
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import http_json, llama_bin_dir, stderr_tail, unavailable, worker_env

TIMEOUT = 600
# repetitive text over many distinct tokens: n-gram speculation finds drafts for the tiny random model's continuation
PROMPT = "one two three four five, one two three four five. " + "abcdefghijklmnopqrstuvwxyz0123456789!?%&/ " * 4
PROMPTS = [PROMPT, "the expert said hello to the world", "water and time and water and time and", "hello hello"]
N_PREDICT = 24
# long enough for the 1-token lookup to find a draft more than a few times (the tiny model's context ends first)
BACKOFF_PREDICT = 64
# a 1-token n-gram lookup: it drafts wherever a token recurs, and the tiny random model rejects most of it
NGRAM1 = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1", "--spec-ngram-simple-size-m", "8",
          "--spec-ngram-simple-min-hits", "1", "--spec-draft-n-min", "0", "--spec-draft-n-max", "8")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """llama-server on 127.0.0.1 with a zipmoe model under `budget` (None: none), `env` added to its environment;
    killed on close."""

    def __init__(self, model: Path, budget: int | None, tmp_path: Path, *args: str, env: dict[str, str] | None = None):
        program = llama_bin_dir() / "llama-server"
        if not program.is_file():
            unavailable(f"{program} was not built")
        port = _free_port()
        self.log = tmp_path / f"server-{port}.log"
        env = {**worker_env(llama_bin_dir()), **({"ZIPMOE_MEMORY_BUDGET": str(budget)} if budget else {}),
               **(env or {})}
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen([str(program), "-m", str(model), "--port", str(port), "-t", "2", "-c", "1024",
                                          *args], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=err, start_new_session=True)
        self.url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"llama-server exited with {self.proc.returncode}: "
                                     f"{stderr_tail(self.log.read_text(errors='replace'))}")
            try:
                if http_json(self.url + "/health", timeout=2)[0] == 200:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.1)
        self.close()
        raise AssertionError("llama-server was not ready within 120 s")

    def complete(self, prompt: str, n_predict: int = N_PREDICT) -> dict:
        status, body = http_json(self.url + "/completion", {"prompt": prompt, "n_predict": n_predict, "temperature": 0,
                                                            "seed": 0, "cache_prompt": False}, TIMEOUT)
        assert status == 200, (status, body, stderr_tail(self.log.read_text(errors="replace")))
        return body

    def close(self) -> None:
        from pyzipmoe.runtime.runner import stop_group

        stop_group(self.proc)


@pytest.fixture
def tiny_budget(zipmoe_model: Path) -> int:
    """The smallest budget and a few experts: every token evicts and reads again."""
    from pyzipmoe.runtime.budget import model_memory

    return model_memory(zipmoe_model).minimum + (16 << 10)


def plain_tokens(zipmoe_model: Path, budget: int, tmp_path: Path, prompts: list[str],
                 n_predict: int = N_PREDICT) -> list[str]:
    server = Server(zipmoe_model, budget, tmp_path, "-np", "1")
    try:
        return [server.complete(p, n_predict)["content"] for p in prompts]
    finally:
        server.close()


def complete_once(model: Path, budget: int | None, tmp_path: Path, *server_args: str,
                  env: dict[str, str] | None = None, n_predict: int = N_PREDICT) -> dict:
    """PROMPT completed once by a llama-server started with server_args (and env), stopped after."""
    server = Server(model, budget, tmp_path, *server_args, env=env)
    try:
        return server.complete(PROMPT, n_predict)
    finally:
        server.close()


def test_ngram_speculation_gives_the_greedy_tokens_under_a_tiny_budget(zipmoe_model: Path, tiny_budget: int,
                                                                       tmp_path: Path):
    plain = plain_tokens(zipmoe_model, tiny_budget, tmp_path, [PROMPT])
    body = complete_once(zipmoe_model, tiny_budget, tmp_path, "-np", "1", "--spec-type", "ngram-simple",
                         "--spec-ngram-simple-size-n", "1", "--spec-ngram-simple-size-m", "4",
                         "--spec-ngram-simple-min-hits", "1", "--spec-draft-n-min", "0", "--spec-draft-n-max", "8")
    assert plain[0] and body["content"] == plain[0]
    timings = body.get("timings", {})
    assert timings.get("draft_n", 0) > 0, timings  # steps did verify drafted tokens


@pytest.mark.parametrize("draft", ["same weights, BF16", "another MoE, zipmoe"])
def test_draft_model_speculation_gives_the_greedy_tokens_under_a_tiny_budget(zipmoe_model: Path, tiny_model: Path,
                                                                             tiny_budget: int, tmp_path: Path,
                                                                             draft: str):
    """A draft of the target's own weights (the BF16 source: its drafts are the greedy tokens, accepted) and a
    draft of other weights with the same vocabulary, itself a zipmoe GGUF sharing the process's one budget (its
    drafts mostly rejected): either way the verified tokens are plain generation's."""
    from dataclasses import replace

    from pyzipmoe import synth
    from pyzipmoe.file import convert

    plain = plain_tokens(zipmoe_model, tiny_budget, tmp_path, [PROMPT])
    if draft.startswith("same"):
        draft_model = tiny_model
    else:
        source, draft_model = tmp_path / "draft.gguf", tmp_path / "draft.zipmoe.gguf"
        synth.write_config(source, replace(synth.PRESETS["tiny"], seed=1))
        convert.convert(source, draft_model, threads=2)
        from pyzipmoe.runtime.budget import model_memory

        tiny_budget += model_memory(draft_model).minimum  # (one budget for both models' experts)
    body = complete_once(zipmoe_model, tiny_budget, tmp_path, "-np", "1", "--spec-type", "draft-simple",
                         "-md", str(draft_model), "--spec-draft-n-max", "4", "--spec-draft-n-min", "0",
                         "--spec-draft-p-min", "0")
    assert plain[0] and body["content"] == plain[0]
    timings = body.get("timings", {})
    assert timings.get("draft_n", 0) > 0, timings
    if draft.startswith("same"):
        assert timings.get("draft_n_accepted", 0) > 0, timings  # multi-token steps that kept their drafts


def test_four_parallel_slots_give_each_request_its_greedy_tokens_under_a_tiny_budget(zipmoe_model: Path,
                                                                                    tiny_budget: int, tmp_path: Path):
    plain = plain_tokens(zipmoe_model, tiny_budget, tmp_path, PROMPTS)
    server = Server(zipmoe_model, tiny_budget, tmp_path, "-np", "4")
    try:
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: server.complete(p)["content"], PROMPTS))
    finally:
        server.close()
    assert all(plain) and got == plain


def drafted(body: dict) -> tuple[str, int, int]:
    """A completion's text, its drafted tokens and how many of them were accepted."""
    timings = body.get("timings", {})
    return body["content"], timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)


def draft_events(model: Path, budget: int | None, tmp_path: Path, *server_args: str) -> tuple[dict, list[tuple]]:
    """PROMPT completed once (BACKOFF_PREDICT tokens at most), and what the server's -v log says of its drafts, in
    order: ("found",) where the n-gram lookup found a draft, ("verify", size) where a step verified one,
    ("accepted", n) where that step accepted n of its tokens."""
    server = Server(model, budget, tmp_path, *server_args, "-v")
    try:
        body = server.complete(PROMPT, BACKOFF_PREDICT)
    finally:
        server.close()
    events: list[tuple] = []
    for line in server.log.read_text(errors="replace").splitlines():
        if "found matching pattern" in line:
            events.append(("found",))
        elif m := re.search(r"generate_draft: .*#draft=(\d+)", line):
            events.append(("verify", int(m[1])))
        elif m := re.search(r"accepted (\d+)/\d+ draft tokens, new n_tokens", line):
            events.append(("accepted", int(m[1])))
    return body, events


def dropped_by_backoff(events: list[tuple], n: int) -> int:
    """Checks that the lookup's drafts were verified or dropped as --spec-backoff n says (n = 0: every one
    verified): after the k-th step in a row that accepted none of its tokens the next min(2^(k-1), n) drafts are
    dropped, and a step that accepts one ends that. Returns how many were dropped."""
    skip = fails = dropped = 0
    for i, event in enumerate(events):
        if event[0] == "found":
            verified = i + 1 < len(events) and events[i + 1][0] == "verify"
            assert verified == (skip == 0), (i, events)
            if not verified:
                skip, dropped = skip - 1, dropped + 1
        elif event[0] == "accepted" and n > 0:
            fails = 0 if event[1] > 0 else fails + 1
            skip = min(2 ** (fails - 1), n) if fails else 0
    return dropped


def test_spec_backoff_drafts_less_and_gives_the_tokens_of_the_bf16_source(tiny_model: Path, zipmoe_model: Path,
                                                                           tiny_budget: int, tmp_path: Path):
    """With the 1-token lookup most drafts are rejected: --spec-backoff 2 drops the lookup's drafts as its rule says
    (the server's log: which drafts it found, which a step verified, what each step accepted), so it verifies fewer
    drafted tokens, yet some, and gives the greedy text; the zipmoe GGUF under a tiny budget gives the patched
    build's text and drafts on the BF16 source (no budget) with the same flags, and the flag's
    LLAMA_ARG_SPEC_BACKOFF twin does as the flag does."""
    plain = plain_tokens(zipmoe_model, tiny_budget, tmp_path, [PROMPT], BACKOFF_PREDICT)[0]
    body, every = draft_events(zipmoe_model, tiny_budget, tmp_path, "-np", "1", *NGRAM1)
    always = drafted(body)
    body, events = draft_events(zipmoe_model, tiny_budget, tmp_path, "-np", "1", *NGRAM1, "--spec-backoff", "2")
    backoff = drafted(body)
    source = drafted(complete_once(tiny_model, None, tmp_path, "-np", "1", *NGRAM1, "--spec-backoff", "2",
                                   n_predict=BACKOFF_PREDICT))
    twin = drafted(complete_once(zipmoe_model, tiny_budget, tmp_path, "-np", "1", *NGRAM1,
                                 env={"LLAMA_ARG_SPEC_BACKOFF": "2"}, n_predict=BACKOFF_PREDICT))
    assert plain and always[0] == plain and backoff[0] == plain
    assert dropped_by_backoff(every, 0) == 0 and always[1] > always[2], (always, every)  # rejected drafts
    assert dropped_by_backoff(events, 2) > 0, events
    assert sum(e[1] for e in events if e[0] == "verify") == backoff[1], (backoff, events)
    assert 0 < backoff[1] < always[1], (backoff, always)
    assert source == backoff and twin == backoff


def test_spec_backoff_skips_a_draft_models_steps(zipmoe_model: Path, tiny_budget: int, tmp_path: Path):
    """A draft model of other weights (BF16, the same vocabulary), whose drafts the target mostly rejects: backing
    off, the slot does not run it for a few tokens (the path of a draft that does not fit), and the verified tokens
    are still plain generation's."""
    from dataclasses import replace

    from pyzipmoe import synth

    draft_model = tmp_path / "draft.gguf"
    synth.write_config(draft_model, replace(synth.PRESETS["tiny"], seed=1))
    args = ("-np", "1", "--spec-type", "draft-simple", "-md", str(draft_model), "--spec-draft-n-max", "4",
            "--spec-draft-n-min", "0", "--spec-draft-p-min", "0")
    plain = plain_tokens(zipmoe_model, tiny_budget, tmp_path, [PROMPT])[0]
    always = drafted(complete_once(zipmoe_model, tiny_budget, tmp_path, *args))
    backoff = drafted(complete_once(zipmoe_model, tiny_budget, tmp_path, *args, "--spec-backoff", "4"))
    assert plain and always[0] == plain and backoff[0] == plain
    assert always[1] > always[2], always
    assert 0 < backoff[1] < always[1], (backoff, always)


def test_spec_backoff_0_is_off_and_the_flag_is_in_the_help(zipmoe_model: Path, tiny_budget: int, tmp_path: Path):
    """--spec-backoff 0 drafts and verifies as without the flag; the flag and its twin are in llama-server --help,
    and a negative value is refused."""
    always = drafted(complete_once(zipmoe_model, tiny_budget, tmp_path, "-np", "1", *NGRAM1))
    off = drafted(complete_once(zipmoe_model, tiny_budget, tmp_path, "-np", "1", *NGRAM1, "--spec-backoff", "0"))
    assert off == always and always[1] > 0
    program = str(llama_bin_dir() / "llama-server")
    env = worker_env(llama_bin_dir())
    shown = subprocess.run([program, "--help"], env=env, capture_output=True, text=True, errors="replace",
                           timeout=TIMEOUT, stdin=subprocess.DEVNULL, check=False)
    assert shown.returncode == 0, stderr_tail(shown.stderr)
    assert "--spec-backoff N" in shown.stdout and "LLAMA_ARG_SPEC_BACKOFF" in shown.stdout
    refused = subprocess.run([program, "-m", str(zipmoe_model), "--spec-backoff", "-1"], env=env, capture_output=True,
                             text=True, errors="replace", timeout=TIMEOUT, stdin=subprocess.DEVNULL, check=False)
    assert refused.returncode != 0 and "--spec-backoff" in refused.stderr, stderr_tail(refused.stderr)
