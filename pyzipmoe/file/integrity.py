"""The integrity record of a zipmoe GGUF (`zipmoe.integrity`, docs/FORMAT.md): the chained hash, building the
record, parsing it, and checking a file against it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGUFValueType

from . import codec
from ..errors import ChecksumError, FormatError, UnsupportedError
from .gguf import GGUFFile, pread_exact
from .metadata import DATA_SUFFIX


INTEGRITY_KEY = "zipmoe.integrity"
INTEGRITY_MAGIC = 0x31544E4945504D5A  # the bytes "ZMPEINT1"
INTEGRITY_VERSION = 1
INTEGRITY_BLOCK = 1 << 20  # block size of the chained hash
INTEGRITY_HEADER = 6  # magic, version, self offset, metadata size, metadata hash, tensor count
KIND_HASHED = 1  # the tensor's bytes are hashed
KIND_COMPANION = 2  # an expert data companion: its chunks carry their own checksums


# ------------------------------------------------------------------------------------- integrity record


def integrity_hash(data: Any, h: int = 0) -> int:
    """The chained hash of FORMAT.md: h = XXH3_64(block, seed = h) over 1 MiB blocks, from h = 0."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), INTEGRITY_BLOCK):
        h = codec.checksum(view[start:start + INTEGRITY_BLOCK], h)
    return h


class ChainHash:
    """integrity_hash of a stream of pieces of any sizes."""

    def __init__(self) -> None:
        self._h = 0
        self._pending = bytearray()

    def update(self, piece: Any) -> None:
        view = memoryview(piece).cast("B")
        if self._pending:
            take = min(len(view), INTEGRITY_BLOCK - len(self._pending))
            self._pending += view[:take]
            view = view[take:]
            if len(self._pending) < INTEGRITY_BLOCK:
                return
            self._h = codec.checksum(self._pending, self._h)
            self._pending.clear()
        whole = len(view) // INTEGRITY_BLOCK * INTEGRITY_BLOCK
        self._h = integrity_hash(view[:whole], self._h)
        self._pending += view[whole:]

    def digest(self) -> int:
        return codec.checksum(self._pending, self._h) if self._pending else self._h


def integrity_len(n_tensors: int) -> int:
    return INTEGRITY_HEADER + 2 * n_tensors + 1


def build_integrity(self_offset: int, meta_size: int, meta_hash: int,
                    tensors: Sequence[tuple[int, int]]) -> np.ndarray:
    """The `zipmoe.integrity` value: uint64 elements, its own checksum last."""
    rec = np.zeros(integrity_len(len(tensors)), "<u8")
    rec[:INTEGRITY_HEADER] = [INTEGRITY_MAGIC, INTEGRITY_VERSION, self_offset, meta_size, meta_hash, len(tensors)]
    if tensors:
        rec[INTEGRITY_HEADER:-1] = np.asarray(tensors, np.uint64).reshape(-1)
    rec[-1] = codec.checksum(rec[:-1])
    return rec


@dataclass(frozen=True)
class IntegrityRecord:
    """A parsed `zipmoe.integrity` value, its shape and own checksum validated (not yet the file)."""

    raw: np.ndarray  # uint64 elements as stored
    self_offset: int
    meta_size: int
    meta_hash: int
    kinds: tuple[int, ...]
    hashes: tuple[int, ...]

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> IntegrityRecord | None:
        entry = g.kv.get(INTEGRITY_KEY)
        if entry is None:
            return None
        label = f"{g.label}: {INTEGRITY_KEY}"
        if entry.vtype != GGUFValueType.ARRAY or entry.etype != GGUFValueType.UINT64:
            raise FormatError(f"{label} has the wrong type: the record is damaged")
        rec = np.asarray(entry.value, "<u8")
        if rec.size < INTEGRITY_HEADER + 1 or codec.checksum(rec[:-1]) != int(rec[-1]):
            raise ChecksumError(f"{label}: the record is damaged (it does not match its own checksum)")
        magic, version, self_offset, meta_size, meta_hash, n = (int(x) for x in rec[:INTEGRITY_HEADER])
        if magic != INTEGRITY_MAGIC:
            raise FormatError(f"{label}: the record is damaged (bad magic)")
        if version != INTEGRITY_VERSION:
            raise UnsupportedError(f"{label}: version {version} is not supported (this zipmoe reads "
                                   f"{INTEGRITY_VERSION})")
        if rec.size != integrity_len(n):
            raise FormatError(f"{label}: the record is damaged (its length does not match its tensor count)")
        pairs = rec[INTEGRITY_HEADER:-1].reshape(n, 2)
        return cls(rec, self_offset, meta_size, meta_hash, tuple(int(k) for k in pairs[:, 0]),
                   tuple(int(h) for h in pairs[:, 1]))


