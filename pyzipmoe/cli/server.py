"""`zipmoe serve` without a MODEL (every stored model behind one server: pyzipmoe.server), and the commands that
talk to such a server: `zipmoe ps` (the loaded models, their shares of the budget) and `zipmoe stop NAME`."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from ..errors import ZipmoeError
from ..server import DEFAULT_HOST, DEFAULT_PARALLEL, DEFAULT_PORT
from .formatting import EXIT_OK, command, human_size, nonnegative, positive, print_json, render_table


def serve_store(args: argparse.Namespace) -> int:
    """Serves every model of the store (ZIPMOE_MODELS) until interrupted; the models' processes stop with it."""
    from aiohttp import web

    from ..models.directory import ModelDirectory
    from ..runtime import runner
    from ..runtime.budget import AUTO
    from ..runtime.config import RuntimeConfig, split_shares
    from ..server.app import make_app
    from ..server.budget import SharedBudget
    from ..server.children import Models, Settings
    from ..server.ollama import ApiError, parse_keep_alive

    for flag in ("trace", "planner"):
        if getattr(args, flag, None):
            raise ZipmoeError(f"--{flag} plans one model: give it with `zipmoe serve MODEL`")
    runner.program("llama-server")  # a one-line error now rather than at the first request
    RuntimeConfig(policy=args.policy, hot_share=args.hot_share, sm_share=args.sm_share, cache=args.cache)  # checks
    try:
        keep_alive = parse_keep_alive(args.keep_alive)
    except ApiError as e:
        raise ZipmoeError(e.message.replace("keep_alive", "--keep-alive")) from None
    store = ModelDirectory()
    budget = SharedBudget(args.memory_budget or AUTO, policy=args.policy, split=split_shares(args.hot_share,
                                                                                           args.sm_share))
    settings = Settings(llama_args=list(getattr(args, "llama_args", None) or []), threads=args.threads,
                        ctx_size=args.ctx_size, cache=args.cache, policy=args.policy, hot_share=args.hot_share,
                        sm_share=args.sm_share, keep_alive=keep_alive, load_timeout=float(args.load_timeout),
                        max_loaded=args.max_loaded, parallel=args.parallel)
    models = Models(store, budget, settings)
    origins = [o.strip() for given in args.origins or () for o in given.split(",") if o.strip()]
    app = make_app(models, origins)
    def started(_: str) -> None:  # (run_app's announcement, once it listens)
        print(f"zipmoe: serving the models of {store.root} on http://{args.host}:{args.port} (Ollama's API under "
              f"/api, OpenAI's under /v1); memory budget {human_size(budget.total)}"
              f"{' (auto)' if budget.auto else ''}, shared by the loaded models", file=sys.stderr, flush=True)

    # handler_cancellation: a client that goes away mid-answer cancels its request, which closes the connection to
    # the model's llama-server, which frees the slot
    web.run_app(app, host=args.host, port=args.port, print=started, access_log=None, shutdown_timeout=10,
                handler_cancellation=True)
    return EXIT_OK


def add_store_options(p: argparse.ArgumentParser) -> None:
    """The options of `zipmoe serve` without a MODEL, added to the serve command's parser."""
    g = p.add_argument_group("serving the whole store (zipmoe serve without MODEL)")
    g.add_argument("--keep-alive", default="5m", metavar="DURATION",
                   help="how long a model stays loaded after its last request, as Ollama's keep_alive: 5m, 30s, 1h, "
                        "0 (unload at once) or -1 (keep); a request's keep_alive wins (default: %(default)s)")
    g.add_argument("--origins", action="append", metavar="ORIGINS",
                   help="browser origins allowed besides this machine's (comma-separated, * as a wildcard, e.g. "
                        "https://chat.example.com); pages of other origins are refused")
    g.add_argument("--max-loaded", type=nonnegative, default=0, metavar="N",
                   help="models loaded at once at most; 0: as many as the memory budget holds (default)")
    g.add_argument("--parallel", type=positive, default=DEFAULT_PARALLEL, metavar="N",
                   help="requests each model answers at once, each with the model's whole context (llama-server's "
                        "-np; its KV cache is N times as large); more wait for a slot (default: %(default)s)")
    g.add_argument("--load-timeout", type=positive, default=300, metavar="SECONDS",
                   help="how long a request waits for its model to load (default: %(default)s)")


# ------------------------------------------------------------------------------------------ ps and stop


def _call(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    url = f"http://{args.host}:{args.port}{path}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as r:
            return json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read()).get("error", e.reason)
        except (ValueError, AttributeError):
            message = e.reason
        raise ZipmoeError(str(message)) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ZipmoeError(f"no zipmoe server answers at http://{args.host}:{args.port} ({reason}); start one "
                          "with `zipmoe serve`") from None


def _until(expires_at: str) -> str:
    if expires_at.startswith("0001-"):
        return "forever"
    try:
        from datetime import datetime

        left = datetime.fromisoformat(expires_at.replace("Z", "+00:00")).timestamp() - time.time()
    except ValueError:
        return expires_at
    if left <= 1:
        return "now"
    return f"{left / 60:.0f} minutes from now" if left >= 90 else f"{left:.0f} seconds from now"


def cmd_ps(args: argparse.Namespace) -> int:
    answer = _call(args, "GET", "/api/ps")
    if args.json:
        print_json(answer)
        return EXIT_OK
    rows = []
    for m in answer.get("models", []):
        z = m.get("zipmoe") or {}
        rows.append((m["name"], m["digest"][:12], human_size(z.get("budget", m.get("size", 0))),
                     human_size(z.get("resident", 0)), str(m.get("context_length", "")), _until(m["expires_at"])))
    print(render_table(("NAME", "ID", "BUDGET", "CACHE", "CONTEXT", "UNTIL"), rows))
    total = (answer.get("zipmoe") or {}).get("memory_budget")
    if total is not None:
        print(f"memory budget {human_size(total)}, shared by the loaded models")
    return EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    _call(args, "POST", "/api/generate", {"model": args.model, "keep_alive": 0})
    return EXIT_OK


def _add_address(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=DEFAULT_HOST, help="the server's address (default: %(default)s)")
    p.add_argument("--port", type=positive, default=DEFAULT_PORT, help="the server's port (default: %(default)s)")
    p.add_argument("--timeout", type=positive, default=60, metavar="SECONDS", help=argparse.SUPPRESS)


def register(sub: Any) -> None:
    """Adds `ps` and `stop`, and the store server's options to `serve` (registered before this)."""
    if "serve" in sub.choices:
        add_store_options(sub.choices["serve"])
    p = command(sub, "ps", cmd_ps, help="list the models a zipmoe server has loaded",
                description="The models `zipmoe serve` (without MODEL) has loaded: each one's share of the server's "
                            "memory budget, what its expert cache holds, its context and when it is unloaded.",
                examples=("zipmoe ps", "zipmoe ps --port 9000 --json"))
    _add_address(p)
    p.add_argument("--json", action="store_true", help="print /api/ps's answer as JSON")
    p = command(sub, "stop", cmd_stop, help="unload a model from a zipmoe server",
                description="Unloads MODEL from the running `zipmoe serve` once its requests are answered, as "
                            "`ollama stop` does; its share of the budget goes to the other loaded models.",
                examples=("zipmoe stop mymoe", "zipmoe stop mymoe:v2 --port 9000"))
    p.add_argument("model", metavar="MODEL", help="a stored model's name")
    _add_address(p)
