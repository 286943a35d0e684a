"""Memory budgets as people write them ("6GiB", "512M", "60%", "auto"), and what a model needs of one.

pyzipmoe.runtime.config carries a budget to the runtime (ZIPMOE_MEMORY_BUDGET); this module validates what a user
gives before it gets there.

A budget covers everything the model keeps resident: its weights that are not experts (read through llama.cpp's
mmap; a token embedding read a row per token only for the rows of a batch, zipmoe_budget_embd_charge), the experts of the
expert tensor in flight (decoded whatever the budget, since its matmul needs them; a prompt may route to all of
them) and the cache tiers, which get the rest. `model_memory` gives the first two, whose sum is the smallest
budget that works.
"""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ZipmoeError

if TYPE_CHECKING:
    from ..file.reader import ZipmoeFile

_NUMBER_AND_UNIT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z%]*)\s*$")  # (to say what is wrong: not a parser)


def total_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


AUTO = "auto"
_WRITE = "write e.g. 6GiB, 512MiB, 60% or auto"


def human_size(n: float) -> str:
    """Bytes in the largest binary unit below 1024 of it ("3.1 MiB", "512 B"): every size zipmoe prints (the
    native runtime's messages write them the same way, zipmoe-config.cpp size_text)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def budget_text(given: str | int | None, nbytes: int) -> str:
    """A budget for a message in its user's units: a size as written ("100KiB" -> "100 KiB"), a percentage or
    "auto" with the bytes it came to ("60% (4.8 GiB)"), bytes given as a number as human_size writes them."""
    if given is None or isinstance(given, int):
        return human_size(nbytes)
    m = _NUMBER_AND_UNIT.match(str(given))
    if m and m.group(2) and m.group(2) != "%":
        return f"{m.group(1)} {m.group(2)}"
    if m and not m.group(2):
        return f"{m.group(1)} bytes" + (f" ({human_size(nbytes)})" if nbytes >= 1024 else "")
    return f"{str(given).strip()} ({human_size(nbytes)})"


def parse_size(text: str) -> int:
    """Bytes from a size as people write it ("6GiB", "512M", "1.5g", "1000000"; units binary, k = 1024): the
    native library's parser (zipmoe_parse_size), the one the runtime reads ZIPMOE_* sizes with. ValueError if it
    is not one, or is more than ZIPMOE_SIZE_MAX (1 EiB)."""
    from .._native import ffi, lib

    out = ffi.new("uint64_t *")
    if "\0" in text or lib.zipmoe_parse_size(text.encode(), out) != lib.ZIPMOE_OK:
        raise ValueError(f"{text!r} is not a size (examples: 8GiB, 512MiB, 1073741824)")
    return int(out[0])


def parse_budget(text: str | int, *, total: int | None = None, model_bytes: int | None = None,
                 held: int = 0) -> int:
    """Bytes from "6GiB", "512MiB", "1000000", "60%" (of `total`, default the machine's memory) or "auto".

    Sizes and percentages are read by the native library (zipmoe_parse_budget), as the runtime reads them.
    "auto" is what this process could allocate now plus what the runtime already holds (`held`), less a safety
    margin, at most `model_bytes` if given (pyzipmoe.runtime.memory.auto_budget). "0" is a budget too: keep no expert, decode on every use.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ZipmoeError(f"memory budget {text} is negative: {_WRITE}")
        return text
    text = str(text)
    if is_auto(text):
        from . import memory  # imported on use: psutil and /proc are read only for "auto"

        return memory.auto_budget(memory.read_memory(), model_bytes, held)
    from .._native import ffi, lib

    if "%" in text and total is None:
        total = total_memory()
    out = ffi.new("uint64_t *")
    if "\0" not in text and lib.zipmoe_parse_budget(text.encode(), min(total or 0, lib.ZIPMOE_SIZE_MAX), out) == 0:
        return int(out[0])
    raise ZipmoeError(_budget_problem(text))


def is_auto(given: str | int | None) -> bool:
    """Whether a budget is "auto" (any case, white space around it): the native library's rule
    (zipmoe_budget_is_auto), the loader's."""
    if not isinstance(given, str) or "\0" in given:
        return False
    from .._native import lib

    return bool(lib.zipmoe_budget_is_auto(given.encode()))


def _budget_problem(text: str) -> str:
    """What is wrong with a budget the native parser refused, in the user's words."""
    m = _NUMBER_AND_UNIT.match(text)
    if not m:
        return f"memory budget {text!r} is not a size{_why_not(text.strip())}: {_WRITE}"
    unit = m.group(2).lower()
    if unit == "%":
        if float(m.group(1)) > 100:
            return f"memory budget {text!r} is more than all of the memory: write at most 100%, or auto"
        return f"memory budget {text!r} has too many digits after the point: write e.g. 60% or 12.5%"
    if unit not in _UNITS:
        return (f"memory budget {text!r} has an unknown unit {m.group(2)!r}: use B, KiB, MiB, GiB, TiB or %, "
                "or write auto")
    return f"memory budget {text!r} is more than zipmoe can address (at most 1 EiB): {_WRITE}"


_UNITS = ("", "b", "k", "kb", "kib", "m", "mb", "mib", "g", "gb", "gib", "t", "tb", "tib")  # (zipmoe_parse_size's)


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

    other_bytes: int      # weights that are not compressed experts, as charged (a token embedding: embd_charged)
    in_flight_bytes: int  # the BF16 experts of the largest expert tensor: decoded at once when a batch routes to all
    expert_bytes: int     # every expert in BF16
    embd_bytes: int = 0   # a token embedding read a row per token, whole (0: none; it is charged in full)
    embd_charged: int = 0  # what other_bytes counts of it

    @property
    def embd_note(self) -> str:
        """What the runtime's messages add where the token embedding is charged for fewer bytes than it has."""
        if self.embd_charged >= self.embd_bytes:
            return ""
        return f" (token_embd: the rows of a batch, {human_size(self.embd_charged)} of {human_size(self.embd_bytes)})"

    @property
    def minimum(self) -> int:
        """The smallest budget that works: the weights that are not experts and one expert tensor in flight."""
        return self.other_bytes + self.in_flight_bytes

    @property
    def whole(self) -> int:
        """A budget that holds every expert decoded: the most a model can use, and what "auto" is capped at."""
        return self.minimum + self.expert_bytes


def model_budget(budget: str | int, need: ModelMemory) -> int:
    """Bytes of a model's budget as a user wrote it: "auto" takes what is free plus what the runtime holds already
    (the same formula as the memory monitor's readings: memory.auto_budget), at most the whole model."""
    if not is_auto(budget):
        return parse_budget(budget)
    from .cache_control import resident_bytes  # what the runtime holds already

    return parse_budget(budget, model_bytes=need.whole, held=resident_bytes())


@dataclass(frozen=True)
class Budget:
    """A model's memory budget, resolved once (resolve_budget): its bytes, and the budget as its user gave it,
    which messages echo and which says whether it follows the memory available ("auto")."""

    nbytes: int
    given: str | int

    @property
    def automatic(self) -> bool:
        return is_auto(self.given)

    @property
    def text(self) -> str:
        """The budget for a message, in its user's units (budget_text)."""
        return budget_text(self.given, self.nbytes)


def resolve_budget(given: str | int, need: ModelMemory) -> Budget:
    """The one resolution of what a user gave for a model's budget ("6GiB", "60%", "auto", bytes; a package's
    PARAMETER memory_budget where the user gave none) into its bytes (model_budget), refused in one line where it
    cannot hold the model's minimum (check_budget). Its callers pass the Budget on: nothing reads the bytes back out
    of the runtime's environment."""
    budget = Budget(model_budget(given, need), given)
    check_budget(budget.nbytes, need, given)
    return budget


def plain_experts(path: str | os.PathLike[str]) -> list[tuple[str, int]] | None:
    """(name, bytes) of each expert tensor of a plain GGUF (blk.N.ffn_{up,gate,down,gate_up}_exps.weight, of any
    type): what the runtime serves from its cache under a memory budget, as stored. None for a zipmoe GGUF."""
    from ..file import gguf as format
    from ..file.metadata import EXPERT_NAME

    g = format.read_gguf(path)
    if g.is_zipmoe:
        return None
    return [(t.name, t.nbytes) for t in g.tensors if EXPERT_NAME.fullmatch(t.name)]


def model_memory(model: ZipmoeFile | str | os.PathLike[str], *, mapped: bool = True) -> ModelMemory:
    """The runtime's own accounting (zipmoe_budget_need_of, as the loader calls it) for a zipmoe GGUF, from its
    header and indexes, or for a plain GGUF, whose expert tensors the runtime serves as stored (each at its own
    size, whatever its type). mapped: llama.cpp maps the file without locking it (its default), so that a token
    embedding with an output matrix of its own is read a row per token and charged for one batch's rows
    (zipmoe_budget_embd_charge); else it is charged whole."""
    from .._native import ffi, lib
    from ..file import gguf as format
    from ..file import reader
    from ..file.metadata import EXPERT_NAME

    if isinstance(model, (str, os.PathLike)) and not (g := format.read_gguf(model)).is_zipmoe:
        label, tensors = str(model), g.tensors
        experts = [t.nbytes for t in tensors if EXPERT_NAME.fullmatch(t.name)]
        served = {t.name for t in tensors if EXPERT_NAME.fullmatch(t.name)}
    else:
        zf = reader.as_zipmoe(model)
        label, tensors = str(zf.path), zf.source.tensors
        experts = [c.source.nbytes for c in zf.compressed]
        served = {c.name for c in zf.compressed}
    other = sum(t.nbytes for t in tensors if t.name not in served)
    by_name = {t.name: t for t in tensors}
    embd, embd_bytes, embd_row = by_name.get("token_embd.weight"), 0, 0
    if mapped and embd is not None and "output.weight" in by_name:
        embd_bytes, embd_row = embd.nbytes, format.tensor_nbytes(embd.ggml_type, embd.dims[:1])
    stores = ffi.new("zipmoe_store_size[]", [{"bf16_bytes": n} for n in experts] or 1)
    need = ffi.new("zipmoe_budget_need *")
    if lib.zipmoe_budget_need_of(stores, len(experts), other, embd_bytes, embd_row, mmap.PAGESIZE, need) != 0:
        raise ZipmoeError(f"{label}: its tensor sizes are out of range for a memory budget")
    return ModelMemory(other_bytes=need.other, in_flight_bytes=need.in_flight, expert_bytes=need.experts,
                       embd_bytes=embd_bytes, embd_charged=need.embd_charged if embd_bytes else 0)


def check_budget(budget: int, need: ModelMemory, given: str | int | None = None) -> None:
    """The runtime's refusal, said before a model is loaded: the budget must hold `need.minimum`. The check and its
    message are the loader's (zipmoe_budget_check); given: the budget as the user wrote it, which the message echoes
    (budget_text)."""
    from .._native import ffi, lib

    said = budget_text(given, budget).encode(errors="replace").replace(b"\0", b"?")
    c_need = ffi.new("zipmoe_budget_need *", {"other": need.other_bytes, "embd_charged": need.embd_charged,
                                              "in_flight": need.in_flight_bytes, "experts": need.expert_bytes,
                                              "minimum": need.minimum})
    msg = ffi.new("char[]", len(said) + 512)
    if lib.zipmoe_budget_check(budget, c_need, need.embd_bytes, said, msg, len(msg)) != lib.ZIPMOE_OK:
        raise ZipmoeError(ffi.string(msg).decode(errors="replace"))
