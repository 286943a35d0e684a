"""Writing zipmoe GGUFs exactly as docs/FORMAT.md says (pyzipmoe.file.reader reads them back).

Writing follows llama.cpp's reader (ggml/src/gguf.cpp), which is stricter than the GGUF spec: every
tensor's offset must equal the padded sizes of the tensors before it in tensor-info order, so tensor data
is contiguous and the only freedom is *inside* a tensor. That is how data companions land on 4096-aligned
file offsets: a data companion is padded at its end so that the next one starts on a page, and the
header is padded (key `zipmoe.header_padding`) so that the first one does.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from typing import Any, BinaryIO

from gguf.constants import GGUFValueType

from ..errors import FormatError
from .gguf import GGUF_FIXED_HEADER, align_up, encode_kv, tensor_nbytes
from .integrity import (
    ChainHash,
    INTEGRITY_KEY,
    KIND_COMPANION,
    KIND_HASHED,
    build_integrity,
    integrity_hash,
    integrity_len,
)
from .metadata import PAGE, Slot, fixed_run, encode_header, header_padding


class ZipmoeWriter:
    """Writes a GGUF whose tensors arrive one after the other in tensor-info order.

    The header is written first with placeholder offsets and data companion sizes (fixed-width fields,
    so its length is final) and rewritten by finish(), once the sizes are known.
    """

    def __init__(self, f: BinaryIO, *, kv_raw: bytes, n_kv: int, slots: Sequence[Slot], alignment: int,
                 integrity: bool = False):
        self._f = f
        self._slots = list(slots)
        self._alignment = alignment
        # the integrity record (FORMAT.md) is written as zeros now and filled in by finish()
        self._integrity: list[tuple[int, int]] | None = [] if integrity else None
        self._record_at = 0  # offset of the record's value bytes in self._kv
        if integrity:
            placeholder = [0] * integrity_len(len(self._slots))
            record_kv = encode_kv(INTEGRITY_KEY, GGUFValueType.ARRAY, placeholder, GGUFValueType.UINT64)
            self._record_at = len(kv_raw) + len(record_kv) - 8 * len(placeholder)
            kv_raw, n_kv = kv_raw + record_kv, n_kv + 1
        self._kv = kv_raw + header_padding(kv_raw, n_kv, self._slots, alignment)
        self._n_kv = n_kv + 1
        self._dims: list[tuple[int, ...]] = []
        self._offsets: list[int] = []
        self._pos = 0  # next free byte, relative to the data section
        header = self._header()
        self._header_size = len(header)
        self.data_start = align_up(len(header), alignment)
        f.seek(0)
        f.write(header)
        f.write(bytes(self.data_start - len(header)))

    def _header(self) -> bytes:
        return encode_header(self._kv, self._n_kv, self._slots, self._dims, self._offsets)

    @property
    def file_pos(self) -> int:
        return self.data_start + self._pos

    def write_tensor(self, pieces: Iterable[Any]) -> int:
        """Writes the next tensor's data from buffers and returns its size in bytes (for a data
        companion, including the zero padding that puts the next data companion on a page)."""
        i = len(self._offsets)
        slot = self._slots[i]
        if slot.page_aligned and self.file_pos % PAGE:
            raise AssertionError(f"{slot.name} would start at file offset {self.file_pos}, not on a page")
        n = 0
        hasher = ChainHash() if self._integrity is not None and not slot.page_aligned else None
        for piece in pieces:
            if hasher is not None:
                hasher.update(piece)
            n += self._f.write(piece)
        if self._integrity is not None:
            self._integrity.append((KIND_COMPANION, 0) if hasher is None else (KIND_HASHED, hasher.digest()))
        if slot.page_aligned:
            follow = fixed_run(self._slots, i + 1, self._alignment)
            pad = 0 if follow is None else (-(self.file_pos + n + follow)) % PAGE
            n += self._f.write(bytes(pad))
            dims = (n // tensor_nbytes(slot.ggml_type, (1,)),)
        elif n != slot.nbytes:
            raise FormatError(f"{slot.name}: wrote {n} bytes, expected {slot.nbytes}")
        else:
            dims = slot.dims
        self._offsets.append(self._pos)
        self._dims.append(dims)
        padded = align_up(n, self._alignment)
        self._f.write(bytes(padded - n))
        self._pos += padded
        return n

    def finish(self) -> None:
        if len(self._offsets) != len(self._slots):
            raise AssertionError(f"{len(self._slots) - len(self._offsets)} tensors were not written")
        header = self._header()
        if len(header) != self._header_size:
            raise AssertionError("the final header's size differs from the placeholder's")
        if self._integrity is not None:
            # the metadata is hashed with the record's value as zeros: exactly the header as it is now
            meta_hash = integrity_hash(header + bytes(self.data_start - len(header)))
            record = build_integrity(GGUF_FIXED_HEADER + self._record_at, self.data_start, meta_hash,
                                     self._integrity)
            at = self._record_at
            self._kv = self._kv[:at] + record.tobytes() + self._kv[at + record.nbytes:]
            header = self._header()
        self._f.seek(0)
        self._f.write(header)
        self._f.seek(0, io.SEEK_END)
