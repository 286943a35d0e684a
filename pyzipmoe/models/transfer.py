"""`zipmoe export` and `zipmoe import`: a model package as a tar archive with the models directory's layout;
importing is all or nothing, checks every member against the archive's one manifest before writing it, and
never replaces a name unless told to (--force).

An archive holds, in this order: manifests/HOST/NAMESPACE/MODEL/TAG (the one manifest), blobs/sha256-HEX (its
blobs), and, where the model keeps a prior (pyzipmoe.plan.prior, with what its runs recorded merged in),
priors/sha256-HEX, HEX the model blob's (docs/FORMAT.md, "Priors"). An archive without a prior imports as one with
it does, less the prior; one whose prior is damaged, not of its model blob or not of its model's shape is refused.
An imported prior is kept only where the store keeps none for that blob: one that learned from this machine's runs
stays.
"""

from __future__ import annotations

import bz2
import contextlib
import io
import lzma
import os
import re
import stat
import tarfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..progress import Progress, Silent
from .blobs import BLOCK, BlobError, SMALL_BLOB_MAX, HashingReader, Job, _atomic_file, read_chunks
from .manifest import MEDIA_MODEL, Layer, Manifest, layer_kind, sha256_digest
from .name import InvalidNameError, ModelName, ModelsError, as_name


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


