"""Memory budgets as people write them ("6GiB", "512M", "60%", "auto"), and what a model needs of one.

pyzipmoe.runtime.config carries a budget to the runtime (ZIPMOE_MEMORY_BUDGET); this module validates what a user
gives before it gets there.

A budget covers everything the model keeps resident: its weights that are not experts (read through llama.cpp's
mmap; a token embedding read a row per token only for the rows of a batch, embd_charge), the experts of the
expert tensor in flight (decoded whatever the budget, since its matmul needs them; a prompt may route to all of
them) and the cache tiers, which get the rest. `model_memory` gives the first two, whose sum is the smallest
budget that works.
"""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass

from ..errors import ZipmoeError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z%]*)\s*$")


def total_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


AUTO = "auto"
_WRITE = "write e.g. 6GiB, 512MiB, 60% or auto"


def parse_budget(text: str | int, *, total: int | None = None, model_bytes: int | None = None) -> int:
    """Bytes from "6GiB", "512MiB", "1000000", "60%" (of `total`, default the machine's memory) or "auto".

    "auto" is what this process could allocate now less a safety margin, at most `model_bytes` if given
    (pyzipmoe.runtime.memory.auto_budget). "0" is a budget too: keep no expert, decode on every use.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ZipmoeError(f"memory budget {text} is negative: {_WRITE}")
        return text
    if str(text).strip().lower() == AUTO:
        from . import memory  # imported on use: psutil and /proc are read only for "auto"

        return memory.auto_budget(memory.read_memory(), model_bytes)
    m = _SIZE.match(str(text))
    if not m:
        raise ZipmoeError(f"memory budget {text!r} is not a size{_why_not(str(text).strip())}: {_WRITE}")
    value, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        if value > 100:
            raise ZipmoeError(f"memory budget {text!r} is more than all of the memory: write at most 100%, or auto")
        return int(value / 100 * (total if total is not None else total_memory()))
    if unit not in _UNITS:
        raise ZipmoeError(f"memory budget {text!r} has an unknown unit {m.group(2)!r}: use B, KiB, MiB, GiB, TiB "
                          "or %, or write auto")
    return int(value * _UNITS[unit])


def _why_not(text: str) -> str:
    """The common mistakes named, so that the message says more than "not a size"."""
    if not text:
        return " (it is empty)"
    if text.startswith("-"):
        return " (it is negative)"
    return ""


@dataclass(frozen=True)
class ModelMemory:
    """What a zipmoe model keeps resident whatever its budget, in bytes."""

    other_bytes: int      # weights that are not compressed experts, as charged (a token embedding: embd_charge)
    in_flight_bytes: int  # the BF16 experts of the largest expert tensor: decoded at once when a batch routes to all
    expert_bytes: int     # every expert in BF16
    embd_bytes: int = 0   # a token embedding read a row per token, whole (0: none; it is charged in full)
    embd_charged: int = 0  # what other_bytes counts of it

    @property
    def embd_note(self) -> str:
        """What the runtime's messages add where the token embedding is charged for fewer bytes than it has."""
        if self.embd_charged >= self.embd_bytes:
            return ""
        charged, whole = self.embd_charged / (1 << 20), self.embd_bytes / (1 << 20)
        return f" (token_embd: the rows of a batch, {charged:.0f} MiB of {whole:.0f} MiB)"

    @property
    def minimum(self) -> int:
        """The smallest budget that works: the weights that are not experts and one expert tensor in flight."""
        return self.other_bytes + self.in_flight_bytes

    @property
    def whole(self) -> int:
        """A budget that holds every expert decoded: the most a model can use, and what "auto" is capped at."""
        return self.minimum + self.expert_bytes


def model_budget(budget: str | int, need: ModelMemory) -> int:
    """Bytes of a model's budget as a user wrote it: "auto" takes what is free, at most the whole model."""
    return parse_budget(budget, model_bytes=need.whole) if str(budget) == AUTO else parse_budget(budget)


EMBD_BATCH_ROWS = 2048  # llama.cpp's default n_batch: the most distinct rows one batch reads of the token embedding


def embd_charge(embd_bytes: int, row_bytes: int, page: int = mmap.PAGESIZE) -> int:
    """What the budget charges for a mapped token embedding read a row per token: the rows of one batch, each
    spanning its pages (an unaligned row touches one page more), at most the table. The rest of the table is clean
    page cache the kernel may take back at any time. The runtime's embd_charge (zipmoe-llama.cpp) says the same."""
    if row_bytes <= 0:
        return embd_bytes
    return min(embd_bytes, EMBD_BATCH_ROWS * (-(-row_bytes // page) + 1) * page)


def model_memory(path: str | os.PathLike[str], *, mapped: bool = True) -> ModelMemory:
    """The runtime's own accounting (zipmoe_llama_configure) for a zipmoe GGUF, from its header and indexes.
    mapped: llama.cpp maps the file without locking it (its default), so that a token embedding with an output
    matrix of its own is read a row per token and charged by embd_charge; else it is charged whole."""
    from ..file import gguf as format
    from ..file import reader

    zf = reader.open_zipmoe(path)
    compressed = {c.name for c in zf.compressed}
    other = sum(t.nbytes for t in zf.source.tensors if t.name not in compressed)
    by_name = {t.name: t for t in zf.source.tensors}
    embd, embd_bytes, embd_charged = by_name.get("token_embd.weight"), 0, 0
    if mapped and embd is not None and "output.weight" in by_name:
        embd_bytes = embd.nbytes
        embd_charged = embd_charge(embd.nbytes, format.tensor_nbytes(embd.ggml_type, embd.dims[:1]))
        other += embd_charged - embd_bytes
    return ModelMemory(other_bytes=other, in_flight_bytes=max((c.source.nbytes for c in zf.compressed), default=0),
                       expert_bytes=sum(c.source.nbytes for c in zf.compressed), embd_bytes=embd_bytes,
                       embd_charged=embd_charged)


def check_budget(budget: int, need: ModelMemory) -> None:
    """The runtime's refusal, said before a model is loaded: the budget must hold `need.minimum`."""
    if budget < need.minimum:
        mib = 1 << 20
        raise ZipmoeError(
            f"memory budget {budget / mib:.0f} MiB is too small for this model: it needs at least "
            f"{need.minimum / mib:.0f} MiB ({need.other_bytes / mib:.0f} MiB of weights that are not experts"
            f"{need.embd_note} + "
            f"{need.in_flight_bytes / mib:.0f} MiB for the experts of one expert tensor in flight); raise "
            "--memory-budget")
