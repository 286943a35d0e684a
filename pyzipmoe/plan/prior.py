"""Prior files: a model's expert popularity learned in earlier runs, which the eviction policy starts from
(ZIPMOE_PRIOR; docs/FORMAT.md, "Priors"; docs/cache-and-planner.md, "Priors across prompts").

A prior file is little-endian: the magic "ZMPRIOR1" (8 bytes), uint32 n_layer, uint32 n_expert, then n_layer x
n_expert uint64 counts, layer-major, layer N being the model's block N (blk.N.; blocks without experts hold zeros).
The native library reads it (zipmoe_prior_parse, zipmoe_cache_seed_prior); this module writes it, from counts or
from a recorded routing file (pyzipmoe.plan.trace), and reads it back through the library's own check.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from ..atomic import replacing
from .inputs import PlanInputError
from .trace import Routing

MAGIC = b"ZMPRIOR1"  # zipmoe-cache.h's ZIPMOE_PRIOR_MAGIC
HEADER = struct.Struct("<8sII")


PRIORS_DIR = "priors"  # a models directory's (pyzipmoe.models.directory): priors/sha256-<hex> beside blobs/


def kept_prior(model_path: str | os.PathLike[str]) -> Path | None:
    """The prior kept for a stored model blob (a model's file in a models directory: blobs/sha256-<hex>), if it has
    one; None for any other file. What the runtime settings pass as ZIPMOE_PRIOR (pyzipmoe.runtime.controller)."""
    path = Path(model_path)
    if path.parent.name != "blobs" or not path.name.startswith("sha256-"):
        return None
    prior = path.parent.parent / PRIORS_DIR / path.name
    return prior if prior.is_file() else None


class PriorFileError(PlanInputError):
    """A prior file that cannot be used."""


def encode(counts: np.ndarray) -> bytes:
    """A prior file's bytes for counts (n_layer, n_expert) of non-negative integers."""
    counts = np.asarray(counts)
    if counts.ndim != 2 or 0 in counts.shape or not np.issubdtype(counts.dtype, np.integer):
        raise PriorFileError(f"prior: counts must be integers (n_layer, n_expert), got {counts.dtype} shape "
                             f"{counts.shape}")
    if counts.min() < 0:
        raise PriorFileError("prior: counts must not be negative")
    n_layer, n_expert = counts.shape
    return HEADER.pack(MAGIC, n_layer, n_expert) + counts.astype("<u8").tobytes()


def decode(data: bytes, what: str = "prior") -> np.ndarray:
    """The counts (n_layer, n_expert), uint64, of a prior file's bytes, checked as the runtime checks them."""
    from .._native import ffi, lib

    n_layer, n_expert = ffi.new("uint32_t *"), ffi.new("uint32_t *")
    if lib.zipmoe_prior_parse(data, len(data), n_layer, n_expert) != lib.ZIPMOE_OK:
        if not data.startswith(MAGIC):
            raise PriorFileError(f"{what}: not a prior file (no {MAGIC.decode()} magic)")
        raise PriorFileError(f"{what}: the prior file is damaged ({len(data)} bytes, not those of its own layers "
                             f"and experts)")
    return np.frombuffer(data, "<u8", offset=HEADER.size).reshape(n_layer[0], n_expert[0]).astype(np.uint64)


def save(path: str | os.PathLike[str], counts: np.ndarray) -> None:
    """Writes a prior file of counts (n_layer, n_expert) to path, atomically."""
    data = encode(counts)
    with replacing(Path(path), 0o644, "wb") as f:
        f.write(data)


def load(path: str | os.PathLike[str]) -> np.ndarray:
    """A prior file's counts (n_layer, n_expert); PriorFileError saying what is wrong with one that cannot be used."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise PriorFileError(f"prior file {path}: cannot be read ({e.strerror or e})") from None
    return decode(data, f"prior file {path}")


def from_routing(routing: Routing) -> np.ndarray:
    """A prior's counts from a recorded routing: per block (the model's, blk.N.), how many steps routed to each
    expert; blocks without experts hold zeros."""
    n_block = int(routing.layers.max()) + 1
    counts = np.zeros((n_block, routing.n_expert), np.uint64)
    counts[routing.layers] = routing.counts().sum(axis=0).astype(np.uint64)
    return counts