class Transferring:
    """ModelDirectory's export and import (pyzipmoe.models.transfer): archives of model packages."""

    def export(self, name: str | ModelName, dest: str | os.PathLike[str], *,
               progress: Progress | None = None) -> TransferReport:
        """Writes the model to a tar file with the store's layout (manifests/..., blobs/sha256-...). Every blob is
        hashed as it is read, so a damaged blob is never exported."""
        t0 = time.monotonic()
        name = as_name(name)
        progress = progress or Silent()
        manifest, _, mtime = self._read_manifest(name)
        dest = Path(dest)
        if dest.is_dir():
            raise ModelsError(f"{dest} is a directory; give the name of the tar file to write")
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
                        self.check_blob(layer, model=name.display, what=layer_kind(layer))  # says what is wrong
                    with open(path, "rb", buffering=0) as blob:
                        reader = HashingReader(blob, progress)
                        tar.addfile(_tarinfo(f"blobs/{path.name}", layer.size, mtime), reader)
                        if reader.read(1) or reader.hexdigest() != layer.hex:
                            raise BlobError(f"model {name.display}: its {layer_kind(layer)} blob {path} is damaged "
                                            f"(its sha256 does not match); nothing was exported")
                kept = _kept_prior_bytes(self.blob_path(manifest.model.digest), name)
                if kept is not None:
                    tar.addfile(_tarinfo(f"{PRIORS_MEMBER}/sha256-{manifest.model.hex}", len(kept), mtime),
                                io.BytesIO(kept))
        finally:
            progress.close()
        return TransferReport((name.display,), str(dest), dest.stat().st_size, 0, time.monotonic() - t0)

    def import_(self, src: str | os.PathLike[str], name: str | ModelName | None = None, *, force: bool = False,
                progress: Progress | None = None,
                announce: Callable[[ImportPlan], None] | None = None) -> TransferReport:
        """Adds the one model of a tar file written by export, under `name` if given (else the name it was
        exported with). All or nothing: blobs are staged in a private job directory, hashed as they arrive and
        checked against the manifest (which export writes first) before a byte of them is written; the model
        enters the store only when every blob is in place and the package decodes, so a refused or killed import
        leaves the store as it was (`prune` removes a killed job's leftovers). A name that exists is refused unless
        `force`; `announce` is told what will be added just before it is committed."""
        t0 = time.monotonic()
        src = Path(src)
        progress = progress or Silent()
        rename = as_name(name) if name is not None else None
        self._ensure()
        try:
            with Job(self) as job, _open_regular(src) as raw:
                size = os.fstat(raw.fileno()).st_size
                progress.start("import", size)
                counted = HashingReader(raw, progress, hash_=False)
                guard = _TarGuard(_decompressed(counted, src, size, self._free_bytes()), src)
                try:
                    tar = tarfile.open(fileobj=guard, mode="r|")  # type: ignore[call-overload]  # noqa: SIM115
                except tarfile.TarError as e:
                    raise ModelsError(f"{src}: not a tar file ({e})") from None
                found = _Import(self, job, src, rename, force, guard)
                try:
                    with tar:
                        for member in _members(tar, src, guard):
                            found.member(tar, member)
                except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError) as e:
                    raise ModelsError(f"{src}: not a valid archive ({e})") from None
                except OSError as e:
                    if e.errno is not None:
                        raise  # an I/O error of this machine (a full disk...), not of the archive
                    raise ModelsError(f"{src}: not a valid archive ({e})") from None  # bz2's bad data
                target, manifest = found.finish()
                model_path = self._check_import(manifest, job, src, target)
                if found.prior is not None:
                    _check_prior_shape(found.prior, model_path, src, found.prior_member)
                new_blobs = [x for x in {x.hex: x for x in manifest.blobs}.values() if x.hex in job.staged]
                plan = ImportPlan(target.display, self.exists(target), len(new_blobs),
                                  sum(x.size for x in new_blobs))
                if announce is not None:
                    announce(plan)
                new = self._commit(target, manifest, job, replace=force)[1]
                if found.prior is not None:
                    _keep_imported_prior(self.blob_path(manifest.model.hex), found.prior)
        finally:
            progress.close()
        return TransferReport((target.display,), str(src), size, new, time.monotonic() - t0)

    def _free_bytes(self) -> int:
        st = os.statvfs(self.tmp_dir)
        return st.f_bavail * st.f_frsize

    def _check_import(self, manifest: Manifest, job: Job, src: Path, name: ModelName) -> Path:
        """Every blob is in the archive or the store, with the manifest's size; the small ones are read through
        the capped reader; the package decodes; the model is a zipmoe GGUF. Where its model blob is now."""
        def path_of(layer: Layer) -> Path:
            staged = job.staged.get(layer.hex)
            if staged is not None:
                return staged  # its size and sha256 were checked as it was staged
            if self._intact(layer.hex, layer.size):
                return self.blob_path(layer.hex)
            raise ModelsError(f"{src}: the {layer_kind(layer)} blob {layer.digest} of {name.display} is neither in "
                             "the archive nor in the store")

        def small(layer: Layer, what: str) -> bytes:
            if layer.size > SMALL_BLOB_MAX:
                raise ModelsError(f"{src}: the {what} blob {layer.digest} is {layer.size} bytes, too large for a "
                                 f"{what}")
            staged = job.staged.get(layer.hex)
            if staged is None:
                path_of(layer)  # in the store, or a clear error
                return self._read_small(layer, name.display, what)
            with open(staged, "rb") as f:
                data = f.read(SMALL_BLOB_MAX + 1)
            if len(data) != layer.size or sha256_digest(data) != layer.hex:
                raise ModelsError(f"{src}: the {what} blob {layer.digest} changed while it was being imported")
            return data

        self._parts(manifest, small)
        from ..file.gguf import read_gguf
        from ..file.reader import open_zipmoe

        if read_gguf(path_of(manifest.model)).is_zipmoe:  # (a plain GGUF is stored as it is: its header parsed)
            open_zipmoe(path_of(manifest.model))
        return path_of(manifest.model)


PRIORS_MEMBER = "priors"  # priors/sha256-HEX: the model blob's prior (the models directory's folder of the name)
PRIOR_MAX = 64 << 20  # bytes of a prior member: n_layer x n_expert counts (the loader reads no larger prior file)


def _kept_prior_bytes(model_blob: Path, name: ModelName) -> bytes | None:
    """The model blob's kept prior, with what runs recorded merged in, checked; None without one."""
    from ..plan import prior

    kept = prior.learn(model_blob)
    if kept is None:
        return None
    try:
        data = kept.read_bytes()
        prior.decode(data, f"model {name.display}: its prior {kept}")
    except OSError as e:
        raise ModelsError(f"model {name.display}: its prior {kept} cannot be read ({e.strerror or e})") from None
    except prior.PriorFileError as e:
        raise ModelsError(f"{e}; nothing was exported (`zipmoe calibrate {name.display} --force` records a new "
                          "one)") from None
    return data


