"""The local model store: models addressed by name, laid out like Ollama's, holding zipmoe GGUFs.

    $ZIPMOE_MODELS (default ~/.zipmoe/models)
      manifests/<host>/<namespace>/<model>/<tag>    schemaVersion 2 manifest JSON: a config blob and layers
      blobs/sha256-<hex>                            content-addressed: identical blobs are stored once
      .state/lock                                   flock'ed by every change to manifests or blobs
      .state/tmp/job-*                              work in progress of create/import (private per job)
      .state/verified/sha256-<hex>                  "this blob was hashed and matched while its stat was X"
      .state/sources/<sha256 of a path>             "the FROM file at this path had sha256 Y while its stat was X"

A model is a zipmoe GGUF layer (application/vnd.zipmoe.model) plus optional parameters, template, system prompt,
licenses and messages. The media types are zipmoe's own: Ollama reserves application/vnd.ollama.image.*, and its
runner could not read a zipmoe GGUF anyway.

Consistency without a database:
* a blob is written into the job's private directory (hashed while written, fsynced), and only renamed into
  blobs/ under the store lock, immediately before the manifest that references it is written; the manifest is
  written last, to a temporary file renamed over its name. A create killed at any point leaves either the old
  manifest or the new one, and every manifest points at blobs that exist; what it left behind (a job directory,
  unreferenced blobs) is removed by `prune`;
* `prune` and `rm` delete blobs under the same lock, so they never remove a blob that a create is committing;
  a create re-checks, under the lock, that every blob it reuses is still there;
* readers (list, show, run) take no lock: manifests change by atomic rename and blobs never change.

Blobs are checked before use: the small ones (config, parameters, template...) are hashed on every read. The model
blob can be many gigabytes, so its sha256 is recomputed only when its stat (size, mtime, ctime, inode) differs
from the one recorded when it was last hashed: any write to the file changes its ctime. `full_check=True` (and
`zipmoe show --verify`) hashes it regardless, for silent media errors. (The expert chunks carry their own checksums,
which the runtime verifies on every decode.)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import inspect
import io
import json
import math
import os
import re
import secrets
import shutil
import tarfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from . import modelfile as mfile
from ..errors import ChecksumError, ZipmoeError
from .modelfile import Message, Modelfile
from ..progress import Progress, Silent

ENV_MODELS = "ZIPMOE_MODELS"
DEFAULT_HOST = "zipmoe.local"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"

MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"  # what Ollama's manifests say too
MEDIA_CONFIG = "application/vnd.zipmoe.config.v1+json"
MEDIA_MODEL = "application/vnd.zipmoe.model"
MEDIA_PARAMS = "application/vnd.zipmoe.params"
MEDIA_TEMPLATE = "application/vnd.zipmoe.template"
MEDIA_SYSTEM = "application/vnd.zipmoe.system"
MEDIA_LICENSE = "application/vnd.zipmoe.license"
MEDIA_MESSAGES = "application/vnd.zipmoe.messages"
LAYER_TYPES = (MEDIA_MODEL, MEDIA_PARAMS, MEDIA_TEMPLATE, MEDIA_SYSTEM, MEDIA_LICENSE, MEDIA_MESSAGES)
OLLAMA_MEDIA_PREFIX = "application/vnd.ollama.image."

BLOCK = 8 << 20  # bytes per read/write when hashing and copying
SMALL_BLOB_MAX = 64 << 20  # config, parameters, template...: read whole; a larger one is not ours


class StoreError(ZipmoeError):
    """The store cannot do what was asked (exit status 2)."""


class ModelNotFoundError(StoreError):
    """No model of that name (exit status 1, so that scripts can tell "absent" from "broken")."""

    exit_code = 1


class InvalidNameError(StoreError):
    """Not a model name by Ollama's rules."""


class BlobError(ChecksumError):
    """A blob is missing or does not match its sha256: the message names the model and the blob."""


# ------------------------------------------------------------------------------------------ names


_HOST = re.compile(r"[a-z0-9][a-z0-9._-]{0,349}(?::[0-9]{1,5})?")
_NAMESPACE = re.compile(r"[a-z0-9][a-z0-9_-]{0,79}")
_MODEL = re.compile(r"[a-z0-9][a-z0-9_.-]{0,79}")
_TAG = re.compile(r"[a-z0-9_][a-z0-9_.-]{0,79}")
_RULES = {
    "host": (_HOST, ("a host is letters, digits, '.', '_' or '-' (at most 350), starting with a letter or digit, "
                     "with an optional :port")),
    "namespace": (_NAMESPACE, "a namespace is 1-80 letters, digits, '_' or '-', starting with a letter or digit"),
    "model": (_MODEL, "a model name is 1-80 letters, digits, '_', '.' or '-', starting with a letter or digit"),
    "tag": (_TAG, "a tag is 1-80 letters, digits, '_', '.' or '-', not starting with '.' or '-'"),
}
NAME_HELP = "[HOST/][NAMESPACE/]MODEL[:TAG], e.g. mymodel, mymodel:v2, me/mymodel:latest"


@dataclass(frozen=True, order=True)
class ModelName:
    """host/namespace/model:tag, as Ollama spells model names; lower case (names are case-insensitive)."""

    host: str
    namespace: str
    model: str
    tag: str

    @classmethod
    def parse(cls, text: str) -> ModelName:
        """`model`, `ns/model`, `host/ns/model`, each with an optional `:tag` (default: latest)."""
        raw = str(text).strip()
        bad = f"invalid model name {raw!r}: expected {NAME_HELP}"
        if "@" in raw:
            raise InvalidNameError(f"{bad} (digest references are not supported)")
        rest, tag = raw, DEFAULT_TAG
        colon = raw.rfind(":")
        if colon > raw.rfind("/"):
            rest, tag = raw[:colon], raw[colon + 1:]
        parts = rest.split("/")
        if len(parts) > 3 or not all(parts):
            raise InvalidNameError(bad)
        host, namespace = DEFAULT_HOST, DEFAULT_NAMESPACE
        if len(parts) == 3:
            host, namespace, model = parts
        elif len(parts) == 2:
            namespace, model = parts
        else:
            model = parts[0]
        return cls.of(host, namespace, model, tag, shown=raw)

    @classmethod
    def of(cls, host: str, namespace: str, model: str, tag: str, shown: str | None = None) -> ModelName:
        values = {"host": host.lower(), "namespace": namespace.lower(), "model": model.lower(), "tag": tag.lower()}
        for part, value in values.items():
            pattern, rule = _RULES[part]
            if not pattern.fullmatch(value):
                raise InvalidNameError(f"invalid model name {shown or f'{host}/{namespace}/{model}:{tag}'!r}: {rule}")
        return cls(**values)

    def __str__(self) -> str:
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"

    @property
    def display(self) -> str:
        """The short form people type: defaults left out, as `ollama list` shows names."""
        if self.host != DEFAULT_HOST:
            return str(self)
        if self.namespace != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.model}:{self.tag}"

    @property
    def parts(self) -> tuple[str, str, str, str]:
        return self.host, self.namespace, self.model, self.tag


def _as_name(name: str | ModelName) -> ModelName:
    return name if isinstance(name, ModelName) else ModelName.parse(name)