def _hash_file_range(fd: int, offset: int, size: int, label: str, hole: bytes = b"",
                     hole_at: int = 0) -> tuple[int, bool]:
    """integrity_hash of [offset, offset + size) of fd, with the bytes at hole_at (which must equal `hole`)
    hashed as zeros. Returns the hash and whether the hole matched."""
    h, matched = 0, True
    for start in range(0, size, INTEGRITY_BLOCK):
        a = offset + start
        block = bytearray(pread_exact(fd, min(INTEGRITY_BLOCK, size - start), a, label))
        lo, hi = max(hole_at, a), min(hole_at + len(hole), a + len(block))
        if lo < hi:
            matched &= block[lo - a:hi - a] == hole[lo - hole_at:hi - hole_at]
            block[lo - a:hi - a] = bytes(hi - lo)
        h = codec.checksum(block, h)
    return h, matched


def check_integrity(path: str | os.PathLike[str], g: GGUFFile, record: IntegrityRecord | None) -> int:
    """Checks the file against its integrity record, as llama.cpp's loader does (patches/0001): the metadata
    and every hashed tensor. Returns the number of bytes hashed; raises a one-line FormatError (ChecksumError
    for damaged bytes) that names what is damaged."""
    label = str(path)
    if record is None:
        raise FormatError(f"{label}: no {INTEGRITY_KEY} record (written by an older zipmoe): the metadata and "
                          "dense tensors cannot be checked; convert the source again (`zipmoe unpack`, then "
                          "`zipmoe convert`)")
    if len(record.kinds) != len(g.tensors):
        raise FormatError(f"{label}: the file has {len(g.tensors)} tensors but {INTEGRITY_KEY} lists "
                          f"{len(record.kinds)}: the tensor list is damaged")
    if record.meta_size != g.data_start:
        raise FormatError(f"{label}: the metadata is damaged: the tensor data starts at byte {g.data_start}, "
                          f"{INTEGRITY_KEY} recorded {record.meta_size}")
    rec_bytes = record.raw.tobytes()
    if record.self_offset + len(rec_bytes) > record.meta_size:
        raise FormatError(f"{label}: the {INTEGRITY_KEY} record is damaged (it places itself outside the metadata)")
    fd = os.open(path, os.O_RDONLY)
    try:
        h, matched = _hash_file_range(fd, 0, record.meta_size, label, rec_bytes, record.self_offset)
        if not matched:
            raise FormatError(f"{label}: the {INTEGRITY_KEY} record is damaged (it is not where it says it is)")
        if h != record.meta_hash:
            raise ChecksumError(f"{label}: the metadata (header, key/value pairs and tensor infos: bytes "
                                f"0-{record.meta_size}) is damaged: it does not match the checksum recorded at "
                                "conversion")
        hashed = record.meta_size
        for t, kind, want in zip(g.tensors, record.kinds, record.hashes):
            if kind == KIND_COMPANION:
                if not t.name.endswith(DATA_SUFFIX):
                    raise FormatError(f"{label}: the tensor list is damaged: {INTEGRITY_KEY} lists {t.name} as a "
                                      "data companion")
                continue
            if kind != KIND_HASHED:
                raise FormatError(f"{label}: the {INTEGRITY_KEY} record is damaged (unknown kind {kind} for {t.name})")
            got, _ = _hash_file_range(fd, t.file_offset, t.nbytes, label)
            if got != want:
                raise ChecksumError(f"{label}: tensor {t.name} is damaged: its bytes do not match the checksum "
                                    "recorded at conversion")
            hashed += t.nbytes
    finally:
        os.close(fd)
    return hashed