def _check_prior_shape(counts: Any, model_path: Path, src: Path, member: str) -> None:
    """A prior of the model's shape, as the loader wants it: its highest block with experts plus one, its experts."""
    from ..plan.inputs import PlanInputError, geometry_from_gguf

    try:
        g = geometry_from_gguf(model_path)
    except PlanInputError as e:
        raise ModelsError(f"{src}: {e}") from None
    want = (max(g.layers) + 1, g.n_expert)
    if tuple(counts.shape) != want:
        raise ModelsError(f"{src}: {member} is a prior of {counts.shape[0]} layers of {counts.shape[1]} experts; the "
                          f"model has {want[0]} of {want[1]}: refused")


def _keep_imported_prior(model_blob: Path, counts: Any) -> None:
    """Keeps an imported prior for the model blob, unless the store keeps one for it already (learned here)."""
    from ..plan import prior

    place = model_blob.parent.parent / prior.PRIORS_DIR / model_blob.name
    if prior.kept_prior(model_blob) is None:
        place.parent.mkdir(parents=True, exist_ok=True)
        prior.save(place, counts)


def _tarinfo(name: str, size: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, int(mtime), 0o644
    return info


MANIFEST_MAX = 1 << 20  # bytes of a manifest member (export writes a few hundred)
MAX_MEMBERS = 4096  # entries of an archive (export writes one manifest and a blob per layer)
HEADER_MAX = 1 << 20  # bytes of tar headers (pax, long names) between two members
DISK_RESERVE = 64 << 20  # free bytes a staged blob must leave on the store's file system
RATIO_MAX = 16  # a compressed archive may inflate to RATIO_MAX times its bytes read so far, plus RATIO_SLACK
RATIO_SLACK = 64 << 20
DECOMPRESSED_MAX = 1 << 40  # and never to more than this in all
_IN_BLOCK = 1 << 16


@dataclass(frozen=True)
class ImportPlan:
    """What an import is about to add, told before it is committed."""

    name: str
    replaces: bool
    new_blobs: int
    new_bytes: int


@contextlib.contextmanager
def _open_regular(src: Path) -> Iterator[BinaryIO]:
    """The archive, opened without blocking on a FIFO or a device, and refused unless it is a regular file."""
    fd = os.open(src, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ModelsError(f"{src}: not a regular file")
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


class _Plain:
    """The archive's bytes as they are, after the few already read to recognise a compression."""

    def __init__(self, head: bytes, raw: Any):
        self.head, self.raw = head, raw

    def read(self, n: int = -1) -> bytes:
        if self.head:
            data, self.head = self.head[:n], self.head[n:]
            return data
        return self.raw.read(n)


class _Inflating:
    """A compressed archive, decompressed on the way with bounds on what it may inflate to: RATIO_MAX times its
    compressed bytes read so far (plus RATIO_SLACK), and DECOMPRESSED_MAX in all."""

    def __init__(self, head: bytes, raw: Any, kind: str, src: Path):
        self.raw, self.kind, self.src = _Plain(head, raw), kind, src
        self.d: Any = {"gzip": lambda: zlib.decompressobj(16 + zlib.MAX_WBITS), "bzip2": bz2.BZ2Decompressor,
                       "xz": lzma.LZMADecompressor}[kind]()
        self.pending, self.inp, self.out = b"", 0, 0

    def _input(self) -> bytes:
        data = self.raw.read(_IN_BLOCK)
        if not data:
            raise ModelsError(f"{self.src}: the {self.kind} stream ends early (truncated?)")
        self.inp += len(data)
        return data

    def read(self, n: int = -1) -> bytes:
        n = _IN_BLOCK if n is None or n < 0 else n
        out = bytearray()
        while len(out) < n and not self.d.eof:
            if self.kind == "gzip":
                data = self.pending or self._input()
                chunk = self.d.decompress(data, n - len(out))
                self.pending = self.d.unconsumed_tail
            else:
                chunk = self.d.decompress(self._input() if self.d.needs_input else b"", n - len(out))
            out += chunk
            self.out += len(chunk)
            if self.out > min(DECOMPRESSED_MAX, RATIO_MAX * self.inp + RATIO_SLACK):
                raise ModelsError(f"{self.src}: the {self.kind} stream inflates to more than "
                                 f"{'its limit' if self.out > DECOMPRESSED_MAX else f'{RATIO_MAX} times its size'}; "
                                 "refused (not an export of a model)")
        return bytes(out)


def _decompressed(raw: Any, src: Path, size: int, free: int) -> Any:
    head = raw.read(6)
    for magic, kind in ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz")):
        if head.startswith(magic):
            return _Inflating(head, raw, kind, src)
    return _Plain(head, raw)


class _TarGuard:
    """Between the (decompressed) archive and tarfile: counts the bytes tarfile reads, and refuses more than the
    data of the member it was last given plus HEADER_MAX (tarfile reads pax headers and long names whole)."""

    def __init__(self, f: Any, src: Path):
        self.f, self.src = f, src
        self.consumed = 0
        self.limit = HEADER_MAX

    def allow(self, data_bytes: int) -> None:
        self.limit = self.consumed + data_bytes + HEADER_MAX

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.consumed += len(data)
        if self.consumed > self.limit:
            raise ModelsError(f"{self.src}: a tar header larger than {HEADER_MAX} bytes; refused (not an export of "
                             "a model)")
        return data


class _Import:
    """The members of one archive, checked against its one manifest as they arrive."""

    def __init__(self, directory: Any, job: Job, src: Path, rename: ModelName | None, force: bool,
                 guard: _TarGuard):
        self.directory, self.job, self.src, self.rename, self.force = directory, job, src, rename, force
        self.manifest: Manifest | None = None
        self.manifest_member = ""
        self.target: ModelName | None = None
        self.expected: dict[str, tuple[int, bool]] = {}  # hex -> (size, a small blob)
        self.seen: set[str] = set()
        self.prior: Any = None  # the counts of its priors/ member, if it has one
        self.prior_member = ""

    def member(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        src = self.src
        parts = member.name.split("/")
        if parts[0] == "blobs" and len(parts) == 2 and re.fullmatch(r"sha256-[0-9a-f]{64}", parts[1]):
            self._blob(tar, member, parts[1].removeprefix("sha256-"))
        elif parts[0] == "manifests" and len(parts) == 5:
            self._manifest(tar, member, parts)
        elif parts[0] == PRIORS_MEMBER and len(parts) == 2 and re.fullmatch(r"sha256-[0-9a-f]{64}", parts[1]):
            self._prior(tar, member, parts[1].removeprefix("sha256-"))
        else:
            raise ModelsError(f"{src}: unexpected entry {member.name!r}; a zipmoe export holds manifests/HOST/"
                             "NAMESPACE/MODEL/TAG, blobs/sha256-HEX and priors/sha256-HEX only")

    def _prior(self, tar: tarfile.TarFile, member: tarfile.TarInfo, hex_: str) -> None:
        from ..plan import prior

        src = self.src
        if self.manifest is None or hex_ != self.manifest.model.hex:
            raise ModelsError(f"{src}: {member.name} is not the prior of the model blob of "
                             f"{self.manifest_member or 'a manifest before it'}; refused")
        if self.prior is not None:
            raise ModelsError(f"{src}: {member.name} appears twice")
        if member.size > PRIOR_MAX:
            raise ModelsError(f"{src}: {member.name} is too large for a prior ({member.size} bytes)")
        f = tar.extractfile(member)
        assert f is not None
        try:
            self.prior = prior.decode(f.read(member.size), f"{src}: {member.name}")
        except prior.PriorFileError as e:
            raise ModelsError(str(e)) from None
        self.prior_member = member.name

    def _manifest(self, tar: tarfile.TarFile, member: tarfile.TarInfo, parts: list[str]) -> None:
        src = self.src
        if self.manifest is not None:
            raise ModelsError(f"{src} holds more than one manifest ({self.manifest_member}, {member.name}); "
                             "`zipmoe export` writes one: refused")
        if member.size > MANIFEST_MAX:
            raise ModelsError(f"{src}: {member.name} is too large for a manifest ({member.size} bytes)")
        try:
            model_name = ModelName.of(*parts[1:])
        except InvalidNameError as e:
            raise ModelsError(f"{src}: {member.name}: {e}") from None
        f = tar.extractfile(member)
        assert f is not None
        manifest = Manifest.from_bytes(f.read(member.size), f"{src}: {member.name}")
        target = self.rename or model_name
        if not self.force and self.directory.exists(target):
            raise ModelsError(f"model {target.display} exists; `zipmoe import {src} NAME` adds it under another "
                             "name, --force replaces it")
        for layer in manifest.blobs:
            small = layer.media_type != MEDIA_MODEL
            size, was_small = self.expected.get(layer.hex, (layer.size, small))
            if size != layer.size:
                raise ModelsError(f"{src}: {member.name} gives blob {layer.digest} two sizes")
            if small and layer.size > SMALL_BLOB_MAX:
                raise ModelsError(f"{src}: {member.name}: its {layer_kind(layer)} blob {layer.digest} is "
                                 f"{layer.size} bytes, too large for a {layer_kind(layer)}")
            self.expected[layer.hex] = (size, small or was_small)
        self.manifest, self.manifest_member, self.target = manifest, member.name, target

    def _blob(self, tar: tarfile.TarFile, member: tarfile.TarInfo, hex_: str) -> None:
        src = self.src
        if self.manifest is None:
            raise ModelsError(f"{src}: {member.name} comes before the manifest; not an archive written by "
                             "`zipmoe export`")
        if hex_ not in self.expected:
            raise ModelsError(f"{src}: {member.name} is not a blob of {self.manifest_member}; refused")
        if hex_ in self.seen:
            raise ModelsError(f"{src}: {member.name} appears twice")
        self.seen.add(hex_)
        size, _ = self.expected[hex_]
        if member.size != size:
            raise ModelsError(f"{src}: blob {member.name} has {member.size} bytes, the manifest says {size}")
        if self.directory._intact(hex_, size):
            return  # stored once; tarfile skips its bytes
        free = self.directory._free_bytes()
        if size + DISK_RESERVE > free:
            raise ModelsError(f"{src}: blob {member.name} needs {size} bytes, and {free} are free in "
                             f"{self.directory.root} (with {DISK_RESERVE} to spare); refused")
        f = tar.extractfile(member)
        assert f is not None
        staged = self.job.stage_chunks(read_chunks(f, size))
        if staged.hex != hex_ or staged.size != size:
            raise BlobError(f"{src}: {member.name} does not match its sha256 (got {staged.hex[:16]}...): the "
                            "archive is damaged")

    def finish(self) -> tuple[ModelName, Manifest]:
        if self.manifest is None or self.target is None:
            raise ModelsError(f"{self.src}: no model in it (no manifests/... entry); was it written by "
                             "`zipmoe export`?")
        return self.target, self.manifest


def _members(tar: tarfile.TarFile, src: Path, guard: _TarGuard) -> Iterator[tarfile.TarInfo]:
    """Regular files with safe relative names; directory entries are skipped; anything else (links, devices,
    FIFOs, sparse files) is refused, and so are more than MAX_MEMBERS entries."""
    for count, member in enumerate(tar):
        guard.allow(member.size if member.isfile() else 0)
        if count >= MAX_MEMBERS:
            raise ModelsError(f"{src}: more than {MAX_MEMBERS} entries; refused (not an export of a model)")
        tar.members.clear()  # tarfile remembers every member; nothing here needs them
        if member.isdir():
            continue
        parts = member.name.split("/")
        if not member.isfile() or member.issparse() or member.name.startswith("/") \
                or any(p in ("", ".", "..") for p in parts):
            raise ModelsError(f"{src}: unexpected entry {member.name!r} (not a plain file with a relative name)")
        yield member
