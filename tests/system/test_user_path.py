"""What a new user meets first: sizes in their own units, `zipmoe run MODEL PROMPT` as `ollama run` takes it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import helpers
import pyzipmoe
from pyzipmoe.errors import ZipmoeError
from pyzipmoe.runtime.budget import budget_text, check_budget, human_size, model_memory, parse_budget

REPO = Path(pyzipmoe.__file__).resolve().parent.parent


def python_m(*argv: object, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "pyzipmoe", *map(str, argv)], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.mark.parametrize("n,text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (100 << 10, "100.0 KiB"),
                                    (3_250_586, "3.1 MiB"), (6 << 30, "6.0 GiB"), (3 << 40, "3.0 TiB")])
def test_human_size_picks_the_unit(n: int, text: str) -> None:
    assert human_size(n) == text


@pytest.mark.parametrize("given,nbytes,text", [("100KiB", 100 << 10, "100 KiB"), (" 1.5 g", 3 << 29, "1.5 g"),
                                               ("512", 512, "512 bytes"), ("4096", 4096, "4096 bytes (4.0 KiB)"),
                                               ("60%", 1 << 30, "60% (1.0 GiB)"), (2048, 2048, "2.0 KiB")])
def test_budget_text_keeps_the_users_units(given: str | int, nbytes: int, text: str) -> None:
    assert budget_text(given, nbytes) == text


def test_a_small_budget_is_refused_in_the_users_unit(zipmoe_model: Path) -> None:
    need = model_memory(zipmoe_model)
    with pytest.raises(ZipmoeError) as e:
        check_budget(parse_budget("100KiB"), need, "100KiB")
    assert f"memory budget 100 KiB is below the minimum of {human_size(need.minimum)}" in str(e.value)
    assert " 0 MiB" not in str(e.value)


def test_run_refuses_a_small_budget_in_the_users_unit(zipmoe_model: Path) -> None:
    need = model_memory(zipmoe_model)
    done = python_m("run", zipmoe_model, "--memory-budget", "100KiB", "-p", "hi", "-n", "1")
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"memory budget 100 KiB is below the minimum of {human_size(need.minimum)}" in done.stderr, done.stderr


def test_native_loader_echoes_the_users_budget(zipmoe_model: Path) -> None:
    """Bare llama.cpp under ZIPMOE_MEMORY_BUDGET=100KiB: the loader's refusal says 100KiB, not a rounded 0 MiB."""
    completion = helpers.llama_bin_dir() / "llama-completion"
    if not completion.exists():
        helpers.unavailable(f"{completion} is not built")
    need = model_memory(zipmoe_model)
    env = {**os.environ, "ZIPMOE_MEMORY_BUDGET": "100KiB"}
    out = subprocess.run([str(completion), "-m", str(zipmoe_model), "-n", "1", "-p", "hi", "-no-cnv"], env=env,
                         capture_output=True, text=True, timeout=120, check=False, stdin=subprocess.DEVNULL)
    assert out.returncode != 0
    assert f"memory budget 100KiB is below the minimum of {human_size(need.minimum)}" in out.stderr, out.stderr[-2000:]


def test_run_takes_the_prompt_as_ollama_does(zipmoe_model: Path) -> None:
    """`zipmoe run MODEL PROMPT` answers once, the same tokens as `-p PROMPT`."""
    flags = ("-n", "6", "--temp", "0", "-c", "64")
    positional = python_m("run", zipmoe_model, "The expert", *flags)
    with_p = python_m("run", zipmoe_model, "-p", "The expert", *flags)
    assert positional.returncode == 0, positional.stderr[-2000:]
    assert with_p.returncode == 0, with_p.stderr[-2000:]
    assert positional.stdout == with_p.stdout and positional.stdout.strip()


def test_run_refuses_two_prompts(zipmoe_model: Path) -> None:
    done = python_m("run", zipmoe_model, "one", "-p", "two")
    assert done.returncode == 2 and "give the prompt once" in done.stderr, done.stderr


