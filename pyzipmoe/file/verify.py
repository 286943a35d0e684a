"""zipmoe GGUF -> its source, bit for bit: verify (every expert decoded, each chunk's checksum checked, the
restored source compared with its sha256 and, if given, with the source file) and unpack (the source written back).

Like convert, everything streams, and unpack writes through a temporary file renamed when complete.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EXIT_DIFFERENT, FormatError, ZipmoeError
from ..progress import Progress, Silent
from .fileio import (
    atomic_output,
    byte_blocks,
    ordered,
    pread_into,
    refuse_same_file,
    tensors_by_offset,
    thread_count,
)
from .gguf import pread_exact
from .integrity import check_integrity
from .metadata import SOURCE_HEADER
from .reader import CompressedTensor, ZipmoeFile, open_zipmoe


class MismatchError(ZipmoeError):
    """Restored bytes differ from the source (or from its recorded sha256)."""

    exit_code = EXIT_DIFFERENT


# ----------------------------------------------------------------------------------------- restoring


@dataclass(frozen=True)
class Piece:
    """A run of restored source bytes, and what it belongs to (for precise mismatch reports)."""

    offset: int  # in the source file
    data: Any  # a uint8 buffer
    tensor: str | None  # None between tensors
    expert: int | None = None
    start: int = 0  # offset of the run inside its tensor (or expert)
    unit: int = 1  # bytes per element of an expert (2 for BF16/F16 values), for mismatch reports

    @property
    def nbytes(self) -> int:
        return memoryview(self.data).nbytes


def _zeros(start: int, end: int) -> Iterator[Piece]:
    for s, n in byte_blocks(end - start):
        yield Piece(start + s, bytes(n), None)


def _decoded(pool: ThreadPoolExecutor, fd: int, c: CompressedTensor, depth: int, label: str) -> Iterator[Piece]:
    """The expert tensor's original bytes, expert by expert; chunk checksums are verified on the way."""
    info = c.expert.info

    def decode(e: int) -> np.ndarray:
        span = c.expert.span(e)
        region = pread_into(fd, np.empty(span.size, np.uint8), c.data.file_offset + span.offset, label)
        return c.expert.decode_expert(e, region)

    expert_bytes = info.expert_size
    unit = 2 if info.split else 1
    for e, values in enumerate(ordered(pool, decode, range(info.n_expert), depth)):
        yield Piece(c.source.file_offset + e * expert_bytes, values.view(np.uint8), c.name, e, unit=unit)


def _restored(zf: ZipmoeFile, fd: int, pool: ThreadPoolExecutor, depth: int) -> Iterator[Piece]:
    """The source file, front to back, as FORMAT.md's "Restoring the source" describes it."""
    label = str(zf.path)
    yield Piece(0, pread_exact(fd, zf.source_header.nbytes, zf.source_header.file_offset, label), SOURCE_HEADER)
    compressed = zf.compressed_by_name
    pos = zf.source.data_start
    for t in tensors_by_offset(zf.source):
        yield from _zeros(pos, t.file_offset)
        if t.name in compressed:
            yield from _decoded(pool, fd, compressed[t.name], depth, label)
        else:
            mine = zf.gguf.by_name[t.name]
            for start, n in byte_blocks(t.nbytes):
                yield Piece(t.file_offset + start, pread_exact(fd, n, mine.file_offset + start, label), t.name,
                            start=start)
        pos = t.file_offset + t.nbytes
    yield from _zeros(pos, zf.meta.source_size)


def _restore(zf: ZipmoeFile, threads: int, progress: Progress, sink: Callable[[Piece], None]) -> str:
    """Streams the restored source into `sink` and returns its sha256."""
    sha = hashlib.sha256()
    progress.start("decode", zf.meta.source_size)
    fd = os.open(zf.path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="zipmoe-decode") as pool:
            for piece in _restored(zf, fd, pool, threads + 2):
                sha.update(piece.data)
                sink(piece)
                progress.advance(piece.nbytes)
    finally:
        os.close(fd)
    return sha.hexdigest()


