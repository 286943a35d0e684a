"""The loaded models: one llama-server per model, started on the first request that names it, on a loopback port
of its own, and stopped when its keep_alive runs out, when `zipmoe stop` (keep_alive 0) asks, or when the budget
needs its room (budget.py). Everything here runs on the server's event loop; process starts and stops go to
threads.

A request for a model that is loading waits for it (at most `load_timeout` seconds), as several requests to one
model wait for one load. A model's process is given the share of the budget it loads with
(ZIPMOE_MEMORY_BUDGET), its own control file (ZIPMOE_CONTROL) through which the budget is re-divided, the
package's flags (PARAMETERs and TEMPLATE, pyzipmoe.models.package.llama_program_args), the context size, and the
server's own llama-server arguments (after `--`). Its log goes to a file; a process that fails to load is
reported with the last error line of that log.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from ..errors import ZipmoeError
from ..models.directory import ModelDirectory
from ..models.name import InvalidNameError, ModelName, ModelNotFoundError
from ..models.package import ModelPackage
from ..runtime.lifetime import die_with_parent
from ..runtime.runner import DEFAULT_CONTEXT
from . import DEFAULT_PARALLEL
from .budget import SharedBudget, Tenant
from .ollama import DEFAULT_KEEP_ALIVE, ApiError

LOAD_TIMEOUT = 300.0  # seconds a request waits for its model to load (Ollama's OLLAMA_LOAD_TIMEOUT)
STOP_GRACE = 5.0  # seconds a model's process gets to finish before it is killed
BIND_TRIES = 3  # ports a model's process is given in turn when another process takes the one it was given
SETTLE_SECONDS = 2.0  # how long a load waits for the other models' caches to shrink to their new shares


@dataclass
class Settings:
    """How the server starts its models' processes (from `zipmoe serve`'s options)."""

    llama_args: Sequence[str] = ()  # the user's llama-server arguments, after the package's flags
    threads: int | None = None
    ctx_size: int | None = None  # the default context of every model (-c)
    cache: str | None = None  # ZIPMOE_CACHE
    policy: str | None = None
    hot_share: float | None = None
    sm_share: float | None = None
    keep_alive: float | None = DEFAULT_KEEP_ALIVE  # seconds; None: for ever
    load_timeout: float = LOAD_TIMEOUT
    max_loaded: int = 0  # 0: as many as the budget holds
    parallel: int = DEFAULT_PARALLEL  # requests a model answers at once, each with the whole context
    log_dir: Path | None = None


@dataclass
class Child:
    """A loaded model: its llama-server process and what the server knows of it."""

    key: str  # the full name (host/namespace/model:tag)
    name: str  # as shown (mymoe:latest)
    package: ModelPackage
    num_ctx: int
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    control: Any = None
    log: Path | None = None
    load_seconds: float = 0.0
    embeddings: bool = False  # started with llama-server's --embeddings (it then answers both kinds of request)
    active: int = 0  # requests in flight
    expires: float | None = None  # time.time() when it is unloaded; None: kept
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))  # its API key: only the server calls it
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def _without(flags: list[str], flag: str) -> list[str]:
    """flags less `flag` and its value (one the server gives itself)."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f == flag:
            skip = True
        else:
            out.append(f)
    return out


