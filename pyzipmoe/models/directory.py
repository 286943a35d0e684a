"""The models directory: model packages addressed by name, laid out like Ollama's, holding zipmoe GGUFs.

    $ZIPMOE_MODELS (default ~/.zipmoe/models)
      manifests/<host>/<namespace>/<model>/<tag>    schemaVersion 2 manifest JSON: a config blob and layers
      blobs/sha256-<hex>                            content-addressed: identical blobs are stored once
      priors/sha256-<hex>                           the prior (pyzipmoe.plan.prior) of the model blob <hex>: its
                                                    experts' popularity in earlier runs, kept by `zipmoe calibrate`
                                                    and learned from runs under a budget
      priors/sha256-<hex>.run-<pid>-<random>        a run's record of its expert uses, until merged into the prior
      priors/sha256-<hex>.json, .lock               how many runs the prior learned from; the merge's lock
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
import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import modelfile as mfile
from ..atomic import fsync_dir
from ..errors import ZipmoeError
from ..progress import Progress, Silent
from ..runtime.completion import apply_package
from .blobs import BlobError, SMALL_BLOB_MAX, Job, _atomic_file, hash_file, stat_key
from .create import Creating
from .manifest import (
    Layer,
    MEDIA_LICENSE,
    MEDIA_MESSAGES,
    MEDIA_PARAMS,
    MEDIA_SYSTEM,
    MEDIA_TEMPLATE,
    Manifest,
    _is_message,
    sha256_digest,
    digest_hex,
)
from .modelfile import Message
from .name import InvalidNameError, ModelName, ModelNotFoundError, ModelsError, NAME_HELP, as_name
from .package import ModelEntry, ModelPackage, accepts_keyword
from .transfer import Transferring
from ..plan.prior import PRIORS_DIR


ENV_MODELS = "ZIPMOE_MODELS"


@dataclass(frozen=True)
class PruneReport:
    blobs: tuple[str, ...]  # removed, as sha256-<hex>
    bytes: int
    jobs: int  # leftover directories of interrupted creates/imports
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "blobs": list(self.blobs)}


# ------------------------------------------------------------------------------------------ the store


def default_root() -> Path:
    env = os.environ.get(ENV_MODELS)
    return Path(env).expanduser() if env else Path.home() / ".zipmoe" / "models"


_FIX = ("`zipmoe create` or `zipmoe import` {model} again to replace it (or `zipmoe rm {model}`)")


class ModelDirectory(Creating, Transferring):
    """A models directory (model packages by name); every method is safe to call from several threads and processes
    at once."""

    def __init__(self, root: str | os.PathLike[str] | None = None):
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.blobs_dir = self.root / "blobs"
        self.manifests_dir = self.root / "manifests"
        self.state_dir = self.root / ".state"
        self.tmp_dir = self.state_dir / "tmp"
        self.verified_dir = self.state_dir / "verified"
        self.priors_dir = self.root / PRIORS_DIR

    def __repr__(self) -> str:
        return f"ModelDirectory({str(self.root)!r})"

    def blob_path(self, digest_or_hex: str) -> Path:
        hex_ = digest_hex(digest_or_hex) if digest_or_hex.startswith("sha256:") else digest_or_hex
        return self.blobs_dir / f"sha256-{hex_}"

    def prior_path(self, package: ModelPackage) -> Path:
        """Where the prior of a package's model blob is kept (kept_prior finds it from the blob's path)."""
        return self.priors_dir / package.model_path.name

    def keep_prior(self, name: str | ModelName, counts: Any) -> Path:
        """Keeps counts (n_layer, n_expert) as the prior of the model `name` (of its model blob: every name of the
        same blob shares it), replacing any earlier one atomically; its path."""
        from ..plan import prior

        package = self.open(name)
        n_expert = package.config.get("expert_count")
        if n_expert and getattr(counts, "shape", (0, n_expert))[1] != n_expert:
            raise ModelsError(f"{package.name.display}: a prior of {counts.shape[1]} experts a layer, the model has "
                              f"{n_expert}")
        self.priors_dir.mkdir(parents=True, exist_ok=True)
        path = self.prior_path(package)
        prior.save(path, counts)
        prior.runs_path(path).unlink(missing_ok=True)  # what it learns from runs starts again from these counts
        return path

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

    def _stamp(self, hex_: str) -> None:
        """Records that blob hex_ was hashed and matched while its stat was what it is now."""
        path = self.blob_path(hex_)
        with _atomic_file(self.verified_dir / path.name) as f:
            f.write(json.dumps(stat_key(path)).encode())

    def _stamped(self, hex_: str) -> bool:
        try:
            return json.loads((self.verified_dir / f"sha256-{hex_}").read_bytes()) == stat_key(self.blob_path(hex_))
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
        got, _ = hash_file(path, progress or Silent(), f"verify {what}")
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
        if sha256_digest(data) != layer.hex:
            raise BlobError(f"model {model}: its {what} blob {path} is damaged (its sha256 does not match); "
                            f"{_FIX.format(model=model)}")
        return data

    def _read_manifest(self, name: ModelName) -> tuple[Manifest, str, float]:
        path = self.manifest_path(name)
        try:
            data = path.read_bytes()
            mtime = path.stat().st_mtime
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ModelNotFoundError(f"model {name.display!r} not found in {self.root} "
                                     "(`zipmoe list` shows the models)") from None
        return Manifest.from_bytes(data, f"model {name.display} ({path})"), sha256_digest(data), mtime

    def exists(self, name: str | ModelName) -> bool:
        return self.manifest_path(as_name(name)).is_file()

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
                out.append(ModelEntry(name, sha256_digest(data), manifest.size, path.stat().st_mtime))
            except (OSError, ModelsError) as e:
                out.append(ModelEntry(name, "", 0, 0.0, str(e)))
        return sorted(out, key=lambda e: (-e.modified, e.name))

    def open(self, name: str | ModelName, *, full_check: bool = False,
             progress: Progress | None = None) -> ModelPackage:
        """The model `name`, every blob checked (see the module's notes on the model blob)."""
        name = as_name(name)
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
                raise ModelsError(f"the {what} blob {layer.digest} is not UTF-8 text") from None

        def as_json(layer: Layer, what: str) -> Any:
            try:
                return json.loads(read(layer, what))
            except (ValueError, RecursionError):  # RecursionError: nested deeper than the interpreter's stack
                raise ModelsError(f"the {what} blob {layer.digest} is not JSON") from None

        config = as_json(manifest.config, "config")
        if not isinstance(config, dict):
            raise ModelsError(f"the config blob {manifest.config.digest} is not a JSON object")
        params: dict[str, Any] = {}
        for layer in manifest.of_type(MEDIA_PARAMS):
            obj = as_json(layer, "parameters")
            if not isinstance(obj, dict):
                raise ModelsError(f"the parameters blob {layer.digest} is not a JSON object")
            params.update(mfile.check_parameters(obj, f"the parameters blob {layer.digest}"))
        messages = []
        for layer in manifest.of_type(MEDIA_MESSAGES):
            obj = as_json(layer, "messages")
            if not (isinstance(obj, list) and all(_is_message(m) for m in obj)):
                raise ModelsError(f"the messages blob {layer.digest} is not a list of messages")
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
            except (OSError, ModelsError) as e:
                raise ModelsError(f"{e}; cannot tell which blobs it uses: repair or delete that manifest file "
                                 "first") from None
            out |= {x.hex for x in manifest.blobs}
        return out

    def _commit(self, name: ModelName, manifest: Manifest, job: Job | None, *,
                replace: bool = True) -> tuple[str, int, int]:
        """Moves the job's blobs into the store and writes the manifest last, all under the store lock (which
        refuses a name that exists unless `replace`). Returns the manifest's digest and how many blobs (and bytes)
        were new."""
        new = new_bytes = 0
        data = manifest.to_bytes()
        with self._locked():
            if not replace and self.exists(name):
                raise ModelsError(f"model {name.display} exists (it was added while this one was being checked); "
                                 "give another name, or replace it")
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
                    raise ModelsError(f"blob {target.name} of {name.display} disappeared while it was being created "
                                     "(did `zipmoe rm` or `zipmoe prune` run at the same time?); run the command again")
            if placed:
                fsync_dir(self.blobs_dir)  # the blobs are durable before the manifest that points at them
                for hex_ in placed:
                    with contextlib.suppress(OSError):
                        self._stamp(hex_)
            path = self.manifest_path(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            with _atomic_file(path) as f:
                f.write(data)
        return sha256_digest(data), new, new_bytes

    def copy(self, src: str | ModelName, dst: str | ModelName) -> ModelName:
        src, dst = as_name(src), as_name(dst)
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
        name = as_name(name)
        with self._locked():
            manifest, _, _ = self._read_manifest(name)
            path = self.manifest_path(name)
            path.unlink()
            self._remove_empty_dirs(path.parent)
            try:
                keep = self.referenced()
            except ModelsError:
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
                # (a prior's runs note, lock and runs' records are named sha256-<hex>.<what>: by their blob too)
                for p in (*self.verified_dir.iterdir(), *self.priors_dir.glob("sha256-*")):
                    if not self.blob_path(p.name.removeprefix("sha256-").split(".")[0]).exists():
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


# ------------------------------------------------------------------------------------------ using models


def resolve_model(name_or_path: str | os.PathLike[str], *, store: ModelDirectory | None = None,
                  full_check: bool = False) -> tuple[Path, ModelPackage | None]:
    """For `zipmoe run/serve MODEL`: an existing file is used as is (no package); anything else is a model name
    in the store, whose checked model blob is returned with its package (parameters, template, system prompt).

    A missing file that cannot be a model name (e.g. /path/x.gguf) is a ZipmoeError; a valid name that is neither a
    file nor a stored model is ModelNotFoundError (both exit status 2)."""
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
    store = store or ModelDirectory()
    try:
        package = store.open(name, full_check=full_check)
    except ModelNotFoundError:
        raise ModelNotFoundError(f"{text}: no such file, and no model {name.display!r} in {store.root} "
                                 "(`zipmoe list` shows the models)") from None
    return package.model_path, package


def llama_from_store(name: str, *, llama_class: type | None = None, zipmoe_models: str | os.PathLike[str] | None = None,
                     full_check: bool = False, **kwargs: Any) -> Any:
    """A pyzipmoe.Llama (or `llama_class`) for the stored model `name`, with the package applied: its parameters
    become constructor arguments (num_ctx -> n_ctx, cache_mode -> zipmoe_cache, ...) and defaults of every
    completion (temperature, top_k, stop, seed...); its TEMPLATE becomes the chat handler; its SYSTEM and MESSAGE
    history are put in front of create_chat_completion's messages. Arguments given here, and to each call, win.
    The package is `llm.zipmoe_package`. (What pyzipmoe.Llama.from_store calls.)"""
    if llama_class is None:
        from ..runtime.llama import Llama  # imported on use: it loads llama_cpp and libllama

        llama_class = Llama
    package = ModelDirectory(zipmoe_models).open(name, full_check=full_check)
    args = package.llama_kwargs()
    for keyword in ("memory_budget", "cache_policy"):  # pyzipmoe.Llama's, of the parameters of the same names
        if keyword in args and not accepts_keyword(llama_class, keyword):
            # llama_cpp.Llama swallows unknown keywords; say so rather than pretend the parameter applies
            warnings.warn(f"{package.name.display}: PARAMETER {keyword} is not supported by this "
                          f"{llama_class.__name__}; it is ignored", RuntimeWarning, stacklevel=2)
            del args[keyword]
    llm = llama_class(str(package.model_path), **{**args, **kwargs})
    apply_package(llm, package, chat_template=not ({"chat_format", "chat_handler"} & kwargs.keys()))
    return llm