# ------------------------------------------------------------------------------------------ manifests


_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")


def digest_hex(digest: str) -> str:
    m = _DIGEST.fullmatch(digest)
    if m is None:
        raise StoreError(f"{digest!r} is not a sha256 digest")
    return m.group(1)


@dataclass(frozen=True)
class Layer:
    media_type: str
    digest: str  # sha256:<hex>
    size: int

    @property
    def hex(self) -> str:
        return digest_hex(self.digest)

    def to_json(self) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


@dataclass(frozen=True)
class Manifest:
    config: Layer
    layers: tuple[Layer, ...]

    def to_bytes(self) -> bytes:
        return json.dumps({"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE, "config": self.config.to_json(),
                           "layers": [x.to_json() for x in self.layers]}, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, label: str) -> Manifest:
        try:
            obj = json.loads(data)
            if obj.get("schemaVersion") != 2:
                raise ValueError(f"schemaVersion is {obj.get('schemaVersion')!r}, not 2")
            config = _layer(obj["config"])
            layers = tuple(_layer(x) for x in obj["layers"])
        except (ValueError, KeyError, TypeError, AttributeError, StoreError) as e:
            raise StoreError(f"{label}: not a valid manifest ({e})") from None
        for x in layers:
            if x.media_type.startswith(OLLAMA_MEDIA_PREFIX):
                raise StoreError(f"{label}: an Ollama model ({x.media_type}), not a zipmoe one; Ollama's runner "
                                 "and zipmoe's cannot read each other's models")
            if x.media_type not in LAYER_TYPES:
                raise StoreError(f"{label}: unknown layer type {x.media_type} (made by a newer zipmoe?)")
        if config.media_type != MEDIA_CONFIG:
            raise StoreError(f"{label}: unknown config type {config.media_type}")
        if sum(x.media_type == MEDIA_MODEL for x in layers) != 1:
            raise StoreError(f"{label}: a zipmoe manifest has exactly one {MEDIA_MODEL} layer")
        return cls(config, layers)

    @property
    def model(self) -> Layer:
        return next(x for x in self.layers if x.media_type == MEDIA_MODEL)

    def of_type(self, media_type: str) -> list[Layer]:
        return [x for x in self.layers if x.media_type == media_type]

    @property
    def blobs(self) -> list[Layer]:
        return [self.config, *self.layers]

    @property
    def size(self) -> int:
        return sum(x.size for x in self.blobs)


def _layer(obj: Mapping[str, Any]) -> Layer:
    digest_hex(obj["digest"])
    size = obj["size"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"bad size {size!r}")
    if not isinstance(obj["mediaType"], str):
        raise TypeError("bad mediaType")
    return Layer(obj["mediaType"], obj["digest"], size)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------------------ packages


@dataclass(frozen=True)
class ModelPackage:
    """A stored model, its blobs checked: the zipmoe GGUF and what the Modelfile said about running it."""

    name: ModelName
    digest: str  # sha256 of the manifest; its first 12 hex digits are the model's ID
    manifest: Manifest
    model_path: Path
    config: Mapping[str, Any]
    parameters: Mapping[str, Any] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    license: tuple[str, ...] = ()
    messages: tuple[Message, ...] = ()
    template_path: Path | None = None  # the blob holding the template text, for --chat-template-file
    system_path: Path | None = None  # the blob holding the system prompt, for -sysf
    modified: float = 0.0

    @property
    def id(self) -> str:
        return self.digest[:12]

    def modelfile(self) -> Modelfile:
        return Modelfile(str(self.model_path), dict(self.parameters), self.template, self.system, self.license,
                         self.messages)

    def modelfile_text(self) -> str:
        """What `zipmoe show --modelfile` prints: a Modelfile that creates this model again."""
        return mfile.render(self.modelfile(), header=(
            'Modelfile generated by "zipmoe show"',
            "To build a new Modelfile based on this one, replace FROM with:",
            f"FROM {self.name.display}"))

    # -- how to run it

    def llama_kwargs(self) -> dict[str, Any]:
        """Constructor arguments of pyzipmoe.Llama (llama_cpp.Llama's plus zipmoe_*) from the parameters."""
        p, out = self.parameters, {}
        if "num_ctx" in p:
            out["n_ctx"] = p["num_ctx"]
        if "num_batch" in p:
            out["n_batch"] = p["num_batch"]
        if "num_thread" in p:
            out["n_threads"] = out["n_threads_batch"] = p["num_thread"]
        if "repeat_last_n" in p and p["repeat_last_n"] >= 0:
            out["last_n_tokens_size"] = p["repeat_last_n"]
        if "seed" in p and p["seed"] >= 0:
            out["seed"] = p["seed"]
        if self.cache_mode is not None:
            out["zipmoe_cache"] = self.cache_mode
        if "memory_budget" in p:
            out["zipmoe_memory_budget"] = p["memory_budget"]
        return out

    def sampling_kwargs(self) -> dict[str, Any]:
        """Defaults for Llama.create_completion / create_chat_completion (a caller's own arguments win)."""
        p, out = self.parameters, {}
        for name in ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "presence_penalty",
                     "frequency_penalty"):
            if name in p:
                out[name] = p[name]
        if "stop" in p:
            out["stop"] = list(p["stop"])
        if "seed" in p and p["seed"] >= 0:
            out["seed"] = p["seed"]  # each call starts from the seed: a prompt gives the same text, as in Ollama
        if "num_predict" in p:
            out["max_tokens"] = None if p["num_predict"] < 0 else p["num_predict"]
        return out

    def chat_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """`messages` with the package's system prompt and MESSAGE history; see `chat_messages`."""
        return chat_messages(self.system, self.messages, messages)

    def llama_program_args(self, program: str) -> list[str]:
        """Flags for zipmoe's llama.cpp programs (llama-cli, llama-server, llama-completion) that apply the
        parameters, template and system prompt; pass them before the user's own flags, which then win.

        llama-server has no flag for a system prompt, stop strings or messages: there they are the client's
        (`environment()` gives ZIPMOE_CACHE for cache_policy)."""
        p, out = self.parameters, []
        flags = {"num_ctx": "-c", "num_batch": "-b", "num_thread": "-t", "seed": "-s", "num_predict": "-n",
                 "temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
                 "typical_p": "--typical", "repeat_penalty": "--repeat-penalty", "repeat_last_n": "--repeat-last-n",
                 "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty"}
        for name, flag in flags.items():
            if name in p:
                out += [flag, mfile.format_parameter(p[name], name)]
        if self.template_path is not None and self.template:
            out += ["--jinja", "--chat-template-file", str(self.template_path)]
        if program != "llama-server":
            for stop in p.get("stop", []):
                out += ["-r", stop]
            if self.system_path is not None and self.system:
                out += ["-sysf", str(self.system_path)]
        return out

    @property
    def cache_mode(self) -> str | None:
        """The package's cache mode (one of pyzipmoe.runtime.config.CACHE_MODES), if its Modelfile set one."""
        return self.parameters.get(mfile.CACHE_MODE_PARAMETER)

    def environment(self) -> dict[str, str]:
        """Environment variables for the zipmoe runtime in a llama.cpp program."""
        from ..runtime.config import RuntimeConfig

        return RuntimeConfig(cache=self.cache_mode).to_env()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name.display, "full_name": str(self.name), "id": self.id,
                "digest": f"sha256:{self.digest}",
                "model_path": str(self.model_path), "size": self.manifest.size, "modified": _iso(self.modified),
                "config": dict(self.config), "parameters": dict(self.parameters), "template": self.template,
                "system": self.system, "license": list(self.license),
                "messages": [m.to_dict() for m in self.messages],
                "layers": [x.to_json() for x in self.manifest.layers]}