def _pooling(path: str, llama_args: Sequence[str]) -> list[str]:
    """How a model's process pools a text's token embeddings into one: the GGUF's own way (an embedding model's),
    else the mean (a generative model's, which has none); the server's `-- --pooling` wins."""
    from ..file.gguf import read_gguf

    if "--pooling" in llama_args:
        return []
    kv = read_gguf(path).kv
    arch = kv["general.architecture"].value if "general.architecture" in kv else ""
    field = kv.get(f"{arch}.pooling_type")
    return [] if field is not None and int(field.value) != 0 else ["--pooling", "mean"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def last_error_line(log: Path | None) -> str:
    """The line of a model's log that says why it stopped: the last one naming an error, else the last one."""
    if log is None:
        return ""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    for line in reversed(lines[-200:]):
        if "error" in line.lower() or "failed" in line.lower():
            return line
    return lines[-1] if lines else ""


class Models:
    """The store's models as the server runs them."""

    def __init__(self, store: ModelDirectory, budget: SharedBudget, settings: Settings) -> None:
        self.store = store
        self.budget = budget
        self.settings = settings
        self.children: dict[str, Child] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._packages: dict[str, tuple[tuple[int, int, int], ModelPackage]] = {}  # name -> (manifest stat, package)
        self._log_dir = settings.log_dir or Path(tempfile.mkdtemp(prefix="zipmoe-server-"))
        self._http: aiohttp.ClientSession | None = None
        self._reaper: asyncio.Task[None] | None = None

    # -- names

    def open(self, text: Any) -> ModelPackage:
        """The stored model a request names (never a file: a request cannot name a path). 404 if there is none.
        A model opened before is not read again while its manifest file is the same (a create, cp or rm replaces
        it by rename): reading and checking its small blobs took about a millisecond of every request."""
        if not isinstance(text, str) or not text:
            raise ApiError(400, "model is required")
        try:
            name = ModelName.parse(text)
        except InvalidNameError as e:
            raise ApiError(400, str(e)) from None
        try:
            st = self.store.manifest_path(name).stat()
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        except (FileNotFoundError, NotADirectoryError):
            raise ApiError(404, f"model '{text}' not found") from None
        cached = self._packages.get(str(name))
        if cached is not None and cached[0] == stamp:
            return cached[1]
        try:
            package = self.store.open(name)
        except ModelNotFoundError:
            raise ApiError(404, f"model '{text}' not found") from None
        self._packages[str(name)] = (stamp, package)
        return package

    async def package(self, text: Any) -> ModelPackage:
        """`open` from the event loop: a model opened before without leaving it."""
        try:
            name = ModelName.parse(text) if isinstance(text, str) and text else None
        except InvalidNameError:
            name = None
        cached = self._packages.get(str(name)) if name is not None else None
        if cached is not None:
            try:
                st = self.store.manifest_path(name).stat()
                if cached[0] == (st.st_ino, st.st_size, st.st_mtime_ns):
                    return cached[1]
            except OSError:
                pass
        return await asyncio.to_thread(self.open, text)

    # -- life cycle

    async def start(self) -> None:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        self._reaper = asyncio.create_task(self._reap())

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await asyncio.gather(*(self._unload(c) for c in list(self.children.values())), return_exceptions=True)
        if self._http is not None:
            await self._http.close()

    @property
    def http(self) -> aiohttp.ClientSession:
        assert self._http is not None, "Models.start() first"
        return self._http

    async def acquire(self, package: ModelPackage, *, num_ctx: int | None = None, embeddings: bool = False
                      ) -> Child:
        """The model's running process, loaded if it is not (waiting for a load under way), counted as busy until
        `release`. embeddings: one that answers embedding requests (a process started without them is started
        again with them, and keeps them: it answers completions too)."""
        key = str(package.name)
        lock = self._locks.setdefault(key, asyncio.Lock())
        try:
            await asyncio.wait_for(lock.acquire(), self.settings.load_timeout)
        except asyncio.TimeoutError:
            raise ApiError(503, f"timed out waiting for {package.name.display} to load") from None
        try:
            child = self.children.get(key)
            if child is not None and child.proc is not None and child.proc.poll() is not None:
                await self._unload(child)  # its process ended (killed, crashed): started again below
                child = None
            if child is not None and (child.package.digest != package.digest
                                      or (num_ctx is not None and num_ctx != child.num_ctx)
                                      or (embeddings and not child.embeddings)):
                # a new context, embeddings (or a model replaced in the store): started again
                embeddings = embeddings or child.embeddings
                await self._wait_idle(child)
                await self._unload(child)
                child = None
            if child is None:
                child = await self._load(key, package, num_ctx, embeddings)
            child.active += 1
            child.idle.clear()
            child.expires = None
        finally:
            lock.release()
        self.budget.touch(key)
        return child

    def release(self, child: Child, keep_alive: float | None) -> None:
        """A request is answered: the model stays loaded `keep_alive` seconds more (None: for ever; 0: unloaded
        now, unless another request is using it)."""
        child.active -= 1
        child.expires = None if keep_alive is None else time.time() + keep_alive
        if child.active == 0:
            child.idle.set()
            if keep_alive == 0:
                asyncio.get_running_loop().create_task(self._expire(child))

    async def stop(self, package: ModelPackage) -> bool:
        """Unloads the model once its requests are answered; whether it was loaded."""
        child = self.children.get(str(package.name))
        if child is None:
            return False
        await self._wait_idle(child)
        await self._unload(child)
        return True

    async def _expire(self, child: Child) -> None:
        if child.active == 0 and self.children.get(child.key) is child:
            await self._unload(child)

    async def _wait_idle(self, child: Child) -> None:
        if child.active:
            await child.idle.wait()

    async def _reap(self) -> None:
        """Unloads models whose keep_alive ran out, and idle ones an `auto` budget no longer holds."""
        while True:
            await asyncio.sleep(0.5)
            now = time.time()
            for child in list(self.children.values()):
                if child.active == 0 and child.expires is not None and child.expires <= now:
                    await self._unload(child)
            busy = [c.key for c in self.children.values() if c.active]
            for key in await asyncio.to_thread(self.budget.refresh, busy):
                if key in self.children and not self.children[key].active:
                    await self._unload(self.children[key])

    # -- starting and stopping a process

    def context_size(self, package: ModelPackage, num_ctx: int | None) -> int:
        """The context a model loads with: the request's num_ctx, else its PARAMETER num_ctx, else -c, else
        DEFAULT_CONTEXT (at most what the model was trained for). More than it was trained for: a 400."""
        trained = package.config.get("context_length")
        trained = int(trained) if isinstance(trained, int) and trained > 0 else None
        if num_ctx is not None:
            if num_ctx <= 0:
                raise ApiError(400, f"num_ctx {num_ctx} must be positive")
            if trained is not None and num_ctx > trained:
                raise ApiError(400, f"num_ctx {num_ctx} is more than {package.name.display} was trained for "
                                    f"({trained} tokens)")
            return num_ctx
        given = package.parameters.get("num_ctx") or self.settings.ctx_size
        if given:
            return int(given)
        return min(DEFAULT_CONTEXT, trained or DEFAULT_CONTEXT)

    async def _load(self, key: str, package: ModelPackage, num_ctx: int | None, embeddings: bool = False) -> Child:
        from ..runtime.budget import model_memory
        from ..runtime.llama import is_zipmoe_file

        ctx = self.context_size(package, num_ctx)
        path = package.model_path
        zipmoe = bool(await asyncio.to_thread(is_zipmoe_file, path))
        need = await asyncio.to_thread(model_memory, path)
        tenant = Tenant(key, need.minimum, need.whole)
        busy = [c.key for c in self.children.values() if c.active]
        if self.settings.max_loaded and len(self.children) >= self.settings.max_loaded:
            idle = sorted((c for c in self.children.values() if not c.active),
                          key=lambda c: self.budget.last_used(c.key))
            if not idle:
                raise ApiError(503, f"{self.settings.max_loaded} models are loaded and answering; try again later")
            await self._unload(idle[0])
        try:
            share, victims = self.budget.admit(tenant, busy)
        except ZipmoeError as e:
            raise ApiError(503, str(e)) from None
        for victim in victims:
            if victim in self.children:
                await self._unload(self.children[victim])
        self.budget.make_room(tenant)
        await self._settle()
        child = Child(key, package.name.display, package, ctx, embeddings=embeddings)
        t0 = time.monotonic()
        try:
            argv, env = await asyncio.to_thread(self._spawn, child, tenant, share, zipmoe, need.other_bytes)
            for attempt in range(BIND_TRIES):
                self._start(child, argv, env)
                try:
                    await self._wait_ready(child)
                    break
                except ApiError:
                    # the free port it was given was taken before it bound it: another one
                    if attempt + 1 == BIND_TRIES or "couldn't bind" not in last_error_line(child.log):
                        raise
                    child.port = free_port()
                    argv[argv.index("--port") + 1] = str(child.port)
        except BaseException:
            await asyncio.to_thread(self._kill, child)
            self.budget.remove(key)
            raise
        child.load_seconds = time.monotonic() - t0
        self.children[key] = child
        child.ready.set()
        return child

    async def _settle(self) -> None:
        deadline = time.monotonic() + SETTLE_SECONDS
        while time.monotonic() < deadline and not self.budget.settled(self.budget.names()):
            await asyncio.sleep(0.02)

    def _spawn(self, child: Child, tenant: Tenant, share: int, zipmoe: bool, other_bytes: int
               ) -> tuple[list[str], dict[str, str]]:
        """The command line and environment of the model's llama-server, its control file made and its share
        counted (in a thread: it parses the model's header)."""
        from ..runtime import runner
        from ..runtime.cache_control import store_sizes, warm_decodes_fast
        from ..runtime.config import CONTROL_ENV
        from ..runtime.controller import runtime_environment
        from ..runtime.supervise import ControlFile

        s, package = self.settings, child.package
        path = str(package.model_path)
        env = runner.environment(s.cache or package.cache_mode)
        # an API key of its own (in the environment, not on its command line): a web page that finds the process's
        # port on the loopback cannot use it, and must come through the server's origin check
        env["LLAMA_API_KEY"] = child.token
        env.update(runtime_environment(path, budget=share, policy=s.policy, hot_share=s.hot_share,
                                       sm_share=s.sm_share, is_zipmoe=zipmoe))
        sizes, warm_fast = ([], False)
        if zipmoe:
            child.control = ControlFile.create()
            env[CONTROL_ENV] = str(child.control.path)
            sizes, warm_fast = store_sizes(path), warm_decodes_fast(path)
        child.port = free_port()
        argv = [str(runner.program("llama-server")), "-m", path, "--host", "127.0.0.1", "--port", str(child.port),
                *_without(package.llama_program_args("llama-server"), "-c"), "-np", str(s.parallel),
                "-c", str(child.num_ctx * s.parallel), "--alias", child.name]  # each slot: the whole num_ctx
        if s.threads is not None:
            argv += ["-t", str(s.threads)]
        if child.embeddings:
            argv += ["--embeddings", *_pooling(path, s.llama_args)]
        argv += list(s.llama_args)
        child.log = self._log_dir / f"{child.name.replace('/', '_')}.{child.port}.log"
        self.budget.add(tenant, share, control=child.control, sizes=sizes, warm_fast=warm_fast,
                        other_bytes=other_bytes)
        return argv, env

    def _start(self, child: Child, argv: list[str], env: dict[str, str]) -> None:
        """Starts the process from the event loop's thread, which lives as long as the server: the process is
        killed when that thread ends (PR_SET_PDEATHSIG), so a server killed outright leaves no model running."""
        assert child.log is not None
        with open(child.log, "wb") as log:
            child.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=die_with_parent())

    async def _wait_ready(self, child: Child) -> None:
        deadline = time.monotonic() + self.settings.load_timeout
        while True:
            assert child.proc is not None
            if child.proc.poll() is not None:
                why = last_error_line(child.log)
                raise ApiError(500, f"{child.name} failed to load (exit status {child.proc.returncode})"
                                    + (f": {why}" if why else ""))
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with self.http.get(f"{child.url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise ApiError(503, f"timed out waiting for {child.name} to load")
            await asyncio.sleep(0.05)

    async def _unload(self, child: Child) -> None:
        if self.children.get(child.key) is child:
            del self.children[child.key]
        self.budget.remove(child.key)
        await asyncio.to_thread(self._kill, child)

    @staticmethod
    def _kill(child: Child) -> None:
        from ..runtime.runner import stop_group

        if child.proc is not None and child.proc.returncode is None:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                stop_group(child.proc, STOP_GRACE)
        if child.control is not None:
            child.control.close()
            child.control = None

    # -- what /api/ps and `zipmoe ps` show

    def running(self) -> list[dict[str, Any]]:
        out = []
        for c in self.children.values():
            out.append({"key": c.key, "name": c.name, "package": c.package, "num_ctx": c.num_ctx,
                        "expires": c.expires, "share": self.budget.share(c.key),
                        "resident": self.budget.resident(c.key), "active": c.active, "pid": c.proc.pid if c.proc
                        else None})
        return out


__all__ = ["Child", "Models", "Settings", "free_port"]
