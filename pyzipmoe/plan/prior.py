"""Prior files: a model's expert popularity learned in earlier runs, which the eviction policy starts from
(ZIPMOE_PRIOR; docs/FORMAT.md, "Priors"; docs/cache-and-planner.md, "Priors across prompts").

A prior file is little-endian: the magic "ZMPRIOR1" (8 bytes), uint32 n_layer, uint32 n_expert, then n_layer x
n_expert uint64 counts, layer-major, layer N being the model's block N (blk.N.; blocks without experts hold zeros).
The native library reads it (zipmoe_prior_parse, zipmoe_cache_seed_prior); this module writes it, from counts or
from a recorded routing file (pyzipmoe.plan.trace), and reads it back through the library's own check. A stored
model's kept prior learns from its runs: each leaves a record (ZIPMOE_PRIOR_RECORD, record_path), which learn merges
in with decay.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
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
    prior = _kept_place(model_path)
    return prior if prior is not None and prior.is_file() else None


RUN_INFIX = ".run-"  # priors/sha256-<hex>.run-<pid>-<random>: a run's record (ZIPMOE_PRIOR_RECORD), not merged yet
# The kept prior forgets at a rate set in routings (one token routed to k experts of a layer is k routings): before
# a run's record is added, the kept counts are scaled by 0.5 ** (the run's routings in its busiest layer /
# HALF_LIFE_ROUTINGS). 65536 routings are 8192 tokens of a top-8 model, 16384 of a top-4 one: a few dozen
# conversations. A model's popularity moves as what it is used for moves (another language, code rather than chat);
# counts without decay would let a long calibration outvote every later run, and a half-life in routings rather than
# runs lets a one-line run weigh what it routed, not as much as a long one.
HALF_LIFE_ROUTINGS = 65536


def _kept_place(model_path: str | os.PathLike[str]) -> Path | None:
    """Where the prior of a stored model blob (blobs/sha256-<hex>) is kept, whether or not it exists; None for any
    other file."""
    path = Path(model_path)
    if path.parent.name != "blobs" or not path.name.startswith("sha256-"):
        return None
    return path.parent.parent / PRIORS_DIR / path.name


def record_path(model_path: str | os.PathLike[str]) -> Path | None:
    """A fresh place for a run of a stored model blob to leave its expert uses (ZIPMOE_PRIOR_RECORD: the native
    library writes a prior file there as the model unloads), which learn() merges into the kept prior; None for a
    file that is not a stored model's. Creates the priors folder."""
    kept = _kept_place(model_path)
    if kept is None:
        return None
    kept.parent.mkdir(parents=True, exist_ok=True)
    return kept.with_name(f"{kept.name}{RUN_INFIX}{os.getpid()}-{secrets.token_hex(4)}")


def runs_path(kept: Path) -> Path:
    """The kept prior's note of how many runs it learned from (JSON {"runs": N}), beside it."""
    return kept.with_name(kept.name + ".json")


def kept_runs(kept: Path) -> int:
    """How many runs the kept prior learned from since it was kept by a calibration (0 without a note)."""
    try:
        return int(json.loads(runs_path(kept).read_bytes())["runs"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def merge(kept: np.ndarray | None, run: np.ndarray) -> np.ndarray:
    """The kept counts after a run's: the kept ones decayed by the run's routings (HALF_LIFE_ROUTINGS), plus the
    run's."""
    run = run.astype(np.uint64)
    if kept is None:
        return run
    decay = 0.5 ** (float(run.sum(axis=1).max()) / HALF_LIFE_ROUTINGS)
    return np.rint(kept.astype(np.float64) * decay).astype(np.uint64) + run


def learn(model_path: str | os.PathLike[str]) -> Path | None:
    """Merges the records that runs of a stored model blob left (record_path) into its kept prior, oldest first,
    under a lock beside it (concurrent runs and shows), and removes them; a record that is damaged, of another
    shape or of no routing is dropped. A damaged kept prior is left as it is, for the load to refuse with its one line. The kept
    prior's path, if it has one now."""
    kept = _kept_place(model_path)
    if kept is None or not kept.parent.is_dir():
        return None
    pattern = re.compile(re.escape(kept.name + RUN_INFIX) + r"[0-9]+-[0-9a-f]+")
    _drop_orphan_writes(kept)
    if not any(pattern.fullmatch(p.name) for p in kept.parent.glob(kept.name + RUN_INFIX + "*")):
        return kept if kept.is_file() else None
    with open(kept.with_name(kept.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        runs = sorted((p for p in kept.parent.glob(kept.name + RUN_INFIX + "*") if pattern.fullmatch(p.name)),
                      key=lambda p: p.stat().st_mtime_ns)
        try:
            counts = load(kept) if kept.is_file() else None
        except PriorFileError:
            return kept
        learned = 0
        for run in runs:
            try:
                one = load(run)
            except PriorFileError:
                continue
            if not one.any():
                continue  # a run that routed nothing (a load that failed after its configuration): no run
            if counts is None or one.shape == counts.shape:
                counts = merge(counts, one)
                learned += 1
        if counts is not None and learned:
            n_runs = kept_runs(kept) + learned
            save(kept, counts)
            with replacing(runs_path(kept), 0o644, "wb") as f:
                f.write(json.dumps({"runs": n_runs}).encode())
        for run in runs:
            run.unlink(missing_ok=True)
    return kept if kept.is_file() else None


def _drop_orphan_writes(kept: Path) -> None:
    """Removes the temporary files of records whose writer died while writing them (the native library writes
    RECORD.tmp<pid>, then renames it): nothing else would, as they match no record's name."""
    orphan = re.compile(re.escape(kept.name + RUN_INFIX) + r"[0-9]+-[0-9a-f]+\.tmp([0-9]+)")
    for p in kept.parent.glob(kept.name + RUN_INFIX + "*.tmp*"):
        if (m := orphan.fullmatch(p.name)) and not _alive(int(m.group(1))):
            p.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's process: alive)
        return True
    return True


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
