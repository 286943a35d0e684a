"""Recorded routing: which experts each step of a run routed to, per MoE layer, in token order (docs/FORMAT.md,
"Recorded routing").

A file is an .npz (numpy's zip of arrays, no pickles) with these keys:

    format   str, "zipmoe-routing"
    version  int, 1
    routed   bool [n_steps, n_layer, n_expert]: step t routed layer i's expert e
    layers   int32 [n_layer]: the model's block index of each MoE layer (blk.N.), increasing
    tokens   int32 [n_steps]: the tokens a step covered (1 for a generated token; a prompt's batch is one step, the
             union of its rows, as the runtime's routing log keeps it). A one-token step routes 1..k experts in every
             layer; a prompt's step may route none in a layer (llama.cpp computes the last layer only for the rows
             whose logits are wanted, the prompt's last token)
    k        int, the experts each token routes to (n_expert_used)

A step is one invocation of each layer's expert tensors: what the cache sees at once. The planner (`zipmoe plan
--trace`) reads the steps as activation counts; tools/bench/bench_replay.py replays them through the cache.
"""

from __future__ import annotations

import io
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..atomic import replacing
from .inputs import UNREADABLE, PlanInputError, load_numpy

FORMAT = "zipmoe-routing"
VERSION = 1
KEYS = ("format", "version", "routed", "layers", "tokens", "k")


class RoutingFileError(PlanInputError):
    """A recorded-routing file that cannot be used."""


@dataclass(frozen=True)
class Routing:
    """A run's routing in token order; validated on construction."""

    routed: np.ndarray  # bool [n_steps, n_layer, n_expert]
    layers: np.ndarray  # int32 [n_layer]
    tokens: np.ndarray  # int32 [n_steps]
    k: int

    def __post_init__(self) -> None:
        problem = _problem(self.routed, self.layers, self.tokens, self.k)
        if problem:
            raise RoutingFileError(f"routing: {problem}")

    @property
    def n_steps(self) -> int:
        return int(self.routed.shape[0])

    @property
    def n_layer(self) -> int:
        return int(self.routed.shape[1])

    @property
    def n_expert(self) -> int:
        return int(self.routed.shape[2])

    def steps(self, layer: int) -> list[np.ndarray]:
        """The experts each step routed to in MoE layer `layer` (an index into `layers`), as int32 ids."""
        return [np.flatnonzero(row).astype(np.int32) for row in self.routed[:, layer]]

    def counts(self) -> np.ndarray:
        """Activation counts shaped as a trace's (n_steps, n_layer, n_expert): a step counts one per routed expert
        (a prompt's batch too, whose rows' counts the log does not keep)."""
        return self.routed.astype(np.int64)


def _problem(routed: np.ndarray, layers: np.ndarray, tokens: np.ndarray, k: int) -> str | None:
    if routed.dtype != bool or routed.ndim != 3:
        return f"routed must be bool [n_steps, n_layer, n_expert], got {routed.dtype} shape {routed.shape}"
    n_steps, n_layer, n_expert = routed.shape
    if n_layer < 1 or n_expert < 1:
        return f"routed has no layers or no experts (shape {routed.shape})"
    if layers.shape != (n_layer,) or not np.issubdtype(layers.dtype, np.integer):
        return f"layers must be {n_layer} integers (one per layer of routed), got {layers.dtype} shape {layers.shape}"
    if n_layer and (layers.min() < 0 or np.any(np.diff(layers) <= 0)):
        return f"layers must be increasing block indices >= 0, got {layers.tolist()}"
    if tokens.shape != (n_steps,) or not np.issubdtype(tokens.dtype, np.integer):
        return f"tokens must be {n_steps} integers (one per step), got {tokens.dtype} shape {tokens.shape}"
    if n_steps and tokens.min() < 1:
        return f"every step covers at least one token (found {tokens.min()})"
    if not 1 <= k <= n_expert:
        return f"k must be in 1..{n_expert} (the experts a token routes to), got {k}"
    routed_per_step = routed.sum(axis=2)
    empty = (routed_per_step < 1) & (tokens[:, None] == 1)
    if n_steps and empty.any():
        t, i = np.argwhere(empty)[0]
        return f"step {t} (one token) routed no expert in layer {i}"
    one_token = tokens == 1
    if np.any(routed_per_step[one_token] > k):
        t = int(np.flatnonzero(one_token)[np.argwhere(routed_per_step[one_token] > k)[0][0]])
        return f"step {t} covers one token but routed more than k={k} experts"
    return None