def test_demo_runs_the_main_job(tmp_path: Path) -> None:
    """`zipmoe demo`: the zipmoe model under a budget of half the BF16 file gives the BF16 model's tokens; where a
    memory cgroup can be made, both runs stayed within its limit (the runtime did not need more than it was given)."""
    from pyzipmoe.cli.demo import cgroup_parent

    if not (helpers.llama_bin_dir() / "llama-simple").exists():
        helpers.unavailable("llama-simple is not built")
    done = python_m("demo", "--preset", "small", "-n", "8", "--workdir", tmp_path, "--keep")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "SYNTHETIC" in done.stdout and "\nidentical tokens: yes\n" in done.stdout, done.stdout
    assert "llama-cli -m " in done.stdout and "--memory-budget" in done.stdout and "pyzipmoe.Llama(" in done.stdout
    assert sorted(p.name for p in tmp_path.glob("*.gguf")) == ["small-qwen3moe-bf16.gguf",
                                                                "small-qwen3moe.zipmoe.gguf"]
    done = python_m("demo", "--preset", "small", "-n", "8", "--workdir", tmp_path / "again", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["synthetic"] and report["identical_tokens"]
    assert report["budget_bytes"] < report["bf16_bytes"] // 2 + (1 << 20)
    assert not list((tmp_path / "again").glob("*.gguf"))
    zipped = report["runs"]["zipmoe"]
    if cgroup_parent() is not None:
        assert report["cgroup"] and zipped["peak_source"] == "cgroup"
        assert 0 < zipped["peak_bytes"] <= report["limit_bytes"]
    else:
        assert zipped["peak_source"] == "rss"


def test_run_answers_in_the_packages_roles(tiny_model: Path, tmp_path: Path) -> None:
    """`zipmoe run NAME PROMPT` of a stored model with SYSTEM and MESSAGE lines: one chat turn after them, the same
    text as the library's chat completion of the stored model (llama_from_store) gives, and not the text without them."""
    helpers.llama_bin_dir()
    models = tmp_path / "models"
    env = {**os.environ, "ZIPMOE_MODELS": str(models),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}

    def zipmoe(*argv: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pyzipmoe", *map(str, argv)], capture_output=True, text=True,
                              env=env, timeout=180)

    (tmp_path / "Modelfile").write_text(f"FROM {tiny_model}\nSYSTEM You answer in one word.\n"
                                        "MESSAGE user Is the sky blue?\nMESSAGE assistant Yes.\n")
    (tmp_path / "Modelfile.bare").write_text(f"FROM {tiny_model}\n")
    for name, mf in (("roles", "Modelfile"), ("bare", "Modelfile.bare")):
        done = zipmoe("create", name, "-f", tmp_path / mf, "--quiet")
        assert done.returncode == 0, done.stderr
    flags = ("-n", "6", "--temp", "0", "-c", "256")
    with_roles = zipmoe("run", "roles", "Why is the sky blue?", *flags)
    without = zipmoe("run", "bare", "Why is the sky blue?", *flags)
    assert with_roles.returncode == 0 and without.returncode == 0, with_roles.stderr[-2000:]
    expected = subprocess.run(
        [sys.executable, "-c",
         "from pyzipmoe.models.directory import llama_from_store; "
         "llm = llama_from_store('roles', n_ctx=256, verbose=False); "
         "r = llm.create_chat_completion([{'role': 'user', 'content': 'Why is the sky blue?'}], max_tokens=6, "
         "temperature=0); print(r['choices'][0]['message']['content'] or '')"],
        capture_output=True, text=True, env=env, timeout=180)
    assert expected.returncode == 0, expected.stderr[-2000:]
    assert with_roles.stdout == expected.stdout
    assert with_roles.stdout != without.stdout


def _serve(argv: list[str], env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A server (zipmoe serve or llama-server) on a free loopback port, once it answers /health."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log, "wb") as err:
        proc = subprocess.Popen([*argv, "--port", str(port)], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{argv[:4]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if helpers.http_json(url + "/health", timeout=2)[0] == 200:
                return proc, url
        except OSError:
            pass
        time.sleep(0.1)
    helpers.kill_group(proc)
    raise AssertionError("the server was not ready in time")


def _chat(url: str, messages: list[dict[str, str]]) -> str:
    status, body = helpers.http_json(url + "/v1/chat/completions", {"messages": messages, "max_tokens": 6,
                                                                     "temperature": 0, "cache_prompt": False})
    assert status == 200, (status, body)
    return body["choices"][0]["message"]["content"]


def test_serve_applies_system_and_message(tiny_model: Path, tmp_path: Path) -> None:
    """`zipmoe serve NAME`: every chat starts with the package's SYSTEM (unless the client sent its own) and its
    MESSAGE history, as if the client had sent them (compared with llama-server given them in the request)."""
    lib_dir = helpers.llama_bin_dir()
    if not (lib_dir / "llama-server").exists():
        helpers.unavailable("llama-server is not built")
    env = {**os.environ, "ZIPMOE_MODELS": str(tmp_path / "models"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    (tmp_path / "Modelfile").write_text(f"FROM {tiny_model}\nSYSTEM You answer in one word.\n"
                                        "MESSAGE user Is the sky blue?\nMESSAGE assistant Yes.\n")
    done = subprocess.run([sys.executable, "-m", "pyzipmoe", "create", "roles", "-f", tmp_path / "Modelfile",
                           "--quiet"], capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr
    history = [{"role": "user", "content": "Is the sky blue?"}, {"role": "assistant", "content": "Yes."}]
    ask = {"role": "user", "content": "Why is the grass green?"}
    own = {"role": "system", "content": "You answer at length."}
    server_flags = ["-t", "2", "-c", "256", "-np", "1"]
    proc, url = _serve([sys.executable, "-m", "pyzipmoe", "serve", "roles", "--", *server_flags], env,
                       tmp_path / "roles.log")
    try:
        got = _chat(url, [ask]), _chat(url, [own, ask])
    finally:
        helpers.kill_group(proc)
    shown = subprocess.run([sys.executable, "-m", "pyzipmoe", "show", "roles", "--json"], capture_output=True,
                           text=True, env=env, timeout=60)
    blob = json.loads(shown.stdout)["model_path"]
    proc, url = _serve([str(lib_dir / "llama-server"), "-m", str(blob), *server_flags], env, tmp_path / "plain.log")
    try:
        expected = (_chat(url, [{"role": "system", "content": "You answer in one word."}, *history, ask]),
                    _chat(url, [own, *history, ask]))
        without = _chat(url, [ask])
    finally:
        helpers.kill_group(proc)
    assert got == expected
    assert got[0] != without


def test_roles_template_for_llama_cli(tiny_model: Path, tmp_path: Path) -> None:
    """llama-cli takes SYSTEM with -sysf (the package's flags): a template is written only for MESSAGE lines, and
    it puts the history in front of the conversation in the model's (here llama.cpp's default) format."""
    from types import SimpleNamespace

    from pyzipmoe.cli.programs import CHATML, _roles_template
    from pyzipmoe.models.modelfile import Message

    only_system = SimpleNamespace(messages=(), system="Be brief.", template=None)
    assert _roles_template(only_system, str(tiny_model), "llama-cli", tmp_path) == []
    assert _roles_template(None, str(tiny_model), "llama-server", tmp_path) == []
    flags = _roles_template(only_system, str(tiny_model), "llama-server", tmp_path)
    assert flags[:2] == ["--jinja", "--chat-template-file"]
    history = SimpleNamespace(messages=(Message("user", 'Say "hi"'), Message("assistant", "hi")), system=None,
                              template=None)
    flags = _roles_template(history, str(tiny_model), "llama-cli", tmp_path)
    text = Path(flags[-1]).read_text()
    assert text.endswith(CHATML) and '{"role": "user", "content": "Say \\"hi\\""}' in text
    assert "Be brief." not in text


# ------------------------------------------------------------------------------------- Modelfile = CLI


def test_create_checks_a_fixed_budget_against_the_minimum(tiny_model: Path, tmp_path: Path) -> None:
    """`PARAMETER memory_budget 1KiB` is refused by create, with its line and the minimum, as a run would refuse
    it (it once passed create and failed at run time); auto and a percentage depend on where the model runs."""
    from pyzipmoe.models.directory import ModelDirectory
    from pyzipmoe.models.modelfile import ModelfileError

    store = ModelDirectory(tmp_path / "store")
    need = model_memory(tiny_model)
    with pytest.raises(ModelfileError) as e:
        store.create("m", f"FROM {tiny_model}\nPARAMETER memory_budget 1KiB\n", base_dir=tmp_path)
    assert e.value.line == 2 and e.value.exit_code == 2 and "\n" not in str(e.value)
    assert f"PARAMETER memory_budget 1 KiB is below the minimum of {human_size(need.minimum)}" in str(e.value)
    assert store.list_models() == []
    for ok in ("auto", "60%", str(need.minimum)):
        store.create("m", f"FROM {tiny_model}\nPARAMETER memory_budget {ok}\n", base_dir=tmp_path)
    # a stored model as FROM: the same check for a budget given anew
    with pytest.raises(ModelfileError, match="is below the minimum"):
        store.create("m2", "FROM m\nPARAMETER memory_budget 100\n", base_dir=tmp_path)


def test_create_warns_once_of_the_old_cache_mode_spelling(tiny_model: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from pyzipmoe.cli import main

    (tmp_path / "Modelfile").write_text(f"FROM {tiny_model}\nPARAMETER cache_policy none\n")
    models = tmp_path / "store"
    assert main(["create", "m", "-f", str(tmp_path / "Modelfile"), "--quiet", "--models", str(models)]) == 0
    _, err = capsys.readouterr()
    assert err.count("zipmoe: warning: ") == 1 and err.count("\n") == 1 and "cache_mode none" in err, err
    assert main(["show", "m", "--parameters", "--models", str(models)]) == 0
    assert capsys.readouterr().out.split() == ["cache_mode", "none"]


def test_show_ends_with_a_newline(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pyzipmoe.cli import main

    (tmp_path / "Modelfile").write_text(f'FROM {tiny_model}\nSYSTEM "Be brief."\nLICENSE MIT\n'
                                        'TEMPLATE "{{ messages }}"\nPARAMETER temperature 0.5\n')
    models = str(tmp_path / "store")
    assert main(["create", "m", "-f", str(tmp_path / "Modelfile"), "--quiet", "--models", models]) == 0
    for flag, text in (("--system", "Be brief.\n"), ("--license", "MIT\n"), ("--template", "{{ messages }}\n")):
        capsys.readouterr()
        assert main(["show", "m", flag, "--models", models]) == 0
        assert capsys.readouterr().out == text, flag
    for flag in ("--modelfile", "--parameters", "--json"):
        assert main(["show", "m", flag, "--models", models]) == 0
        assert capsys.readouterr().out.endswith("\n"), flag


# ------------------------------------------------------------------------------------- zipmoe run


def _store_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "ZIPMOE_MODELS": str(tmp_path / "models"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def _zipmoe(env: dict[str, str], *argv: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pyzipmoe", *map(str, argv)], capture_output=True, text=True,
                          env=env, timeout=180)


def test_run_takes_options_after_the_model_and_the_prompt(zipmoe_model: Path) -> None:
    """`zipmoe run MODEL -n 4 hello` and `zipmoe run FILE --temp 0 hello` (once 'unrecognized arguments: hello')."""
    helpers.llama_bin_dir()
    before = python_m("run", "-n", "4", "--temp", "0", "-c", "64", zipmoe_model, "hello")
    between = python_m("run", zipmoe_model, "-n", "4", "--temp", "0", "-c", "64", "hello")
    after = python_m("run", zipmoe_model, "--temp", "0", "hello", "-n", "4", "-c", "64")
    assert before.returncode == 0, before.stderr[-2000:]
    assert between.returncode == 0 and after.returncode == 0, (between.stderr[-2000:], after.stderr[-2000:])
    assert before.stdout == between.stdout == after.stdout and before.stdout.strip()


@pytest.mark.parametrize("system_words,num_ctx", [(600, 256), (12, None)])
def test_run_checks_the_whole_prompt_against_the_context(tiny_model: Path, tmp_path: Path, system_words: int,
                                                         num_ctx: int | None) -> None:
    """A SYSTEM longer than the context ("Requested tokens (651) exceed context window of 256"), and a prompt as sent
    that does not fit in `-c 64` (a ValueError "could not broadcast"): one line, status 2, nothing printed, before
    the model loads."""
    helpers.llama_bin_dir()
    env = _store_env(tmp_path)
    (tmp_path / "Modelfile").write_text(f"FROM {tiny_model}\nSYSTEM {'word ' * system_words}\n"
                                        + (f"PARAMETER num_ctx {num_ctx}\n" if num_ctx else ""))
    assert _zipmoe(env, "create", "m", "-f", tmp_path / "Modelfile", "--quiet").returncode == 0
    done = _zipmoe(env, "run", "m", "hi", *(() if num_ctx else ("-c", "64")))
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr[-2000:])
    assert done.stderr.startswith("zipmoe: error: the prompt as sent") and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr and f"too many for a context of {num_ctx or 64}" in done.stderr


def test_run_fits_generation_in_a_small_context(tiny_model: Path, tmp_path: Path) -> None:
    """-c 128 (llama.cpp pads its context to 256): the prompt as sent (93 tokens of chatml, llama.cpp's template for
    a model without one) fits, the answer stops where the 128 tokens end (it once ran past them: ValueError "could
    not broadcast input array from shape (12,) into shape (0,)")."""
    helpers.llama_bin_dir()
    env = _store_env(tmp_path)
    (tmp_path / "Modelfile").write_text(f"FROM {tiny_model}\nSYSTEM Be brief.\n")
    assert _zipmoe(env, "create", "m", "-f", tmp_path / "Modelfile", "--quiet").returncode == 0
    done = _zipmoe(env, "run", "m", "hi", "-c", "128", "-n", "500", "--stats", "--temp", "0")
    assert done.returncode == 0, done.stderr[-2000:]
    prompt, generated = map(int, re.search(r"\[(\d+) prompt tokens, (\d+) generated", done.stderr).groups())
    assert prompt + generated <= 128 and generated > 0, done.stderr


def test_stats_count_the_prompt_as_sent(tiny_model: Path, tmp_path: Path) -> None:
    """--stats counts the chat template, SYSTEM and MESSAGE lines with the user's text (it once counted only the
    text): the count llama-cpp-python's own chat completion reports for the stored model."""
    helpers.llama_bin_dir()
    env = _store_env(tmp_path)
    (tmp_path / "Modelfile").write_text(f"FROM {tiny_model}\nSYSTEM {'You answer briefly. ' * 5}\n"
                                        "MESSAGE user Is the sky blue?\nMESSAGE assistant Yes.\n")
    assert _zipmoe(env, "create", "m", "-f", tmp_path / "Modelfile", "--quiet").returncode == 0
    done = _zipmoe(env, "run", "m", "Why?", "-n", "2", "--stats", "-c", "512")
    assert done.returncode == 0, done.stderr[-2000:]
    counted = int(re.search(r"\[(\d+) prompt tokens", done.stderr).group(1))
    usage = subprocess.run(
        [sys.executable, "-c",
         "from pyzipmoe.models.directory import llama_from_store; "
         "llm = llama_from_store('m', n_ctx=512, verbose=False); "
         "r = llm.create_chat_completion([{'role': 'user', 'content': 'Why?'}], max_tokens=1); "
         "print(r['usage']['prompt_tokens'])"], capture_output=True, text=True, env=env, timeout=180)
    assert usage.returncode == 0, usage.stderr[-2000:]
    assert counted == int(usage.stdout) > 40


def test_package_budget_auto_and_policy_reach_the_run(tiny_model: Path, tmp_path: Path) -> None:
    """`PARAMETER memory_budget auto` and `60%` (once refused by the Modelfile) run as --memory-budget does; a
    cache_policy is the eviction policy the runtime gets."""
    helpers.llama_bin_dir()
    env = _store_env(tmp_path)
    for name, budget in (("auto", "auto"), ("pct", "60%")):
        (tmp_path / "Modelfile").write_text(f"FROM {tiny_model}\nPARAMETER memory_budget {budget}\n"
                                            "PARAMETER cache_policy fifo\n")
        assert _zipmoe(env, "create", name, "-f", tmp_path / "Modelfile", "--quiet").returncode == 0
        done = _zipmoe(env, "run", name, "hi", "-n", "2", "--temp", "0", "-c", "64")
        assert done.returncode == 0, done.stderr[-2000:]


def _completion(url: str, prompt: str) -> str:
    status, body = helpers.http_json(url + "/completion", {"prompt": prompt, "n_predict": 24, "temperature": 0,
                                                           "cache_prompt": False})
    assert status == 200, (status, body)
    return body["content"]


def _first_unique_pair(text: str) -> int:
    """Where a 2-character stop string of plain ASCII first occurs in `text` and nowhere before (from index 2)."""
    for k in range(2, len(text) - 1):
        pair = text[k:k + 2]
        if pair.isascii() and pair.isprintable() and not set(pair) & set(' "#\\') and text.find(pair) == k:
            return k
    pytest.skip(f"no usable stop string in the model's text {text!r}")
    raise AssertionError("unreachable")


def test_serve_passes_stop_and_each_template_flag_once(tiny_model: Path, tmp_path: Path) -> None:
    """`zipmoe serve NAME`: PARAMETER stop is llama-server's default stop string (it never reached the server), and a
    model with a TEMPLATE and a SYSTEM gives --jinja and --chat-template-file once (llama-server warned 'specified
    multiple times')."""
    from pyzipmoe.cli.programs import CHATML

    lib_dir = helpers.llama_bin_dir()
    if not (lib_dir / "llama-server").exists():
        helpers.unavailable("llama-server is not built")
    env = _store_env(tmp_path)
    (tmp_path / "Modelfile").write_text(f'FROM {tiny_model}\nTEMPLATE """{CHATML}"""\nSYSTEM Be brief.\n')
    assert _zipmoe(env, "create", "plain", "-f", tmp_path / "Modelfile", "--quiet").returncode == 0
    flags = ["--", "-t", "2", "-c", "256", "-np", "1"]
    proc, url = _serve([sys.executable, "-m", "pyzipmoe", "serve", "plain", *flags], env, tmp_path / "plain.log")
    try:
        text = _completion(url, "The expert")
    finally:
        helpers.kill_group(proc)
    k = _first_unique_pair(text)
    (tmp_path / "Modelfile.stop").write_text(f"FROM plain\nPARAMETER stop {text[k:k + 2]}\n")
    assert _zipmoe(env, "create", "stops", "-f", tmp_path / "Modelfile.stop", "--quiet").returncode == 0
    proc, url = _serve([sys.executable, "-m", "pyzipmoe", "serve", "stops", *flags], env, tmp_path / "stops.log")
    try:
        stopped = _completion(url, "The expert")
    finally:
        helpers.kill_group(proc)
    assert stopped == text[:k], (text, k, stopped)
    for log in ("plain.log", "stops.log"):
        said = (tmp_path / log).read_text()
        for flag in ("--jinja", "--chat-template-file"):
            assert f"'{flag}' specified multiple times" not in said, (log, flag)


def test_bench_footer_says_the_budget_in_force(zipmoe_model: Path) -> None:
    """`zipmoe bench --memory-budget 30MiB` ended with 'zipmoe cache: unbounded'."""
    if not (helpers.llama_bin_dir() / "llama-bench").exists():
        helpers.unavailable("llama-bench is not built")
    done = python_m("bench", zipmoe_model, "-p", "4", "-n", "2", "-r", "1", "--memory-budget", "30MiB")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1].endswith("zipmoe cache: memory budget 30 MiB, eviction lfuda"), done.stdout
    done = python_m("bench", zipmoe_model, "-p", "4", "-n", "2", "-r", "1", "--memory-budget", "30MiB",
                    "--policy", "lru", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["memory_budget"] == 30 << 20 and report["policy"] == "lru"
    done = python_m("bench", zipmoe_model, "-p", "4", "-n", "2", "-r", "1")
    assert done.stdout.splitlines()[-1].endswith("zipmoe cache: unbounded"), done.stdout


@pytest.mark.parametrize("fixture", ["not_gguf", "truncated_gguf"])
def test_run_a_file_that_is_no_model_is_one_line(fixture: str, request: pytest.FixtureRequest) -> None:
    """The prompt is counted with the model's vocabulary before the model loads; a file whose vocabulary does not
    load is still one line from the model's load (pyzipmoe.Llama's message), status 2."""
    helpers.llama_bin_dir()
    done = python_m("run", request.getfixturevalue(fixture), "hi", "-n", "1")
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr[-2000:])
    assert done.stderr.startswith("zipmoe: error: ") and done.stderr.count("\n") == 1, done.stderr


def test_run_stops_at_the_packages_stop_string(tiny_model: Path, tmp_path: Path) -> None:
    """`zipmoe run NAME PROMPT` of a model without roles (a raw completion) takes its PARAMETER stop (and the other
    sampling parameters) as a chat turn does: the answer ends before the stop string (it ran on)."""
    helpers.llama_bin_dir()
    env = _store_env(tmp_path)
    (tmp_path / "Modelfile").write_text(f"FROM {tiny_model}\n")
    assert _zipmoe(env, "create", "plain", "-f", tmp_path / "Modelfile", "--quiet").returncode == 0
    flags = ("-n", "24", "--temp", "0", "-c", "256")
    plain = _zipmoe(env, "run", "plain", "The expert", *flags)
    assert plain.returncode == 0, plain.stderr[-2000:]
    text = plain.stdout.removesuffix("\n")
    k = _first_unique_pair(text)
    (tmp_path / "Modelfile.stop").write_text(f"FROM plain\nPARAMETER stop {text[k:k + 2]}\n")
    assert _zipmoe(env, "create", "stops", "-f", tmp_path / "Modelfile.stop", "--quiet").returncode == 0
    stopped = _zipmoe(env, "run", "stops", "The expert", *flags)
    assert stopped.returncode == 0 and stopped.stdout == text[:k] + "\n", (text, k, stopped.stdout)


def test_run_refuses_a_prompt_that_is_not_utf8(tiny_model: Path) -> None:
    """Bytes that are not UTF-8 on the command line (a UnicodeEncodeError traceback): one line, status 2."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "pyzipmoe", "run", str(tiny_model).encode(), b"\xff\xfe", b"-n", b"1"],
                          capture_output=True, env=env, timeout=120)
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 2 and done.stdout == b"", err
    assert err == "zipmoe: error: the prompt is not UTF-8 text (a model's tokenizer reads UTF-8)\n"


def test_chat_checks_system_and_messages_against_the_context(tiny_model: Path, tmp_path: Path) -> None:
    """`zipmoe run NAME` (llama-cli's chat) of a model whose SYSTEM does not fit in its num_ctx: one line and status
    2 before llama-cli starts (it started and refused every turn); with a context of llama-cli's own choice (-c after
    --) llama-cli decides."""
    lib_dir = helpers.llama_bin_dir()
    if not (lib_dir / "llama-cli").exists():
        helpers.unavailable("llama-cli is not built")
    env = _store_env(tmp_path)
    (tmp_path / "Modelfile").write_text(f"FROM {tiny_model}\nSYSTEM {'word ' * 600}\nPARAMETER num_ctx 256\n")
    assert _zipmoe(env, "create", "m", "-f", tmp_path / "Modelfile", "--quiet").returncode == 0
    done = subprocess.run([sys.executable, "-m", "pyzipmoe", "run", "m"], capture_output=True, text=True, env=env,
                          timeout=180, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and done.stdout == "", (done.stdout[-2000:], done.stderr[-2000:])
    assert done.stderr.startswith("zipmoe: error: the model's chat template with its SYSTEM and MESSAGE lines")
    assert done.stderr.count("\n") == 1 and "too many for a context of 256" in done.stderr, done.stderr