def chat_messages(system: str | None, history: Sequence[Message],
                  messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """A conversation as the package runs it, the way Ollama does: the caller's system message if it has one,
    else the package's SYSTEM; then the package's MESSAGE history; then the caller's messages."""
    messages = list(messages)
    lead = 0
    while lead < len(messages) and messages[lead].get("role") == "system":
        lead += 1
    head = messages[:lead] or ([{"role": "system", "content": system}] if system else [])
    return [*head, *(m.to_dict() for m in history), *messages[lead:]]


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))


@dataclass(frozen=True)
class ModelEntry:
    """A line of `zipmoe list`: from the manifest alone (no blob is read)."""

    name: ModelName
    digest: str
    size: int
    modified: float
    problem: str | None = None  # why the manifest is unusable

    @property
    def id(self) -> str:
        return self.digest[:12]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name.display, "full_name": str(self.name), "id": self.id,
                "digest": f"sha256:{self.digest}", "size": self.size, "modified": _iso(self.modified),
                "problem": self.problem}


@dataclass(frozen=True)
class CreateReport:
    name: str
    id: str
    digest: str
    model_digest: str
    model_size: int
    source: str  # the FROM: a file or a stored model
    source_size: int
    converted: bool  # a BF16 source was converted by this create
    model_reused: bool  # the model blob was already in the store: nothing new was written for it
    new_blobs: int
    new_bytes: int
    seconds: float
    convert: dict[str, Any] | None = None  # ConvertReport.to_dict() when converted

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PruneReport:
    blobs: tuple[str, ...]  # removed, as sha256-<hex>
    bytes: int
    jobs: int  # leftover directories of interrupted creates/imports
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "blobs": list(self.blobs)}


@dataclass(frozen=True)
class TransferReport:
    """export/import: which models, how many bytes."""

    names: tuple[str, ...]
    path: str
    bytes: int
    new_blobs: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "names": list(self.names)}


# ------------------------------------------------------------------------------------------ file helpers


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_file(path: Path, progress: Progress, label: str) -> tuple[str, int]:
    sha, size = hashlib.sha256(), 0
    progress.start(label, path.stat().st_size)
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(BLOCK):
            sha.update(chunk)
            size += len(chunk)
            progress.advance(len(chunk))
    return sha.hexdigest(), size


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


