"""Files that appear whole or not at all: written under a temporary name beside their place, synced, then renamed
over it. zipmoe's outputs (convert, unpack: pyzipmoe.file.fileio.atomic_output) and the model store's files
(pyzipmoe.models.blobs._atomic_file) are written this way."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def replacing(dst: Path, mode: int, file_mode: str, *, sync_dir: bool = False) -> Iterator[BinaryIO]:
    """A new file (permissions `mode` less the umask, opened as `file_mode`) that replaces `dst` only once the
    block completes, and is removed on any error or Ctrl-C. sync_dir: also sync dst's directory, so that the
    rename itself survives a crash."""
    tmp = dst.with_name(f".{dst.name}.{secrets.token_hex(4)}.tmp")
    # O_EXCL: never clobber someone else's file
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    try:
        with open(fd, file_mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst)
        if sync_dir:
            fsync_dir(dst.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
