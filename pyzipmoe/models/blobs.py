"""Blobs by digest: hashing while copying, atomic writes, and the private job directory where a create or import
stages blobs before they are committed to the models directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

from ..atomic import replacing
from ..errors import ChecksumError
from ..progress import Progress
from .manifest import Layer
from .name import ModelsError


BLOCK = 8 << 20  # bytes per read/write when hashing and copying
SMALL_BLOB_MAX = 64 << 20  # config, parameters, template...: read whole; a larger one is not ours


class BlobError(ChecksumError):
    """A blob is missing or does not match its sha256: the message names the model and the blob."""


# ------------------------------------------------------------------------------------------ file helpers


def hash_file(path: Path, progress: Progress, label: str) -> tuple[str, int]:
    sha, size = hashlib.sha256(), 0
    progress.start(label, path.stat().st_size)
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(BLOCK):
            sha.update(chunk)
            size += len(chunk)
            progress.advance(len(chunk))
    return sha.hexdigest(), size


def stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


@contextlib.contextmanager
def _atomic_file(dst: Path) -> Iterator[BinaryIO]:
    """A new file that appears as dst (replacing it) only when the block completes."""
    with replacing(dst, 0o644, "wb", sync_dir=True) as f:
        yield f


class _JobRoot(Protocol):
    """What a job needs of the models directory it works in (a ModelDirectory)."""

    tmp_dir: Path

    def _locked(self) -> contextlib.AbstractContextManager[None]: ...


class Job:
    """A create or import at work: a private directory under .state/tmp for blobs not yet in the store.

    It holds a flock on its lock file for its lifetime; `prune` removes job directories whose lock it can take
    (their process is gone, e.g. killed)."""

    def __init__(self, directory: _JobRoot):
        self.directory = directory
        self.staged: dict[str, Path] = {}  # hex -> file in self.dir
        with directory._locked():  # so that prune never sees the lock file before it is held
            token = secrets.token_hex(8)
            self.lock_path = directory.tmp_dir / f"job-{token}.lock"
            self.dir = directory.tmp_dir / f"job-{token}"
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

    def __enter__(self) -> Job:  # noqa: PYI034 (a final class)
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


def read_chunks(f: BinaryIO, size: int | None = None) -> Iterator[bytes]:
    left = size
    while left is None or left > 0:
        chunk = f.read(BLOCK if left is None else min(BLOCK, left))
        if not chunk:
            if left:
                raise ModelsError("the input ended early")
            return
        if left is not None:
            left -= len(chunk)
        yield chunk


class HashingReader:
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