def _mismatch(piece: Piece, ref: np.ndarray) -> MismatchError:
    """Names the first differing value: tensor, expert and element for experts, byte otherwise."""
    mine = np.frombuffer(piece.data, np.uint8)
    if piece.expert is not None and piece.unit == 2:
        a, b = mine.view(np.uint16), ref.view(np.uint16)
        i = int(np.flatnonzero(a != b)[0])
        return MismatchError(f"{piece.tensor} expert {piece.expert} element {i} "
                             f"(flat index {piece.expert * a.size + i}): zipmoe gives 0x{a[i]:04x}, "
                             f"the source has 0x{b[i]:04x}")
    i = int(np.flatnonzero(mine != ref)[0])
    where = (f"{piece.tensor} expert {piece.expert} byte {i}" if piece.expert is not None
             else f"{piece.tensor} byte {piece.start + i}" if piece.tensor
             else f"source byte {piece.offset + i} (between tensors)")
    return MismatchError(f"{where}: zipmoe gives 0x{mine[i]:02x}, the source has 0x{ref[i]:02x}")


@contextmanager
def _comparing(against: Path, source_size: int) -> Iterator[Callable[[Piece], None]]:
    """A sink that compares each restored piece with the same bytes of `against`."""
    with open(against, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size != source_size:
            raise MismatchError(f"{against} is {size} bytes, but the zipmoe file's source was {source_size}")

        def compare(piece: Piece) -> None:
            ref = np.frombuffer(pread_exact(f.fileno(), piece.nbytes, piece.offset, str(against)), np.uint8)
            if not np.array_equal(np.frombuffer(piece.data, np.uint8), ref):
                raise _mismatch(piece, ref)

        yield compare


@dataclass(frozen=True)
class VerifyReport:
    path: str
    against: str | None
    sha256: str
    tensors: int
    experts: int
    chunks: int
    source_size: int
    seconds: float
    integrity_bytes: int = 0  # metadata and dense tensor bytes checked against the zipmoe.integrity record

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def verify(path: str | os.PathLike[str], against: str | os.PathLike[str] | None = None, *,
           threads: int | None = None, progress: Progress | None = None) -> VerifyReport:
    """Decodes every expert of a zipmoe file (checking every chunk checksum) and checks that the restored
    file has the recorded sha256; with `against`, also compares it byte for byte with that source and
    names the first difference."""
    t0 = time.monotonic()
    threads = thread_count(threads)
    progress = progress or Silent()
    zf = open_zipmoe(path)
    with ExitStack() as stack:
        stack.callback(progress.close)
        sink = (stack.enter_context(_comparing(Path(against), zf.meta.source_size)) if against is not None
                else lambda piece: None)
        sha = _restore(zf, threads, progress, sink)
    if sha != zf.meta.source_sha256:
        # with `against`, every byte matched, so it is the recorded hash that is wrong
        cls = FormatError if against is not None else MismatchError
        raise cls(f"{path}: the restored source has sha256 {sha}, but zipmoe.source.sha256 is "
                  f"{zf.meta.source_sha256}")
    # then what llama.cpp reads besides the experts, as its loader checks it: the metadata and the dense tensors
    # (the sha256 above covers the source's header, not the zipmoe file's own key/value pairs)
    integrity_bytes = check_integrity(zf.path, zf.gguf, zf.integrity)
    infos = [c.expert.info for c in zf.compressed]
    return VerifyReport(str(path), None if against is None else str(against), sha, len(infos),
                        sum(i.n_expert for i in infos), sum(i.n_expert * i.n_chunks for i in infos),
                        zf.meta.source_size, time.monotonic() - t0, integrity_bytes)


@dataclass(frozen=True)
class UnpackReport:
    path: str
    out: str
    sha256: str
    size: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def unpack(path: str | os.PathLike[str], out: str | os.PathLike[str], *, threads: int | None = None,
           progress: Progress | None = None) -> UnpackReport:
    """Restores the source of a zipmoe file, byte for byte, and checks its sha256."""
    t0 = time.monotonic()
    path, out = Path(path), Path(out)
    threads = thread_count(threads)
    progress = progress or Silent()
    refuse_same_file(path, out)
    zf = open_zipmoe(path)
    try:
        with atomic_output(out) as f:
            sha = _restore(zf, threads, progress, lambda piece: f.write(piece.data))
            if sha != zf.meta.source_sha256:
                raise MismatchError(f"{path}: the restored source has sha256 {sha}, but zipmoe.source.sha256 "
                                    f"is {zf.meta.source_sha256}; nothing was written")
    finally:
        progress.close()
    return UnpackReport(str(path), str(out), sha, zf.meta.source_size, time.monotonic() - t0)