def save(path: str | os.PathLike[str], routing: Routing) -> None:
    """Writes `routing` to `path` atomically (compressed .npz)."""
    buf = io.BytesIO()
    np.savez_compressed(buf, format=np.array(FORMAT), version=np.array(VERSION, np.int32), routed=routing.routed,
                        layers=routing.layers.astype(np.int32), tokens=routing.tokens.astype(np.int32),
                        k=np.array(routing.k, np.int32))
    with replacing(Path(path), 0o644, "wb") as f:
        f.write(buf.getvalue())


def is_routing_file(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is an .npz that says it is recorded routing (whatever else is wrong with it)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return isinstance(z, np.lib.npyio.NpzFile) and "format" in z.files and str(z["format"]) == FORMAT
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, AttributeError, TypeError):
        return False


def load(path: str | os.PathLike[str]) -> Routing:
    """Reads a recorded-routing file; RoutingFileError saying what is wrong with one that cannot be used."""
    unreadable = (*UNREADABLE, OSError)
    z = load_numpy(path, lambda why: RoutingFileError(f"routing file {path}: {why}"))
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise RoutingFileError(f"routing file {path}: a single .npy array, expected an .npz with keys "
                               f"{', '.join(KEYS)}")
    with z:
        missing = [key for key in KEYS if key not in z.files]
        if missing:
            raise RoutingFileError(f"routing file {path}: missing key(s) {', '.join(missing)} (keys: "
                                   f"{', '.join(z.files) or 'none'}); expected {', '.join(KEYS)}")
        try:
            arrays = {key: z[key] for key in KEYS}
        except unreadable as e:  # a damaged or pickled member
            raise RoutingFileError(f"routing file {path}: a member cannot be read ({e})") from None
    if arrays["format"].shape != () or str(arrays["format"]) != FORMAT:
        raise RoutingFileError(f"routing file {path}: format is {arrays['format']!r}, expected {FORMAT!r}")
    for key in ("version", "k"):
        if arrays[key].shape != () or not np.issubdtype(arrays[key].dtype, np.integer):
            raise RoutingFileError(f"routing file {path}: {key} must be one integer, got {arrays[key]!r}")
    if int(arrays["version"]) != VERSION:
        raise RoutingFileError(f"routing file {path}: version {int(arrays['version'])}; this zipmoe reads version "
                               f"{VERSION}")
    problem = _problem(arrays["routed"], arrays["layers"], arrays["tokens"], int(arrays["k"]))
    if problem:
        raise RoutingFileError(f"routing file {path}: {problem}")
    return Routing(routed=arrays["routed"], layers=arrays["layers"].astype(np.int32),
                   tokens=arrays["tokens"].astype(np.int32), k=int(arrays["k"]))


def from_log(logs: dict[int, np.ndarray], tokens: np.ndarray, k: int) -> Routing:
    """A Routing from per-block routing logs (block -> bool [steps, n_expert], oldest first, all of one length, as
    pyzipmoe.runtime.cache_control.live_routing reads them) and the tokens of each step."""
    if not logs:
        raise RoutingFileError("routing: no MoE layer logged any step")
    blocks = sorted(logs)
    lengths = {b: logs[b].shape[0] for b in blocks}
    if len(set(lengths.values())) != 1:
        raise RoutingFileError(f"routing: the layers logged different numbers of steps ({lengths})")
    routed = np.stack([np.asarray(logs[b], bool) for b in blocks], axis=1)
    return Routing(routed=routed, layers=np.asarray(blocks, np.int32), tokens=np.asarray(tokens, np.int32), k=k)


def planner_inputs(routing: Routing, n_layer: int, n_expert: int, n_expert_used: int, layers: tuple[int, ...],
                   label: str) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """What the planner reads from a recording of a model of this geometry: activation counts [n_layer, n_expert]
    (each step's routed experts count one) and each MoE block's routing in order (block -> bool [steps, n_expert],
    as the runtime's log gives it). RoutingFileError for a recording of another model."""
    if routing.n_expert != n_expert or routing.k != n_expert_used:
        raise RoutingFileError(f"{label}: recorded with {routing.n_expert} experts, top-{routing.k}; the model has "
                               f"{n_expert}, top-{n_expert_used}")
    if tuple(int(b) for b in routing.layers) != tuple(layers):
        raise RoutingFileError(f"{label}: recorded MoE layers {routing.layers.tolist()}; the model's are "
                               f"{list(layers)}")
    counts = np.zeros((n_layer, n_expert), np.float64)
    counts[list(layers)] = routing.routed.sum(axis=0)
    return counts, {int(b): routing.routed[:, i] for i, b in enumerate(routing.layers)}
