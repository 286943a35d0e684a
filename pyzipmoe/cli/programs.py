"""`zipmoe run`, `serve` and `bench`: zipmoe's llama.cpp programs (and pyzipmoe.Llama for a `run -p` completion)
on a zipmoe or plain GGUF, a file or a package's name."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ZipmoeError
from ..runtime.completion import CHATML
from ..runtime.runner import DEFAULT_CONTEXT
from ..runtime.timing import PARALLEL_PROMPTS
from ..runtime.config import CACHE_MODES, DEFAULT_POLICY, POLICIES
from ..server import DEFAULT_HOST, DEFAULT_PORT
from .formatting import EXIT_OK, command, fraction, human_size, nonnegative, positive, print_json, render_table

if TYPE_CHECKING:
    from ..runtime.budget import Budget
    from ..runtime.controller import RuntimeSettings

LLAMA_COMMANDS = ("run", "serve", "bench")


def _llama_args(args: argparse.Namespace) -> list[str]:
    return list(getattr(args, "llama_args", None) or [])


def _common_llama_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    if getattr(args, "threads", None) is not None:
        flags += ["-t", str(args.threads)]
    if getattr(args, "ctx_size", None) is not None:
        flags += ["-c", str(args.ctx_size)]
    if getattr(args, "rpc", None):
        flags += ["--rpc", args.rpc, "-ngl", "all"]  # (every layer on the devices; -ngl after -- wins)
    if getattr(args, "tensor_split", None):
        flags += ["-ts", ",".join(f"{x:g}" for x in args.tensor_split)]
    return flags


def _rpc_options(args: argparse.Namespace) -> dict[str, Any]:
    """--rpc and --tensor-split as pyzipmoe.Llama's arguments (none given: none)."""
    if not getattr(args, "rpc", None):
        return {}
    return {"rpc_servers": args.rpc, **({"tensor_split": args.tensor_split} if args.tensor_split else {})}


