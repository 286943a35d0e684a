"""`zipmoe export` and `zipmoe import`: a model package as a tar archive with the models directory's layout;
importing verifies every blob's digest before anything is linked, and never replaces a name the user did not give.
"""

from __future__ import annotations

import io
import os
import re
import tarfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..progress import Progress, Silent
from .blobs import BLOCK, BlobError, SMALL_BLOB_MAX, HashingReader, Job, _atomic_file, read_chunks
from .manifest import Layer, Manifest, layer_kind
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
        rename = as_name(name) if name is not None else None
        manifests: dict[ModelName, Manifest] = {}
        self._ensure()
        try:
            with Job(self) as job, open(src, "rb") as raw:
                progress.start("import", os.fstat(raw.fileno()).st_size)
                counted = HashingReader(raw, progress, hash_=False)
                try:
                    tar = tarfile.open(fileobj=counted, mode="r|*")  # type: ignore[call-overload]  # noqa: SIM115
                except tarfile.TarError as e:
                    raise ModelsError(f"{src}: not a tar file ({e})") from None
                with tar:
                    for member in _members(tar, src):
                        self._import_member(tar, member, src, job, manifests)
                if not manifests:
                    raise ModelsError(f"{src}: no model in it (no manifests/... entry); was it written by "
                                     "`zipmoe export`?")
                if rename is not None and len(manifests) > 1:
                    raise ModelsError(f"{src} holds {len(manifests)} models; import it without a name")
                new = 0
                for model_name, manifest in manifests.items():
                    target = rename or model_name
                    self._check_import(manifest, job, src, target)
                    new += self._commit(target, manifest, job)[1]
        finally:
            progress.close()
        return TransferReport(tuple((rename or n).display for n in manifests), str(src), src.stat().st_size, new,
                              time.monotonic() - t0)

    def _import_member(self, tar: tarfile.TarFile, member: tarfile.TarInfo, src: Path, job: Job,
                       manifests: dict[ModelName, Manifest]) -> None:
        parts = member.name.split("/")
        f = tar.extractfile(member)
        assert f is not None
        if parts[0] == "blobs" and len(parts) == 2 and re.fullmatch(r"sha256-[0-9a-f]{64}", parts[1]):
            staged = job.stage_chunks(read_chunks(f, member.size))
            if staged.hex != parts[1].removeprefix("sha256-"):
                raise BlobError(f"{src}: {member.name} does not match its sha256 (got {staged.hex[:16]}...): the "
                                "archive is damaged")
        elif parts[0] == "manifests" and len(parts) == 5:
            if member.size > SMALL_BLOB_MAX:
                raise ModelsError(f"{src}: {member.name} is too large for a manifest")
            try:
                model_name = ModelName.of(*parts[1:])
            except InvalidNameError as e:
                raise ModelsError(f"{src}: {member.name}: {e}") from None
            manifests[model_name] = Manifest.from_bytes(f.read(), f"{src}: {member.name}")
        else:
            raise ModelsError(f"{src}: unexpected entry {member.name!r}; a zipmoe export holds manifests/HOST/"
                             "NAMESPACE/MODEL/TAG and blobs/sha256-HEX only")

    def _check_import(self, manifest: Manifest, job: Job, src: Path, name: ModelName) -> None:
        """Every blob is in the archive or the store, with the manifest's size; the package decodes; the model is
        a zipmoe GGUF."""
        def path_of(layer: Layer) -> Path:
            staged = job.staged.get(layer.hex)
            if staged is not None:
                if staged.stat().st_size != layer.size:
                    raise ModelsError(f"{src}: blob {layer.digest} has {staged.stat().st_size} bytes, the manifest says "
                                     f"{layer.size}")
                return staged
            if self._intact(layer.hex, layer.size):
                return self.blob_path(layer.hex)
            raise ModelsError(f"{src}: the {layer_kind(layer)} blob {layer.digest} of {name.display} is neither in the "
                             "archive nor in the store")

        self._parts(manifest, lambda layer, what: path_of(layer).read_bytes())
        from ..file.reader import open_zipmoe

        open_zipmoe(path_of(manifest.model))


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
            raise ModelsError(f"{src}: unexpected entry {member.name!r} (not a plain file with a relative name)")
        yield member
