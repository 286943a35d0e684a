"""The sizes convert and inspect report: per expert tensor (its size, compressed size and entropy floor) and per
group of tensors (ffn_up_exps, ..., the rest of the file, the whole file).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from . import codec as zcodec
from .gguf import GGML_TYPE_BF16, type_name


@dataclass(frozen=True)
class TensorStats:
    """Sizes of one expert tensor; zipmoe_bytes is None while it is not compressed. bf16_bytes is the source
    tensor's size, whatever its type; exponent_entropy the entropy of its code bytes (exponents of BF16, code bytes
    of F16), or of all its bytes for byte-layout types."""

    name: str
    dims: tuple[int, ...]
    bf16_bytes: int
    zipmoe_bytes: int | None
    exponent_entropy: float
    ggml_type: int = GGML_TYPE_BF16

    @property
    def split(self) -> bool:
        layout = zcodec.type_layout(self.ggml_type)
        return layout is not None and layout.split

    @property
    def floor(self) -> float:
        """Smallest size fraction an order-0 code can reach: for a split type 8 raw bits plus H(code byte) bits of 16;
        for a byte-layout type H(byte) bits of 8 (what entropy coding its bytes could reach; they are stored raw)."""
        return (8 + self.exponent_entropy) / 16 if self.split else self.exponent_entropy / 8

    @property
    def ratio(self) -> float | None:
        return None if self.zipmoe_bytes is None else self.zipmoe_bytes / self.bf16_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "dims": list(self.dims), "type": type_name(self.ggml_type), "floor": self.floor,
                "ratio": self.ratio, "floor_gap_pct": _gap_pct(self.ratio, self.floor)}


@dataclass(frozen=True)
class SizeRow:
    """A line of the size table: a group of tensors, or the rest of the file, or the whole file."""

    label: str
    n_tensors: int
    bf16_bytes: int
    zipmoe_bytes: int | None
    floor_bytes: float

    @property
    def ratio(self) -> float | None:
        return None if self.zipmoe_bytes is None or not self.bf16_bytes else self.zipmoe_bytes / self.bf16_bytes

    @property
    def floor(self) -> float:
        return self.floor_bytes / self.bf16_bytes if self.bf16_bytes else 1.0

    @property
    def floor_gap_pct(self) -> float | None:
        return _gap_pct(self.ratio, self.floor)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "floor": self.floor, "floor_gap_pct": self.floor_gap_pct}


def _gap_pct(ratio: float | None, floor: float) -> float | None:
    """How far the achieved size fraction is above the entropy floor, in percent."""
    return None if ratio is None else (ratio / floor - 1) * 100


def _group_label(name: str) -> str:
    """blk.7.ffn_down_exps.weight -> ffn_down_exps."""
    return name.split(".")[2]


def size_rows(tensors: Iterable[TensorStats], *, source_size: int, output_size: int | None) -> list[SizeRow]:
    """Rows per expert group (ffn_up_exps, ...), then the rest of the file, then the whole file."""
    tensors = list(tensors)
    compressed = output_size is not None
    rows = []
    for label in sorted({_group_label(t.name) for t in tensors}):
        group = [t for t in tensors if _group_label(t.name) == label]
        rows.append(SizeRow(label, len(group), sum(t.bf16_bytes for t in group),
                            sum(t.zipmoe_bytes or 0 for t in group) if compressed else None,
                            sum(t.bf16_bytes * t.floor for t in group)))
    expert_bf16 = sum(t.bf16_bytes for t in tensors)
    expert_zipmoe = sum(t.zipmoe_bytes or 0 for t in tensors)
    expert_floor = sum(t.bf16_bytes * t.floor for t in tensors)
    other = source_size - expert_bf16
    rows.append(SizeRow("other tensors + header", 0, other,
                        output_size - expert_zipmoe if compressed else None, other))
    rows.append(SizeRow("whole file", 0, source_size, output_size, expert_floor + other))
    return rows