def split_list(text: str) -> list[float]:
    """--tensor-split: comma-separated non-negative proportions, e.g. 3,1."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or any(not v >= 0 for v in values) or sum(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: proportions must be >= 0, not all 0")
    return values


def _is_text(prompt: str) -> bool:
    """Whether a prompt from the command line is UTF-8 (undecodable bytes arrive as surrogates)."""
    try:
        prompt.encode()
    except UnicodeEncodeError:
        return False
    return True


def _resolve(args: argparse.Namespace) -> tuple[str, Any]:
    """MODEL as a GGUF path or a stored model's name: (file, package). The package's memory_budget, cache_policy
    and cache_mode become the defaults of --memory-budget, --policy and --cache (the flags, given, win)."""
    from ..models.directory import resolve_model

    path, package = resolve_model(args.model)
    if package is not None:
        for dest, given in (("memory_budget", package.parameters.get("memory_budget")),
                            ("policy", package.cache_policy), ("cache", package.cache_mode)):
            if getattr(args, dest, None) is None:
                setattr(args, dest, given)
    return str(path), package


def _package_flags(package: Any, model: str, program: str, keep: Path) -> list[str]:
    """The flags that run `program` as the package says: its parameters, stop strings, system prompt and chat
    template, each flag once (a template written for its SYSTEM and MESSAGE lines replaces its TEMPLATE's)."""
    if package is None:
        return []
    roles = _roles_template(package, model, program, keep)
    return [*package.llama_program_args(program, template=not roles), *roles]


def _roles_template(package: Any, model: str, program: str, keep: Path) -> list[str]:
    """Flags that give llama-cli or llama-server the package's SYSTEM and MESSAGE lines where they have no flag of
    their own for them (MESSAGE for either, SYSTEM for llama-server): a chat template, written under `keep`, that
    puts them in front of every conversation's messages (after a system message the client sent, instead of
    SYSTEM), then formats as the package's TEMPLATE, the GGUF's template or llama.cpp's default would."""
    if package is None or not (package.messages or (program == "llama-server" and package.system)):
        return []
    from ..file.gguf import read_gguf

    base = package.template
    if not base:
        field = read_gguf(model).kv.get("tokenizer.chat_template")
        base = str(field.value) if field is not None else CHATML  # llama.cpp's for a model without one
    history = json.dumps([m.to_dict() for m in package.messages], ensure_ascii=False)
    system = json.dumps([{"role": "system", "content": package.system}] if package.system else [],
                        ensure_ascii=False)
    prefix = (f"{{%- set messages = (messages[:1] + {history} + messages[1:]) if (messages and "
              f"messages[0]['role'] == 'system') else ({system} + {history} + messages) -%}}\n")
    path = keep / "chat-template.jinja"
    path.write_text(prefix + base)
    return ["--jinja", "--chat-template-file", str(path)]


def cmd_run(args: argparse.Namespace) -> int:
    from ..runtime import runner, supervise

    if args.prompt_text is not None:
        if args.prompt is not None:
            raise ZipmoeError("give the prompt once: as PROMPT after MODEL, or with -p")
        args.prompt = args.prompt_text
    if args.prompt is not None and not _is_text(args.prompt):
        raise ZipmoeError("the prompt is not UTF-8 text (a model's tokenizer reads UTF-8)")
    model, package = _resolve(args)
    params = package.parameters if package else {}
    cache = args.cache
    extra = _llama_args(args)
    if args.prompt is None:
        _check_history(model, package, args.ctx_size or params.get("num_ctx"), extra)
        settings = _cache_settings(args, model)
        os.environ.update(settings.env)  # what libllama in llama-cli reads
        # interactive chat: llama-cli; the package's flags first, so that the user's win
        with tempfile.TemporaryDirectory(prefix="zipmoe-run-") as keep:
            argv = [str(runner.program("llama-cli")), "-m", model,
                    *_package_flags(package, model, "llama-cli", Path(keep)), *_common_llama_flags(args)]
            if args.n_predict is not None:
                argv += ["-n", str(args.n_predict)]
            if args.temp is not None:
                argv += ["--temp", str(args.temp)]
            if args.seed is not None:
                argv += ["--seed", str(args.seed)]
            return supervise.run_program([*argv, *extra], runner.environment(cache),
                                         **_supervision(args, model, settings.budget))
    if extra:
        raise ZipmoeError("llama.cpp arguments after -- go to the interactive llama-cli, not to a one-shot "
                          "completion (PROMPT or -p); "
                          "for a single chat turn with llama-cli use: zipmoe run MODEL -- -st -p PROMPT")
    def pick(given: Any, key: str, default: Any) -> Any:
        return given if given is not None else params.get(key, default)

    completion = runner.complete(model, args.prompt, n_predict=pick(args.n_predict, "num_predict", 128),
                                 threads=pick(args.threads, "num_thread", None),
                                 n_ctx=pick(args.ctx_size, "num_ctx", None),
                                 temperature=pick(args.temp, "temperature", 0.8), seed=pick(args.seed, "seed", None),
                                 cache=cache or "unbounded", out=sys.stdout, package=package,
                                 options={"memory_budget": args.memory_budget,
                                          "cache_policy": args.policy, "hot_share": args.hot_share,
                                          "sm_share": args.sm_share, "trace": args.trace,
                                          "planner": args.planner, **_rpc_options(args)})
    print()
    if args.stats:
        runner.print_completion_stats(completion)
    return EXIT_OK


def _check_history(model: str, package: Any, n_ctx: int | None, extra: list[str]) -> None:
    """Before llama-cli starts a chat: the package's SYSTEM and MESSAGE lines in its template must leave room in the
    context (llama-cli would refuse every turn). Counted as `zipmoe run NAME PROMPT` sends them (llama-cpp-python's
    formatting); where the context is llama-cli's own choice (no -c, no num_ctx, or -c after --) it decides."""
    if package is None or not (package.system or package.messages) or n_ctx is None:
        return
    if {"-c", "--ctx-size"} & set(extra):
        return
    from ..runtime import runner
    from ..runtime.libllama import quiet_llama_log

    quiet_llama_log()
    runner.prompt_tokens(model, "", package, n_ctx,
                         what="the model's chat template with its SYSTEM and MESSAGE lines (before a word of yours)")


def cmd_serve(args: argparse.Namespace) -> int:
    if args.model is None:
        if args.rpc:
            raise ZipmoeError("--rpc splits one model: give it, zipmoe serve MODEL --rpc HOST:PORT,...")
        from .server import serve_store

        return serve_store(args)
    from ..runtime import runner, supervise

    model, package = _resolve(args)
    settings = _cache_settings(args, model)
    os.environ.update(settings.env)
    with tempfile.TemporaryDirectory(prefix="zipmoe-serve-") as keep:
        argv = [str(runner.program("llama-server")), "-m", model, "--host", args.host, "--port", str(args.port),
                *_package_flags(package, model, "llama-server", Path(keep)), *_common_llama_flags(args)]
        return supervise.run_program([*argv, *_llama_args(args)], runner.environment(args.cache),
                                     **_supervision(args, model, settings.budget))


def _supervision(args: argparse.Namespace, model: str, budget: Budget | None) -> dict[str, Any]:
    """What the memory supervisor of llama-cli / llama-server needs (pyzipmoe.runtime.supervise.run_program): the
    budget as _cache_settings resolved it."""
    return {"model": model, "budget": budget, "policy": args.policy, "hot_share": args.hot_share,
            "sm_share": args.sm_share}


def cmd_bench(args: argparse.Namespace) -> int:
    from ..runtime import runner

    flags = ["-p", str(args.n_prompt), "-n", str(args.n_gen), "-r", str(args.repetitions)]
    if args.threads is not None:
        flags += ["-t", str(args.threads)]
    if args.no_warmup:
        flags.append("--no-warmup")
    from ..runtime.llama import is_zipmoe_file

    zipmoe_models = [m for m in args.models if is_zipmoe_file(m)]
    if args.planner is True and args.memory_budget is not None and len(zipmoe_models) > 1:
        raise ZipmoeError("the planner plans one model at a time: bench one zipmoe model under --memory-budget, or "
                          "give --hot-share (and --sm-share) to split every model's budget the same way")
    settings = _cache_settings(args, zipmoe_models[0] if zipmoe_models else args.models[0])
    if args.limit and settings.budget is None:
        raise ZipmoeError("--limit is the best speed of a cache of the budget's size: give --memory-budget")
    if args.parallel > 1 and (args.limit or not args.ledger):
        raise ZipmoeError("--parallel is the timed generation of --ledger, and --limit models one sequence: give "
                          "--ledger alone with --parallel")
    if args.parallel > len(PARALLEL_PROMPTS):
        raise ZipmoeError(f"--parallel {args.parallel}: at most {len(PARALLEL_PROMPTS)} sequences (one prompt each)")
    os.environ.update(settings.env)
    results, records = runner.llama_bench(args.models, [*flags, *_llama_args(args)], cache=args.cache)
    budget = settings.budget.nbytes if settings.budget is not None else None
    reports = _near_limit(args, zipmoe_models, budget)
    if args.json:
        print_json({"results": [r.to_dict() for r in results], "cache": args.cache or "unbounded",
                    "memory_budget": budget, "policy": args.policy, "llama_bench": records,
                    "timed": {m: r.to_dict() for m, r in reports.items()}})
        return EXIT_OK
    header = ("model", "size", "params", "threads", "ubatch", "test", "tokens/s")
    rows = [(r.model, human_size(r.model_size), f"{r.model_n_params / 1e6:.1f} M", str(r.n_threads), str(r.n_ubatch),
             r.test, f"{r.tokens_per_second:.2f} ± {r.stddev:.2f}") for r in results]
    print(render_table(header, rows))
    print(f"llama-bench, {args.repetitions} repetitions{', no warmup' if args.no_warmup else ' after a warmup run'}; "
          f"zipmoe cache: {_cache_in_force(args, settings.budget)}")
    _print_near_limit(args, reports)
    return EXIT_OK


def _near_limit(args: argparse.Namespace, models: list[str], budget: int | None) -> dict[str, Any]:
    """With --ledger or --limit: each zipmoe model's timed generation (its ledger; with --limit, its speed against
    the limit model for the budget's cache), {model: pyzipmoe.runtime.near_limit.Report}."""
    if not models or not (args.ledger or args.limit) or args.n_gen == 0:
        return {}
    from ..plan.calibration import usable_cores
    from ..runtime import near_limit

    llama = {k: v for k, v in {"memory_budget": args.memory_budget, "cache_policy": args.policy,
                               "hot_share": args.hot_share, "sm_share": args.sm_share, "trace": args.trace,
                               "planner": args.planner}.items() if v is not None}
    threads = args.threads or usable_cores()
    return {m: near_limit.measure(m, llama=llama, threads=threads, budget_bytes=budget if args.limit else None,
                                  gen=args.n_gen, prompt=args.n_prompt if args.ledger else 0,
                                  parallel=args.parallel) for m in models}


def _print_near_limit(args: argparse.Namespace, reports: dict[str, Any]) -> None:
    from ..runtime import ledger, near_limit

    for model, report in reports.items():
        print(f"\n{model}: {near_limit.limit_line(report)}")
        if args.ledger:
            print(render_table(("part", "ms/token", "share"), ledger.table_rows(report.stats)))
        if args.ledger and report.prompt:
            print(f"\nits timed prompt ({report.prompt['tokens']} random tokens, after one untimed): "
                  f"{report.prompt['tps']:.2f} tokens/s")
            print(render_table(("part", "ms/token", "share"), ledger.table_rows(report.prompt["stats"])))


def _cache_in_force(args: argparse.Namespace, budget: Budget | None) -> str:
    """What bench's footer says of the expert cache it ran with: the budget (as given, and in bytes) and the
    eviction policy, or the cache mode without a budget."""
    if budget is None:
        return args.cache or "unbounded"
    return f"memory budget {budget.text}, eviction {args.policy or DEFAULT_POLICY}"


def _cache_settings(args: argparse.Namespace, model: str) -> RuntimeSettings:
    """The runtime's settings for MODEL (pyzipmoe.runtime.controller.RuntimeSettings: its environment and the budget
    resolved once) from --memory-budget, --policy, --hot-share, --sm-share and --trace (a stored model's parameters
    are their defaults: _resolve); the planner splits the budget unless shares are given."""
    from ..runtime.controller import planner_by_default, runtime_settings
    from ..runtime.llama import is_zipmoe_file

    budget = args.memory_budget
    is_zipmoe = bool(is_zipmoe_file(model))
    if not is_zipmoe and budget is not None and args.trace is not None and args.planner is False:
        raise ZipmoeError(f"{model}: --trace is what the planner plans from, and --no-planner turns it off")
    if args.planner is not None:
        use_planner = args.planner
    elif not is_zipmoe:
        use_planner = args.trace is not None  # a plain GGUF is planned when asked or given a trace, as by Llama
    else:
        use_planner = planner_by_default(model, budget=budget, hot_share=args.hot_share, sm_share=args.sm_share)
    return runtime_settings(model, budget=budget, policy=args.policy, hot_share=args.hot_share,
                            sm_share=args.sm_share, trace=args.trace, is_zipmoe=is_zipmoe, use_planner=use_planner)


def _add_llama_options(p: argparse.ArgumentParser, *, ctx: str | None = "default: llama.cpp's",
                       rpc: bool = True) -> None:
    p.add_argument("-t", "--threads", type=positive, metavar="N", help="CPU threads (default: llama.cpp's)")
    if ctx:
        p.add_argument("-c", "--ctx-size", type=positive, metavar="N", help=f"context size in tokens ({ctx})")
    if rpc:
        p.add_argument("--rpc", metavar="SERVERS",
                       help="split the model's layers across ggml-rpc-server processes, host:port,... (llama.cpp's "
                            "--rpc, with every layer offloaded). A server started with --zipmoe-model and a copy of "
                            "the zipmoe file computes its layers' experts under its own budget; on a stock server they "
                            "stay on this machine and run on its CPU under its --memory-budget (docs/rpc.md)")
        p.add_argument("-ts", "--tensor-split", type=split_list, metavar="N0,N1,...",
                       help="with --rpc: the share of the layers for each server, e.g. 1,1 (default: by their free "
                            "memory)")
    p.add_argument("--memory-budget", metavar="SIZE",
                   help="everything the model may keep resident: e.g. 6GiB, 512MiB, 60%%, or auto (what the machine "
                        "or container has free, less a margin). It holds the weights that are not experts, the "
                        "experts of one expert tensor in flight, and the expert cache: decoded experts, unless "
                        "--hot-share, --sm-share or --planner split it. Too small: an error says the minimum. "
                        "Default: a stored model's PARAMETER memory_budget, else unbounded. Sets "
                        "ZIPMOE_MEMORY_BUDGET")
    p.add_argument("--policy", choices=POLICIES,
                   help=f"eviction under a budget: {DEFAULT_POLICY} (default, LFU with dynamic ageing), tlfu (the "
                        "paper's token-weighted LFU), lru, lfu, fifo; default also: a stored model's PARAMETER "
                        "cache_policy")
    p.add_argument("--hot-share", type=fraction, metavar="F",
                   help="share of the cache for decoded experts (default 1)")
    p.add_argument("--sm-share", type=fraction, metavar="F",
                   help="fixed share for sign+mantissa planes (their exponents are read from disk); the rest of "
                        "the cache keeps whole compressed experts")
    p.add_argument("--planner", action=argparse.BooleanOptionalAction, default=None,
                   help="let the planner split the cache per layer (see zipmoe plan). Default: on under a budget "
                        "without shares once `zipmoe calibrate MODEL` has measured this machine, else the cache "
                        "keeps decoded experts. It re-plans from the order the run's tokens route in with -p "
                        "(llama-cpp-python); llama-cli and llama-server keep the first plan (from --trace)")
    p.add_argument("--trace", metavar="FILE",
                   help="expert activation counts for the planner (.npz with counts[prompts, layers, experts]); "
                        "default: every expert equally likely")
    p.add_argument("--cache", choices=CACHE_MODES,
                   help="zipmoe expert cache: unbounded (default, or a stored model's PARAMETER cache_mode) keeps "
                        "decoded experts, none decodes on every use (sets ZIPMOE_CACHE)")


def register(sub: Any) -> None:
    """Adds `run`, `serve` and `bench` (zipmoe's llama.cpp build, build/bin, on a zipmoe or plain GGUF) to the
    `zipmoe` command's subparsers."""
    p = command(
        sub, "run", cmd_run, usage="zipmoe run [options] MODEL [PROMPT] [-- LLAMA_CLI_ARGS ...]",
        help="chat with a model, or complete a prompt",
        description="Without a prompt: an interactive chat with llama-cli from zipmoe's build of llama.cpp. With "
                         "PROMPT (or -p PROMPT): a one-shot raw completion of it printed to stdout (through "
                         "llama-cpp-python and the same libllama), as `ollama run MODEL PROMPT` answers once. MODEL "
                         "may be a stored model's name, a zipmoe GGUF or a plain one; a stored model's parameters "
                         "are the defaults of the options (memory_budget of --memory-budget, cache_policy of "
                         "--policy, cache_mode of --cache, num_ctx of -c, ...). The whole prompt as sent (the "
                         "model's chat template, SYSTEM and MESSAGE lines, and PROMPT) must fit in the context: "
                         "checked before the model loads. Options may come before or after MODEL and PROMPT; "
                         "arguments after -- go to llama-cli.",
        examples=("zipmoe run model.zipmoe.gguf                                  chat (llama-cli)",
                  "zipmoe run mymoe 'Why is the sky blue?'                       one-shot completion",
                  "zipmoe run model.zipmoe.gguf -p 'Once upon a time' -n 64      raw completion",
                  "zipmoe run model.zipmoe.gguf -p 'The capital of France is' --temp 0 --stats",
                  "zipmoe run model.zipmoe.gguf -- -st -p 'Why is the sky blue?'  one chat turn (llama-cli)",
                  "zipmoe run model.zipmoe.gguf -t 8 -- --jinja -sys 'Answer briefly.'"))
    p.add_argument("model", metavar="MODEL", help="a stored model's name, a zipmoe GGUF or a plain GGUF")
    p.add_argument("prompt_text", nargs="?", metavar="PROMPT",
                   help="complete PROMPT once and exit (as -p PROMPT)")
    p.add_argument("-p", "--prompt", metavar="PROMPT", help="complete PROMPT once and exit (raw completion)")
    p.add_argument("-n", "--n-predict", type=positive, metavar="N", help="tokens to generate (default with -p: 128)")
    p.add_argument("--temp", type=float, metavar="T", help="sampling temperature; 0 = greedy (default: 0.8)")
    p.add_argument("--seed", type=nonnegative, metavar="S", help="sampling seed (default: random)")
    p.add_argument("--stats", "-v", "--verbose", dest="stats", action="store_true",
                   help="with -p: print speed and the expert cache's counters (hits per tier, bytes read and decoded, "
                        "time stalled per token) to stderr")
    _add_llama_options(p, ctx=f"default: llama.cpp's; with -p the model's, at most {DEFAULT_CONTEXT}")

    p = command(
        sub, "serve", cmd_serve, usage="zipmoe serve [options] [MODEL] [-- LLAMA_SERVER_ARGS ...]",
        help="serve the stored models, or one model, over HTTP (llama-server)",
        description="Without MODEL: serve every model of the store by name (NAME[:TAG]) with Ollama's REST API "
                         "under /api and OpenAI's under /v1, each loaded on first use in a llama-server of its own "
                         "and unloaded after --keep-alive, all within one --memory-budget (docs/serving.md). With "
                         "MODEL: run llama-server from zipmoe's build of llama.cpp on that one model, with its "
                         "OpenAI-compatible HTTP API (without llama.cpp's web UI, which the offline build does not "
                         "embed). Arguments after -- go to llama-server.",
        examples=(f"zipmoe serve                                       http://{DEFAULT_HOST}:{DEFAULT_PORT}/api/tags",
                  f"OLLAMA_HOST={DEFAULT_HOST}:{DEFAULT_PORT} ollama list        Ollama's client on the stored models",
                  f"zipmoe serve model.zipmoe.gguf                     http://{DEFAULT_HOST}:{DEFAULT_PORT}",
                  "zipmoe serve model.zipmoe.gguf --host 0.0.0.0 --port 9000 -t 8",
                  "zipmoe serve model.zipmoe.gguf -- -np 4 --jinja",
                  f"curl http://{DEFAULT_HOST}:{DEFAULT_PORT}/completion -d "
                  "'{\"prompt\": \"Hello\", \"n_predict\": 16}'"))
    p.add_argument("model", metavar="MODEL", nargs="?",
                   help="a stored model's name, a zipmoe GGUF or a plain GGUF; without it, every stored model "
                        "(Ollama's API, docs/serving.md)")
    p.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=positive, default=DEFAULT_PORT, help="port (default: %(default)s)")
    _add_llama_options(p)

    p = command(
        sub, "bench", cmd_bench, usage="zipmoe bench [options] MODEL [MODEL ...] [-- LLAMA_BENCH_ARGS ...]",
        help="measure prompt and generation speed (llama-bench)",
        description="Measure prompt processing (ppN) and generation (tgN) speed in tokens/s with llama-bench "
                         "from zipmoe's build of llama.cpp. Give several models to compare them, e.g. a BF16 GGUF and "
                         "its zipmoe GGUF. llama-bench's warmup run decodes most experts, so by default this measures "
                         "a warm expert cache; --no-warmup measures the first run after loading. --ledger and "
                         "--limit add a timed greedy generation of each zipmoe model: where its time goes, and its "
                         "speed as a share of the best any cache of the budget's size could reach on that run's "
                         "routing (Belady's hits, reads overlapped with compute, decoding on every core; "
                         "pyzipmoe/plan/limit.py). Arguments after -- go to llama-bench.",
        examples=("zipmoe bench model.zipmoe.gguf",
                  "zipmoe bench model-bf16.gguf model.zipmoe.gguf -p 256 -n 64 -t 8",
                  "zipmoe bench model.zipmoe.gguf --cache none --json",
                  "zipmoe bench model.zipmoe.gguf --memory-budget 4GiB --ledger --limit -n 64",
                  "zipmoe bench model.zipmoe.gguf --memory-budget 4GiB --ledger --parallel 4 -n 32",
                  "zipmoe bench model.zipmoe.gguf -- -ub 1,512"))
    p.add_argument("models", nargs="+", metavar="MODEL", help="one or more GGUFs (zipmoe or plain)")
    p.add_argument("-p", "--n-prompt", type=nonnegative, default=512, metavar="N",
                   help="prompt tokens of the pp test, 0 for none (default: %(default)s)")
    p.add_argument("-n", "--n-gen", type=nonnegative, default=128, metavar="N",
                   help="generated tokens of the tg test, 0 for none (default: %(default)s)")
    p.add_argument("-r", "--repetitions", type=positive, default=5, metavar="N",
                   help="repetitions of each test (default: %(default)s)")
    p.add_argument("--no-warmup", action="store_true", help="no warmup run: the first repetition is a cold start")
    p.add_argument("--json", action="store_true", help="print the results (and llama-bench's records) as JSON")
    p.add_argument("--ledger", action="store_true",
                   help="after llama-bench, time -n tokens of greedy generation of each zipmoe model in a fresh "
                        "process and print where a token's time goes: compute, decode, waiting for reads, waiting "
                        "for other threads, zipmoe's bookkeeping, outside the graph; with -p N, the same for a "
                        "prompt of N random tokens before it")
    p.add_argument("--parallel", type=positive, default=1, metavar="N",
                   help="with --ledger: the timed generation decodes N sequences of different prompts in lockstep, "
                        f"a step of one token of each, as llama-server -np N's slots (1-{len(PARALLEL_PROMPTS)}; "
                        "default: 1); tokens/s counts every sequence's tokens")
    p.add_argument("--limit", action="store_true",
                   help="with --memory-budget: time -n tokens of greedy generation of each zipmoe model and give "
                        "its speed as a share of the limit model's for the budget's expert cache, on that run's own "
                        "routing, with this machine's rates (zipmoe calibrate's, measured if none are kept; the "
                        "compute per token from the same generation unbounded)")
    _add_llama_options(p, ctx=None, rpc=False)
