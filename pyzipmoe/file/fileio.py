"""Reading and writing large files in bounded memory, as convert, verify and unpack do: reads by pread into given
buffers, in blocks, work on a pool with a bounded number in flight, outputs that appear whole or not at all.
"""

from __future__ import annotations

import errno
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np

from ..atomic import replacing
from ..errors import FormatError, ZipmoeError
from .gguf import GGUFFile, Tensor

BLOCK = 8 << 20  # bytes per read when copying or scanning: large enough for sequential throughput

T = TypeVar("T")
R = TypeVar("R")


def ordered(pool: ThreadPoolExecutor, fn: Callable[[T], R], items: Iterable[T], depth: int) -> Iterator[R]:
    """fn over items on the pool, results in order, at most `depth` submitted and not yet consumed
    (this bounds memory: each result may be a whole expert)."""
    pending: deque[Future[R]] = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()


def pread_into(fd: int, out: np.ndarray, offset: int, label: str) -> np.ndarray:
    """Fills `out` from the file at `offset`, without an intermediate bytes object."""
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise FormatError(f"{label}: truncated file (nothing to read at offset {offset + done})")
        done += n
    return out


def read_into(f: BinaryIO, view: memoryview, label: str) -> None:
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise FormatError(f"{label}: the file ended early; was it changed while being read?")
        done += n


def byte_blocks(size: int, block: int = BLOCK) -> Iterator[tuple[int, int]]:
    """(start, length) of consecutive blocks covering [0, size)."""
    for start in range(0, size, block):
        yield start, min(block, size - start)


def thread_count(threads: int | None) -> int:
    n = threads if threads is not None else (os.cpu_count() or 1)
    if n < 1:
        raise ZipmoeError(f"--threads must be at least 1, got {n}")
    return n


@contextmanager
def atomic_output(dst: Path) -> Iterator[BinaryIO]:
    """A new file that appears as `dst` only once the block completes; removed on any error or Ctrl-C."""
    # checked first: these would otherwise fail only at the end, or name the temporary file
    if dst.is_dir():
        raise IsADirectoryError(errno.EISDIR, "the output is a directory", str(dst))
    if not dst.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no such directory for the output", str(dst.parent))
    # 0o666 lets the umask decide, as for any new file
    with replacing(dst, 0o666, "w+b") as f:
        yield f


def refuse_same_file(a: Path, b: Path) -> None:
    if a.resolve() == b.resolve() or (b.exists() and a.exists() and os.path.samefile(a, b)):
        raise ZipmoeError(f"{b}: the output would overwrite the input; choose another file name")


def tensors_by_offset(g: GGUFFile) -> list[Tensor]:
    """Tensors in file order; refuses overlaps (the bytes could not be restored from one copy)."""
    ordered = sorted(g.tensors, key=lambda t: t.file_offset)
    for a, b in zip(ordered, ordered[1:]):
        if b.file_offset < a.file_offset + a.nbytes:
            raise FormatError(f"{g.label}: tensors {a.name} and {b.name} overlap")
    return ordered
