"""Progress reporting for long work: a no-op for library callers, tqdm bars on stderr for people."""

from __future__ import annotations

import sys
from typing import Protocol


class Progress(Protocol):
    """Phases of known size, advanced in bytes (or another unit); called from one thread only."""

    def start(self, label: str, total: int, unit: str = "B") -> None: ...

    def advance(self, n: int) -> None: ...

    def close(self) -> None: ...


class Silent:
    def start(self, label: str, total: int, unit: str = "B") -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class Bars:
    """One tqdm bar per phase on stderr; starting a phase closes the previous bar."""

    def __init__(self) -> None:
        self._bar = None

    def start(self, label: str, total: int, unit: str = "B") -> None:
        from tqdm import tqdm  # imported on use: only people at a terminal pay for it

        self.close()
        scaled = unit == "B"  # (KiB, MiB: bytes only)
        self._bar = tqdm(total=total, desc=label, unit=unit, unit_scale=scaled, unit_divisor=1024 if scaled else 1000,
                         file=sys.stderr, leave=False, dynamic_ncols=True)

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def for_terminal(quiet: bool) -> Progress:
    """Bars when a person watches stderr, nothing when quiet or redirected (logs stay clean)."""
    return Silent() if quiet or not sys.stderr.isatty() else Bars()
