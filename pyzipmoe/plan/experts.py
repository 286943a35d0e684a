"""The expert tensors a model's runtime serves from its cache, as the planner and the calibration see them, whatever
the file: a zipmoe GGUF's (BF16 and F16 through the split codec, the other types stored raw) or a plain GGUF's (every
expert tensor raw, read from the file as stored).

What differs between them for the planner is one fact per tensor, `split`: an expert stored through the split codec
is decoded whenever it is not kept decoded, and may be kept compressed (warm) or as its sign+mantissa plane (sm); a
raw expert is kept decoded or read from the file, its bytes as they are (the runtime keeps no compressed copy of it:
that copy would be the same bytes), so a read is all it costs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import FormatError

if TYPE_CHECKING:
    from ..file.gguf import GGUFFile
    from ..file.reader import ZipmoeFile

_BLOCK = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class StoredExperts:
    """One expert tensor as the runtime serves it."""

    name: str  # <base>.weight, the store's name (the runtime's plan keys on its "blk.<layer>." prefix)
    block: int  # the layer its name gives; -1 for none
    ggml_type: int
    ne: tuple[int, int, int]  # ggml order: values per row, rows per expert, experts
    expert_size: int  # bytes of one expert decoded, in its own type
    split: bool  # stored through the split codec (a zipmoe file's BF16/F16); False: raw
    regions: tuple[tuple[int, int], ...]  # (file offset, bytes) of each expert as stored: what a cold read reads
    source: Any  # the zipmoe file's CompressedTensor, or the plain file's Tensor

    @property
    def n_expert(self) -> int:
        return self.ne[2]

    @property
    def n_values(self) -> int:
        """Values of one expert (elements)."""
        return self.ne[0] * self.ne[1]

    @property
    def stored_bytes(self) -> int:
        """Every expert's region: what the tensor takes in the file."""
        return sum(size for _, size in self.regions)


@dataclass(frozen=True)
class ModelExperts:
    path: Path
    gguf: GGUFFile  # the file's header (its metadata keys)
    tensors: tuple[StoredExperts, ...]
    dense_bytes: int  # every other tensor of the model
    zipmoe: ZipmoeFile | None  # the parsed zipmoe file; None for a plain GGUF
    codec: str  # the split tensors' codec; "raw" where the file has none (a plain GGUF, a quantized zipmoe one)
    chunk_size: int  # values per chunk of its split tensors (0: none)

    @property
    def plain(self) -> bool:
        return self.zipmoe is None


def block_of(name: str) -> int:
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else -1


def model_experts(model: ZipmoeFile | str | os.PathLike[str]) -> ModelExperts:
    """The expert tensors of a zipmoe or plain GGUF. FormatError/UnsupportedError for a damaged or foreign file
    (as pyzipmoe.file.reader raises them), OSError where it cannot be read."""
    from ..file import gguf as format
    from ..file.codec import RAW_CODEC
    from ..file.metadata import DATA_SUFFIX, EXPERT_NAME, INDEX_SUFFIX, SOURCE_HEADER
    from ..file.reader import ZipmoeFile, open_zipmoe

    if isinstance(model, ZipmoeFile):
        z: ZipmoeFile | None = model
        g = model.gguf
    else:
        g = format.read_gguf(model)
        z = open_zipmoe(model) if g.is_zipmoe else None
    if z is not None:
        tensors = []
        for c in z.compressed:
            info = c.expert.info
            regions = tuple((c.region_file_offset(e), c.expert.span(e).size) for e in range(info.n_expert))
            tensors.append(StoredExperts(c.name, block_of(c.name), info.ggml_type, tuple(info.ne[:3]),
                                         info.expert_size, info.split, regions, c))
        companion = (DATA_SUFFIX, INDEX_SUFFIX)
        dense = sum(t.nbytes for t in z.gguf.tensors if not t.name.endswith(companion) and t.name != SOURCE_HEADER)
        split = any(t.split for t in tensors)
        return ModelExperts(z.path, z.gguf, tuple(tensors), dense, z, z.meta.codec if split else RAW_CODEC,
                            z.meta.chunk_size if split else 0)
    tensors = []
    for t in g.tensors:
        if not EXPERT_NAME.fullmatch(t.name):
            continue
        if len(t.dims) != 3 or t.dims[2] < 1 or t.nbytes % t.dims[2]:
            raise FormatError(f"{g.label}: expert tensor {t.name} of shape {list(t.dims)} is not [values, rows, "
                              "experts]")
        size = t.nbytes // t.dims[2]
        regions = tuple((t.file_offset + e * size, size) for e in range(t.dims[2]))
        tensors.append(StoredExperts(t.name, block_of(t.name), t.ggml_type, (t.dims[0], t.dims[1], t.dims[2]), size,
                                     False, regions, t))
    served = {t.name for t in tensors}
    dense = sum(t.nbytes for t in g.tensors if t.name not in served)
    return ModelExperts(Path(model), g, tuple(tensors), dense, None, RAW_CODEC, 0)