@contextlib.contextmanager
def _atomic_file(dst: Path) -> Iterator[BinaryIO]:
    """A new file that appears as dst (replacing it) only when the block completes."""
    tmp = dst.with_name(f".{dst.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with open(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst)
        _fsync_dir(dst.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class _Job:
    """A create or import at work: a private directory under .state/tmp for blobs not yet in the store.

    It holds a flock on its lock file for its lifetime; `prune` removes job directories whose lock it can take
    (their process is gone, e.g. killed)."""

    def __init__(self, store: Store):
        self.store = store
        self.staged: dict[str, Path] = {}  # hex -> file in self.dir
        with store._locked():  # so that prune never sees the lock file before it is held
            token = secrets.token_hex(8)
            self.lock_path = store.tmp_dir / f"job-{token}.lock"
            self.dir = store.tmp_dir / f"job-{token}"
            self._lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
                self.dir.mkdir()
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.lock_path.unlink(missing_ok=True)
        os.close(self._lock_fd)

    def __enter__(self) -> _Job:  # noqa: PYI034 (a final class)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def path(self, name: str) -> Path:
        return self.dir / name

    def stage_chunks(self, chunks: Iterable[bytes | memoryview], progress: Progress | None = None) -> Layer:
        """Writes chunks to a new file of the job, hashing them on the way; returns (media-less) digest and size."""
        sha, size = hashlib.sha256(), 0
        tmp = self.dir / f"blob-{secrets.token_hex(6)}"
        with open(tmp, "xb") as f:
            for chunk in chunks:
                sha.update(chunk)
                f.write(chunk)
                size += len(chunk)
                if progress is not None:
                    progress.advance(len(chunk))
            f.flush()
            os.fsync(f.fileno())
        return self._keep(tmp, sha.hexdigest(), size)

    def stage_bytes(self, data: bytes, media_type: str) -> Layer:
        layer = self.stage_chunks([data])
        return Layer(media_type, layer.digest, layer.size)

    def adopt(self, path: Path, hex_: str, size: int) -> None:
        """A file written into the job directory by someone else (convert), already hashed."""
        self._keep(path, hex_, size)

    def _keep(self, tmp: Path, hex_: str, size: int) -> Layer:
        if hex_ in self.staged:
            tmp.unlink()
        else:
            self.staged[hex_] = tmp
        return Layer("", f"sha256:{hex_}", size)


def _read_chunks(f: BinaryIO, size: int | None = None) -> Iterator[bytes]:
    left = size
    while left is None or left > 0:
        chunk = f.read(BLOCK if left is None else min(BLOCK, left))
        if not chunk:
            if left:
                raise StoreError("the input ended early")
            return
        if left is not None:
            left -= len(chunk)
        yield chunk


# ------------------------------------------------------------------------------------------ the store


def default_root() -> Path:
    env = os.environ.get(ENV_MODELS)
    return Path(env).expanduser() if env else Path.home() / ".zipmoe" / "models"


_FIX = ("`zipmoe create` or `zipmoe import` {model} again to replace it (or `zipmoe rm {model}`)")


class Store:
    """A model store directory; every method is safe to call from several threads and processes at once."""

    def __init__(self, root: str | os.PathLike[str] | None = None):
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.blobs_dir = self.root / "blobs"
        self.manifests_dir = self.root / "manifests"
        self.state_dir = self.root / ".state"
        self.tmp_dir = self.state_dir / "tmp"
        self.verified_dir = self.state_dir / "verified"

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    # -- paths and locking

    def blob_path(self, digest_or_hex: str) -> Path:
        hex_ = digest_hex(digest_or_hex) if digest_or_hex.startswith("sha256:") else digest_or_hex
        return self.blobs_dir / f"sha256-{hex_}"

    def manifest_path(self, name: ModelName) -> Path:
        return self.manifests_dir.joinpath(*name.parts)

    def _ensure(self) -> None:
        for d in (self.blobs_dir, self.manifests_dir, self.tmp_dir, self.verified_dir):
            d.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The store lock: held by every change to manifests and blobs/. flock (not POSIX record locks): each call
        opens the file anew, so threads of one process exclude each other as processes do."""
        self._ensure()
        fd = os.open(self.state_dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    # -- blob checks

    def _stamp(self, hex_: str) -> None:
        """Records that blob hex_ was hashed and matched while its stat was what it is now."""
        path = self.blob_path(hex_)
        with _atomic_file(self.verified_dir / path.name) as f:
            f.write(json.dumps(_stat_key(path)).encode())

    def _stamped(self, hex_: str) -> bool:
        try:
            return json.loads((self.verified_dir / f"sha256-{hex_}").read_bytes()) == _stat_key(self.blob_path(hex_))
        except (OSError, ValueError):
            return False

    def check_blob(self, layer: Layer, *, model: str, what: str, full: bool = False,
                   progress: Progress | None = None) -> Path:
        """The path of a blob that exists, has the manifest's size and (see the module's notes) its sha256."""
        path = self.blob_path(layer.digest)
        hex_ = layer.hex
        fix = _FIX.format(model=model)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise BlobError(f"model {model}: its {what} blob {path.name} is missing from {self.blobs_dir}; "
                            f"the store was damaged: {fix}") from None
        if size != layer.size:
            raise BlobError(f"model {model}: its {what} blob {path} is damaged: {size} bytes, the manifest says "
                            f"{layer.size}; {fix}")
        if not full and self._stamped(hex_):
            return path
        got, _ = _hash_file(path, progress or Silent(), f"verify {what}")
        if got != hex_:
            raise BlobError(f"model {model}: its {what} blob {path} is damaged: its sha256 is {got[:16]}..., not "
                            f"{hex_[:16]}...; {fix}")
        with contextlib.suppress(OSError):  # a read-only store still works, it just hashes again next time
            self._stamp(hex_)
        return path

    def _intact(self, hex_: str, size: int) -> bool:
        try:
            self.check_blob(Layer("", f"sha256:{hex_}", size), model="?", what="a")
        except BlobError:
            return False
        return True

    def _read_small(self, layer: Layer, model: str, what: str) -> bytes:
        """A small blob, read whole and hashed on every read."""
        path = self.blob_path(layer.digest)
        if layer.size > SMALL_BLOB_MAX:
            raise BlobError(f"model {model}: its {what} blob {path.name} is {layer.size} bytes, too large for a "
                            f"{what}")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise BlobError(f"model {model}: its {what} blob {path.name} is missing from {self.blobs_dir}; the store "
                            f"was damaged: {_FIX.format(model=model)}") from None
        if _sha(data) != layer.hex:
            raise BlobError(f"model {model}: its {what} blob {path} is damaged (its sha256 does not match); "
                            f"{_FIX.format(model=model)}")
        return data

    # -- reading

    def _read_manifest(self, name: ModelName) -> tuple[Manifest, str, float]:
        path = self.manifest_path(name)
        try:
            data = path.read_bytes()
            mtime = path.stat().st_mtime
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ModelNotFoundError(f"model {name.display!r} not found in {self.root} "
                                     "(`zipmoe list` shows the models)") from None
        return Manifest.from_bytes(data, f"model {name.display} ({path})"), _sha(data), mtime

    def exists(self, name: str | ModelName) -> bool:
        return self.manifest_path(_as_name(name)).is_file()

    def _manifest_files(self) -> Iterator[tuple[tuple[str, ...], Path]]:
        """(host, namespace, model, tag) and path of every manifest file; temporary files (".*") are skipped."""
        def dirs(p: Path) -> list[Path]:
            try:
                return sorted(e for e in p.iterdir() if not e.name.startswith("."))
            except (FileNotFoundError, NotADirectoryError):
                return []

        for host in dirs(self.manifests_dir):
            for ns in dirs(host):
                for model in dirs(ns):
                    for tag in dirs(model):
                        if tag.is_file():
                            yield (host.name, ns.name, model.name, tag.name), tag

    def list_models(self) -> list[ModelEntry]:
        """Every model, most recently changed first; a broken manifest is listed with its problem."""
        out = []
        for parts, path in self._manifest_files():
            try:
                name = ModelName.of(*parts)
                if name.parts != parts:
                    raise InvalidNameError("not lower case")
            except InvalidNameError as e:
                name, problem = ModelName(*parts), f"not a valid model name ({e})"
                out.append(ModelEntry(name, "", 0, path.stat().st_mtime, problem))
                continue
            try:
                data = path.read_bytes()
                manifest = Manifest.from_bytes(data, str(path))
                out.append(ModelEntry(name, _sha(data), manifest.size, path.stat().st_mtime))
            except (OSError, StoreError) as e:
                out.append(ModelEntry(name, "", 0, 0.0, str(e)))
        return sorted(out, key=lambda e: (-e.modified, e.name))

    def open(self, name: str | ModelName, *, full_check: bool = False,
             progress: Progress | None = None) -> ModelPackage:
        """The model `name`, every blob checked (see the module's notes on the model blob)."""
        name = _as_name(name)
        manifest, digest, mtime = self._read_manifest(name)
        parts = self._parts(manifest, lambda layer, what: self._read_small(layer, name.display, what))
        model_path = self.check_blob(manifest.model, model=name.display, what="model", full=full_check,
                                     progress=progress)
        first = {t: (manifest.of_type(t) or [None])[0] for t in (MEDIA_TEMPLATE, MEDIA_SYSTEM)}
        return ModelPackage(
            name, digest, manifest, model_path, parts["config"], parts["parameters"], parts["template"],
            parts["system"], parts["license"], parts["messages"],
            self.blob_path(first[MEDIA_TEMPLATE].digest) if first[MEDIA_TEMPLATE] else None,
            self.blob_path(first[MEDIA_SYSTEM].digest) if first[MEDIA_SYSTEM] else None, mtime)

    @staticmethod
    def _parts(manifest: Manifest, read: Callable[[Layer, str], bytes]) -> dict[str, Any]:
        """Decodes the small blobs of a manifest (read(layer, what) gives a blob's checked bytes)."""
        def text(layer: Layer, what: str) -> str:
            try:
                return read(layer, what).decode("utf-8")
            except UnicodeDecodeError:
                raise StoreError(f"the {what} blob {layer.digest} is not UTF-8 text") from None

        def as_json(layer: Layer, what: str) -> Any:
            try:
                return json.loads(read(layer, what))
            except ValueError:
                raise StoreError(f"the {what} blob {layer.digest} is not JSON") from None

        config = as_json(manifest.config, "config")
        if not isinstance(config, dict):
            raise StoreError(f"the config blob {manifest.config.digest} is not a JSON object")
        params: dict[str, Any] = {}
        for layer in manifest.of_type(MEDIA_PARAMS):
            obj = as_json(layer, "parameters")
            if not isinstance(obj, dict):
                raise StoreError(f"the parameters blob {layer.digest} is not a JSON object")
            params.update(mfile.check_parameters(obj, f"the parameters blob {layer.digest}"))
        messages = []
        for layer in manifest.of_type(MEDIA_MESSAGES):
            obj = as_json(layer, "messages")
            if not (isinstance(obj, list) and all(_is_message(m) for m in obj)):
                raise StoreError(f"the messages blob {layer.digest} is not a list of messages")
            messages += [Message(m["role"], m["content"]) for m in obj]
        singles = {t: [text(x, t.rsplit(".", 1)[1]) for x in manifest.of_type(t)] for t in (MEDIA_TEMPLATE,
                                                                                            MEDIA_SYSTEM)}
        return {"config": config, "parameters": params, "messages": tuple(messages),
                "template": (singles[MEDIA_TEMPLATE] or [None])[0], "system": (singles[MEDIA_SYSTEM] or [None])[0],
                "license": tuple(text(x, "license") for x in manifest.of_type(MEDIA_LICENSE))}

    def referenced(self) -> set[str]:
        """Hex digests of every blob some manifest references; refuses to guess past an unreadable manifest."""
        out: set[str] = set()
        for _, path in self._manifest_files():
            try:
                manifest = Manifest.from_bytes(path.read_bytes(), str(path))
            except (OSError, StoreError) as e:
                raise StoreError(f"{e}; cannot tell which blobs it uses: repair or delete that manifest file "
                                 "first") from None
            out |= {x.hex for x in manifest.blobs}
        return out

    # -- committing

    def _commit(self, name: ModelName, manifest: Manifest, job: _Job | None) -> tuple[str, int, int]:
        """Moves the job's blobs into the store and writes the manifest last, all under the store lock.
        Returns the manifest's digest and how many blobs (and bytes) were new."""
        new = new_bytes = 0
        data = manifest.to_bytes()
        with self._locked():
            placed = []
            for layer in manifest.blobs:
                target = self.blob_path(layer.digest)
                staged = job.staged.get(layer.hex) if job is not None else None
                if staged is not None and staged.exists():
                    # identical blobs are stored once; an existing one that is damaged is replaced
                    if target.exists() and self._intact(layer.hex, layer.size):
                        continue
                    os.replace(staged, target)
                    placed.append(layer.hex)
                    new, new_bytes = new + 1, new_bytes + layer.size
                elif not target.exists():
                    raise StoreError(f"blob {target.name} of {name.display} disappeared while it was being created "
                                     "(did `zipmoe rm` or `zipmoe prune` run at the same time?); run the command again")
            if placed:
                _fsync_dir(self.blobs_dir)  # the blobs are durable before the manifest that points at them
                for hex_ in placed:
                    with contextlib.suppress(OSError):
                        self._stamp(hex_)
            path = self.manifest_path(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            with _atomic_file(path) as f:
                f.write(data)
        return _sha(data), new, new_bytes

    # -- create

    def create(self, name: str | ModelName, modelfile: Modelfile | str, *, base_dir: str | os.PathLike[str] = ".",
               codec: str = "auto", level: int | None = None, chunk_n: int | None = None, threads: int | None = None,
               progress: Progress | None = None) -> CreateReport:
        """Creates (or replaces) model `name` from a Modelfile (text or parsed). FROM is a BF16 MoE GGUF (converted
        with codec/level/chunk_n, once: a later create from the same file reuses the result), a zipmoe GGUF, or a
        stored model (whose layers are inherited; the Modelfile's directives replace them)."""
        from ..file import codec as zcodec

        t0 = time.monotonic()
        name = _as_name(name)
        settings = _codec_settings(zcodec, codec, level, chunk_n)  # bad options fail before any work
        mf = mfile.parse(modelfile) if isinstance(modelfile, str) else modelfile
        progress = progress or Silent()
        base_dir = Path(base_dir)
        self._ensure()
        try:
            with _Job(self) as job:
                base, source = None, self._from_file(mf, base_dir)
                if not source.exists():
                    base = self._from_model(mf, source)
                    model, config, info = base.manifest.model, base.manifest.config, {
                        "source": base.name.display, "source_size": base.manifest.model.size, "converted": False,
                        "model_reused": True, "convert": None}
                else:
                    model, info = self._model_blob(job, source, settings, threads, progress)
                    model_path = job.staged.get(model.hex) or self.blob_path(model.digest)
                    config = job.stage_bytes(self._config_bytes(model_path, model.size), MEDIA_CONFIG)
                layers = [model, *self._package_layers(job, mf, base)]
                manifest = Manifest(Layer(MEDIA_CONFIG, config.digest, config.size), tuple(layers))
                digest, new, new_bytes = self._commit(name, manifest, job)
        finally:
            progress.close()
        return CreateReport(name.display, digest[:12], f"sha256:{digest}", model.digest, model.size, info["source"],
                            info["source_size"], info["converted"], info["model_reused"], new, new_bytes,
                            time.monotonic() - t0, info["convert"])

    @staticmethod
    def _from_file(mf: Modelfile, base_dir: Path) -> Path:
        """Where FROM would be as a file: relative to the Modelfile's directory, ~ expanded (as Ollama does)."""
        path = Path(os.path.expanduser(mf.from_))
        if not path.is_absolute():
            path = base_dir / path
        if path.is_dir():
            raise mf.error(f"FROM {mf.from_}: {path} is a directory; FROM takes a GGUF file or a model name")
        return path

    def _from_model(self, mf: Modelfile, looked_at: Path) -> ModelPackage:
        try:
            name = ModelName.parse(mf.from_)
        except InvalidNameError:
            raise mf.error(f"FROM {mf.from_}: no such file ({looked_at})") from None
        try:
            return self.open(name)
        except ModelNotFoundError:
            raise mf.error(f"FROM {mf.from_}: no such file ({looked_at}), and no model {name.display!r} in "
                           f"{self.root}") from None

    def _model_blob(self, job: _Job, source: Path, settings: Mapping[str, Any], threads: int | None,
                    progress: Progress) -> tuple[Layer, dict[str, Any]]:
        """The model layer for a GGUF file: reused when the store has it, else staged (copied or converted)."""
        from ..file import codec as zcodec
        from ..file import convert
        from ..file.gguf import read_gguf

        g = read_gguf(source)
        source_hex, source_size = self._source_digest(source, progress)
        info: dict[str, Any] = {"source": str(source), "source_size": source_size, "converted": False,
                                "model_reused": True, "convert": None}
        if g.is_zipmoe:
            from ..file.reader import open_zipmoe

            open_zipmoe(source)  # refuse a damaged file before it enters the store
            if self._intact(source_hex, source_size):
                return Layer(MEDIA_MODEL, f"sha256:{source_hex}", source_size), info
            with open(source, "rb", buffering=0) as f:
                progress.start(f"copy {source.name}", source_size)
                staged = job.stage_chunks(_read_chunks(f), progress)
            if staged.hex != source_hex:
                self._source_record(source).unlink(missing_ok=True)
                raise StoreError(f"{source} changed while it was being read; run the command again")
            return Layer(MEDIA_MODEL, staged.digest, staged.size), {**info, "model_reused": False}
        found = self._find_converted(source_hex, settings)
        if found is not None:
            return found, info
        out = job.path("model.zipmoe.gguf")
        report = convert.convert(source, out, codec=settings["codec"],
                                 level=settings["codec_level"] if settings["codec"] == "zstd"
                                 else zcodec.DEFAULT_ZSTD_LEVEL,
                                 chunk_n=settings["chunk_size"], threads=threads, progress=progress)
        if report.sha256 != source_hex:
            self._source_record(source).unlink(missing_ok=True)  # hash it afresh next time
            raise StoreError(f"{source} changed while it was being converted; run the command again")
        hex_, size = _hash_file(out, progress, "hash the converted model")
        job.adopt(out, hex_, size)
        return Layer(MEDIA_MODEL, f"sha256:{hex_}", size), {**info, "converted": True, "model_reused": False,
                                                           "convert": report.to_dict()}

    def _source_digest(self, source: Path, progress: Progress) -> tuple[str, int]:
        """The sha256 and size of a FROM file. Remembered with the file's stat, so that creating from the same
        unchanged file again (say, to change the system prompt) does not read a 60 GB file again: any write to
        the file changes its ctime. The stat is taken before hashing, so a file changed meanwhile is hashed again
        next time; convert also checks the sha256 it computes itself."""
        real = source.resolve()
        record = self._source_record(real)
        stat = _stat_key(real)
        try:
            saved = json.loads(record.read_bytes())
            if saved["stat"] == stat and _DIGEST.fullmatch("sha256:" + saved["sha256"]):
                return saved["sha256"], stat[0]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        hex_, size = _hash_file(real, progress, f"hash {source.name}")
        with contextlib.suppress(OSError):
            record.parent.mkdir(exist_ok=True)
            with _atomic_file(record) as f:
                f.write(json.dumps({"path": str(real), "stat": stat, "sha256": hex_}).encode())
        return hex_, size

    def _source_record(self, path: Path) -> Path:
        return self.state_dir / "sources" / _sha(str(path.resolve()).encode())

    def _find_converted(self, source_hex: str, settings: Mapping[str, Any]) -> Layer | None:
        """A stored model blob converted from the source with sha256 source_hex with these codec settings.
        Conversion is deterministic, so it is the blob this create would write; looked up through the configs
        (which record zipmoe.source.sha256 and the codec settings), so no separate index can go stale."""
        rejected = set()  # tags of one model share its blob: a damaged one is hashed once
        for parts, path in self._manifest_files():
            try:
                manifest = Manifest.from_bytes(path.read_bytes(), str(path))
                if manifest.model.hex in rejected:
                    continue
                config = json.loads(self._read_small(manifest.config, "/".join(parts), "config"))
                z = config["zipmoe"]
                if z["source"]["sha256"] != source_hex or any(z[k] != v for k, v in settings.items()):
                    continue
            except (OSError, ValueError, KeyError, TypeError, StoreError):
                continue
            if self._intact(manifest.model.hex, manifest.model.size):
                return manifest.model
            rejected.add(manifest.model.hex)
        return None

    @staticmethod
    def _config_bytes(model_path: Path, size: int) -> bytes:
        """The config blob: what `show` and `list` tell about the model, and the conversion's provenance."""
        from ..file.reader import open_zipmoe

        zf = open_zipmoe(model_path)
        kv, meta = zf.gguf.kv, zf.meta
        arch = kv["general.architecture"].value if "general.architecture" in kv else None

        def scalar(key: str) -> Any:
            entry = kv.get(key)
            return entry.value if entry is not None and isinstance(entry.value, (int, float, str)) else None

        config = {
            "format": "gguf", "file_type": "zipmoe", "architecture": arch, "model_name": scalar("general.name"),
            "parameters": sum(math.prod(t.dims) for t in zf.source.tensors),
            "context_length": scalar(f"{arch}.context_length"), "embedding_length": scalar(f"{arch}.embedding_length"),
            "block_count": scalar(f"{arch}.block_count"), "expert_count": scalar(f"{arch}.expert_count"),
            "expert_used_count": scalar(f"{arch}.expert_used_count"), "size": size,
            "zipmoe": {"version": meta.version, "codec": meta.codec, "codec_level": meta.level,
                       "chunk_size": meta.chunk_size, "tensors": len(meta.tensors),
                       "source": {"sha256": meta.source_sha256, "size": meta.source_size}},
        }
        return json.dumps(config, indent=2).encode()

    @staticmethod
    def _package_layers(job: _Job, mf: Modelfile, base: ModelPackage | None) -> list[Layer]:
        """Template, system, licenses, messages and parameters: the Modelfile's, else the base model's."""
        template = mf.template if mf.template is not None else (base.template if base else None)
        system = mf.system if mf.system is not None else (base.system if base else None)
        licenses = mf.license or (base.license if base else ())
        messages = mf.messages or (base.messages if base else ())
        params = {**(base.parameters if base else {}), **mf.parameters}
        layers = []
        if template is not None:
            layers.append(job.stage_bytes(template.encode(), MEDIA_TEMPLATE))
        if system is not None:
            layers.append(job.stage_bytes(system.encode(), MEDIA_SYSTEM))
        layers += [job.stage_bytes(text.encode(), MEDIA_LICENSE) for text in licenses]
        if messages:
            layers.append(job.stage_bytes(json.dumps([m.to_dict() for m in messages], ensure_ascii=False).encode(),
                                          MEDIA_MESSAGES))
        if params:
            layers.append(job.stage_bytes(json.dumps(params, ensure_ascii=False).encode(), MEDIA_PARAMS))
        return layers

    # -- cp, rm, prune

    def copy(self, src: str | ModelName, dst: str | ModelName) -> ModelName:
        src, dst = _as_name(src), _as_name(dst)
        with self._locked():
            self._read_manifest(src)  # ModelNotFoundError, or a manifest that is not worth copying
            data = self.manifest_path(src).read_bytes()
            path = self.manifest_path(dst)
            path.parent.mkdir(parents=True, exist_ok=True)
            with _atomic_file(path) as f:
                f.write(data)
        return dst

    def remove(self, name: str | ModelName) -> tuple[int, int]:
        """Deletes the model and the blobs no other model uses (as `ollama rm` does); returns (blobs, bytes) freed."""
        name = _as_name(name)
        with self._locked():
            manifest, _, _ = self._read_manifest(name)
            path = self.manifest_path(name)
            path.unlink()
            self._remove_empty_dirs(path.parent)
            try:
                keep = self.referenced()
            except StoreError:
                return 0, 0  # another manifest is unreadable: leave blobs to an explicit prune
            freed = [x for x in manifest.blobs if x.hex not in keep]
            return len({x.hex for x in freed}), self._delete_blobs({x.hex for x in freed})

    def _remove_empty_dirs(self, d: Path) -> None:
        while d != self.manifests_dir and d.is_relative_to(self.manifests_dir):
            try:
                d.rmdir()
            except OSError:
                return
            d = d.parent

    def _delete_blobs(self, hexes: Iterable[str]) -> int:
        freed = 0
        for hex_ in hexes:
            path = self.blob_path(hex_)
            with contextlib.suppress(FileNotFoundError):
                freed += path.stat().st_size
                path.unlink()
            (self.verified_dir / path.name).unlink(missing_ok=True)
        return freed

    def prune(self, dry_run: bool = False) -> PruneReport:
        """Removes blobs no manifest references, leftovers of interrupted creates/imports (job directories whose
        process is gone, temporary manifest files) and stale verification records."""
        if not self.root.exists():
            return PruneReport((), 0, 0, dry_run)
        with self._locked():
            keep = self.referenced()
            blobs = sorted(p for p in self.blobs_dir.iterdir() if p.name.removeprefix("sha256-") not in keep)
            size = sum(p.stat().st_size for p in blobs if p.is_file())
            jobs = self._stale_jobs(remove=not dry_run)
            if not dry_run:
                for p in blobs:
                    if p.is_dir():
                        shutil.rmtree(p)
                    else:
                        p.unlink()
                for p in self.verified_dir.iterdir():
                    if not self.blob_path(p.name.removeprefix("sha256-")).exists():
                        p.unlink()
                for p in (self.state_dir / "sources").glob("*"):  # records of FROM files that are gone
                    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                        if not Path(json.loads(p.read_bytes())["path"]).exists():
                            p.unlink()
                for p in self.manifests_dir.rglob(".*.tmp"):
                    p.unlink()
                for d in sorted((p for p in self.manifests_dir.rglob("*") if p.is_dir()), reverse=True):
                    self._remove_empty_dirs(d)
        return PruneReport(tuple(p.name for p in blobs), size, jobs, dry_run)

    def _stale_jobs(self, remove: bool) -> int:
        """Job directories whose lock nobody holds (called under the store lock, which new jobs take to start)."""
        stale = 0
        for d in self.tmp_dir.glob("job-*"):
            if d.suffix == ".lock":
                continue
            lock = d.with_name(d.name + ".lock")
            try:
                fd = os.open(lock, os.O_RDWR)
            except FileNotFoundError:
                fd = None
            try:
                if fd is not None:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue  # a running create or import
                stale += 1
                if remove:
                    shutil.rmtree(d, ignore_errors=True)
                    lock.unlink(missing_ok=True)
            finally:
                if fd is not None:
                    os.close(fd)
        for lock in self.tmp_dir.glob("job-*.lock"):  # a lock whose directory is already gone
            if not lock.with_suffix("").exists() and remove:
                with contextlib.suppress(OSError):
                    fd = os.open(lock, os.O_RDWR)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        lock.unlink()
                    except BlockingIOError:
                        pass
                    finally:
                        os.close(fd)
        return stale

    # -- export, import

    def export(self, name: str | ModelName, dest: str | os.PathLike[str], *,
               progress: Progress | None = None) -> TransferReport:
        """Writes the model to a tar file with the store's layout (manifests/..., blobs/sha256-...). Every blob is
        hashed as it is read, so a damaged blob is never exported."""
        t0 = time.monotonic()
        name = _as_name(name)
        progress = progress or Silent()
        manifest, _, mtime = self._read_manifest(name)
        dest = Path(dest)
        if dest.is_dir():
            raise StoreError(f"{dest} is a directory; give the name of the tar file to write")
        blobs = list({x.hex: x for x in manifest.blobs}.values())
        total = sum(x.size for x in blobs)
        try:
            progress.start("export", total)
            with _atomic_file(dest) as f, tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT,
                                                       copybufsize=BLOCK) as tar:
                data = manifest.to_bytes()
                tar.addfile(_tarinfo("manifests/" + "/".join(name.parts), len(data), mtime), io.BytesIO(data))
                for layer in blobs:
                    path = self.blob_path(layer.digest)
                    if not path.is_file() or path.stat().st_size != layer.size:
                        self.check_blob(layer, model=name.display, what=_what(layer))  # says what is wrong
                    with open(path, "rb", buffering=0) as blob:
                        reader = _HashingReader(blob, progress)
                        tar.addfile(_tarinfo(f"blobs/{path.name}", layer.size, mtime), reader)
                        if reader.read(1) or reader.hexdigest() != layer.hex:
                            raise BlobError(f"model {name.display}: its {_what(layer)} blob {path} is damaged (its "
                                            f"sha256 does not match); nothing was exported")
        finally:
            progress.close()
        return TransferReport((name.display,), str(dest), dest.stat().st_size, 0, time.monotonic() - t0)

    def import_(self, src: str | os.PathLike[str], name: str | ModelName | None = None, *,
                progress: Progress | None = None) -> TransferReport:
        """Adds the model(s) of a tar file written by export (under `name` if given). Blobs are hashed as they are
        read and must match their names; manifests are written last, after all their blobs are in place."""
        t0 = time.monotonic()
        src = Path(src)
        progress = progress or Silent()
        rename = _as_name(name) if name is not None else None
        manifests: dict[ModelName, Manifest] = {}
        self._ensure()
        try:
            with _Job(self) as job, open(src, "rb") as raw:
                progress.start("import", os.fstat(raw.fileno()).st_size)
                counted = _HashingReader(raw, progress, hash_=False)
                try:
                    tar = tarfile.open(fileobj=counted, mode="r|*")  # type: ignore[call-overload]  # noqa: SIM115
                except tarfile.TarError as e:
                    raise StoreError(f"{src}: not a tar file ({e})") from None
                with tar:
                    for member in _members(tar, src):
                        self._import_member(tar, member, src, job, manifests)
                if not manifests:
                    raise StoreError(f"{src}: no model in it (no manifests/... entry); was it written by "
                                     "`zipmoe export`?")
                if rename is not None and len(manifests) > 1:
                    raise StoreError(f"{src} holds {len(manifests)} models; import it without a name")
                new = 0
                for model_name, manifest in manifests.items():
                    target = rename or model_name
                    self._check_import(manifest, job, src, target)
                    new += self._commit(target, manifest, job)[1]
        finally:
            progress.close()
        return TransferReport(tuple((rename or n).display for n in manifests), str(src), src.stat().st_size, new,
                              time.monotonic() - t0)

    def _import_member(self, tar: tarfile.TarFile, member: tarfile.TarInfo, src: Path, job: _Job,
                       manifests: dict[ModelName, Manifest]) -> None:
        parts = member.name.split("/")
        f = tar.extractfile(member)
        assert f is not None
        if parts[0] == "blobs" and len(parts) == 2 and re.fullmatch(r"sha256-[0-9a-f]{64}", parts[1]):
            staged = job.stage_chunks(_read_chunks(f, member.size))
            if staged.hex != parts[1].removeprefix("sha256-"):
                raise BlobError(f"{src}: {member.name} does not match its sha256 (got {staged.hex[:16]}...): the "
                                "archive is damaged")
        elif parts[0] == "manifests" and len(parts) == 5:
            if member.size > SMALL_BLOB_MAX:
                raise StoreError(f"{src}: {member.name} is too large for a manifest")
            try:
                model_name = ModelName.of(*parts[1:])
            except InvalidNameError as e:
                raise StoreError(f"{src}: {member.name}: {e}") from None
            manifests[model_name] = Manifest.from_bytes(f.read(), f"{src}: {member.name}")
        else:
            raise StoreError(f"{src}: unexpected entry {member.name!r}; a zipmoe export holds manifests/HOST/"
                             "NAMESPACE/MODEL/TAG and blobs/sha256-HEX only")

    def _check_import(self, manifest: Manifest, job: _Job, src: Path, name: ModelName) -> None:
        """Every blob is in the archive or the store, with the manifest's size; the package decodes; the model is
        a zipmoe GGUF."""
        def path_of(layer: Layer) -> Path:
            staged = job.staged.get(layer.hex)
            if staged is not None:
                if staged.stat().st_size != layer.size:
                    raise StoreError(f"{src}: blob {layer.digest} has {staged.stat().st_size} bytes, the manifest says "
                                     f"{layer.size}")
                return staged
            if self._intact(layer.hex, layer.size):
                return self.blob_path(layer.hex)
            raise StoreError(f"{src}: the {_what(layer)} blob {layer.digest} of {name.display} is neither in the "
                             "archive nor in the store")

        self._parts(manifest, lambda layer, what: path_of(layer).read_bytes())
        from ..file.reader import open_zipmoe

        open_zipmoe(path_of(manifest.model))


def _what(layer: Layer) -> str:
    return "config" if layer.media_type == MEDIA_CONFIG else layer.media_type.rsplit(".", 1)[-1]


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and m.get("role") in mfile.ROLES and isinstance(m.get("content"), str)


def _codec_settings(zcodec: Any, codec: str, level: int | None, chunk_n: int | None) -> dict[str, Any]:
    """The settings that decide a conversion's bytes, as the config records them (so they can be looked up)."""
    name = zcodec.DEFAULT_CODEC if codec == "auto" else codec
    if name not in zcodec.CODECS:
        raise StoreError(f"unknown codec {codec!r}; choose auto, {', '.join(zcodec.CODECS)}")
    if level is not None and name != "zstd":
        raise StoreError("a codec level applies to the zstd codec only")
    return {"codec": name, "codec_level": (zcodec.DEFAULT_ZSTD_LEVEL if level is None else level) if name == "zstd"
            else 0, "chunk_size": zcodec.DEFAULT_CHUNK_N if chunk_n is None else chunk_n}


def _tarinfo(name: str, size: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, int(mtime), 0o644
    return info


def _members(tar: tarfile.TarFile, src: Path) -> Iterator[tarfile.TarInfo]:
    """Regular files with safe relative names; directory entries are skipped; anything else is refused."""
    for member in tar:
        if member.isdir():
            continue
        parts = member.name.split("/")
        if not member.isfile() or member.name.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise StoreError(f"{src}: unexpected entry {member.name!r} (not a plain file with a relative name)")
        yield member


class _HashingReader:
    """A read-only file wrapper that hashes and counts what passes through it (for tarfile)."""

    def __init__(self, f: BinaryIO, progress: Progress, hash_: bool = True):
        self.f, self.progress = f, progress
        self.sha = hashlib.sha256() if hash_ else None

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        if self.sha is not None:
            self.sha.update(data)
        self.progress.advance(len(data))
        return data

    def hexdigest(self) -> str:
        assert self.sha is not None
        return self.sha.hexdigest()


# ------------------------------------------------------------------------------------------ using models


def resolve_model(name_or_path: str | os.PathLike[str], *, store: Store | None = None,
                  full_check: bool = False) -> tuple[Path, ModelPackage | None]:
    """For `zipmoe run/serve MODEL`: an existing file is used as is (no package); anything else is a model name
    in the store, whose checked model blob is returned with its package (parameters, template, system prompt).

    A missing file that cannot be a model name (e.g. /path/x.gguf) is a ZipmoeError (exit status 2); a valid name
    that is neither a file nor a stored model is ModelNotFoundError (exit status 1)."""
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.is_file():
        return path, None
    try:
        name = ModelName.parse(text)
    except InvalidNameError:
        if path.exists():
            raise ZipmoeError(f"{path}: not a file") from None
        raise ZipmoeError(f"{path}: no such file (nor a model name: {NAME_HELP})") from None
    store = store or Store()
    try:
        package = store.open(name, full_check=full_check)
    except ModelNotFoundError:
        raise ModelNotFoundError(f"{text}: no such file, and no model {name.display!r} in {store.root} "
                                 "(`zipmoe list` shows the models)") from None
    return package.model_path, package


def llama_from_store(name: str, *, llama_class: type | None = None, zipmoe_models: str | os.PathLike[str] | None = None,
                     full_check: bool = False, **kwargs: Any) -> Any:
    """A pyzipmoe.Llama (or `llama_class`) for the stored model `name`, with the package applied: its parameters
    become constructor arguments (num_ctx -> n_ctx, cache_policy -> zipmoe_cache, ...) and defaults of every
    completion (temperature, top_k, stop, seed...); its TEMPLATE becomes the chat handler; its SYSTEM and MESSAGE
    history are put in front of create_chat_completion's messages. Arguments given here, and to each call, win.
    The package is `llm.zipmoe_package`. (What pyzipmoe.Llama.from_store calls.)"""
    if llama_class is None:
        from ..runtime.llama import Llama  # imported on use: it loads llama_cpp and libllama

        llama_class = Llama
    package = Store(zipmoe_models).open(name, full_check=full_check)
    args = package.llama_kwargs()
    if "zipmoe_memory_budget" in args and not _accepts(llama_class, "zipmoe_memory_budget"):
        # llama_cpp.Llama swallows unknown keywords; say so rather than pretend the budget applies
        warnings.warn(f"{package.name.display}: PARAMETER memory_budget is not supported by this "
                      f"{llama_class.__name__} yet; it is ignored", RuntimeWarning, stacklevel=2)
        del args["zipmoe_memory_budget"]
    llm = llama_class(str(package.model_path), **{**args, **kwargs})
    apply_package(llm, package, chat_template=not ({"chat_format", "chat_handler"} & kwargs.keys()))
    return llm


def _accepts(cls: type, keyword: str) -> bool:
    try:
        return keyword in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False


def apply_package(llm: Any, package: ModelPackage, *, chat_template: bool = True) -> None:
    """Makes a loaded llama_cpp.Llama run as the package says (see llama_from_store). Wraps the instance's
    create_completion and create_chat_completion (only this instance; __call__ goes through them)."""
    llm.zipmoe_package = package
    if chat_template and package.template:
        from llama_cpp import llama_chat_format

        eos, bos = llm.token_eos(), llm.token_bos()
        llm.chat_handler = llama_chat_format.Jinja2ChatFormatter(
            template=package.template,
            eos_token=llm._model.token_get_text(eos) if eos != -1 else "",
            bos_token=llm._model.token_get_text(bos) if bos != -1 else "",
            stop_token_ids=[eos]).to_chat_handler()
    defaults = package.sampling_kwargs()
    complete, chat = llm.create_completion, llm.create_chat_completion
    complete_sig, chat_sig = inspect.signature(complete), inspect.signature(chat)

    def with_defaults(sig: inspect.Signature, args: tuple[Any, ...], kw: dict[str, Any]) -> dict[str, Any]:
        given = sig.bind_partial(*args, **kw).arguments
        return {**{k: v for k, v in defaults.items() if k not in given and k in sig.parameters}, **kw}

    def create_completion(*args: Any, **kw: Any) -> Any:
        return complete(*args, **with_defaults(complete_sig, args, kw))

    def create_chat_completion(*args: Any, **kw: Any) -> Any:
        bound = chat_sig.bind_partial(*args, **kw)
        bound.arguments["messages"] = package.chat_messages(bound.arguments.get("messages", []))
        return chat(*bound.args, **with_defaults(chat_sig, bound.args, dict(bound.kwargs)))

    create_completion.__doc__, create_chat_completion.__doc__ = complete.__doc__, chat.__doc__
    llm.create_completion, llm.create_chat_completion = create_completion, create_chat_completion


__all__ = ["BlobError", "CreateReport", "InvalidNameError", "Layer", "Manifest", "ModelEntry", "ModelName",
           "ModelNotFoundError", "ModelPackage", "PruneReport", "Store", "StoreError", "TransferReport",
           "apply_package", "chat_messages", "default_root", "llama_from_store", "resolve_model"]
