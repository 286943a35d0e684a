"""What reading experts from the model file costs: cold single reads, as the expert cache's misses make them.

Wall time, after asking the kernel to drop the file from the page cache (posix_fadvise DONTNEED, after fdatasync
so that freshly written pages are clean and can be dropped) and without readahead (POSIX_FADV_RANDOM: each read
fetches its region, as the runtime's reads of single experts do); pages another process keeps mapped stay cached,
so a model that is being served reads warm. Part of the calibration (pyzipmoe.runtime.measure).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..progress import Progress
from .calibration import CalibrationError

LATENCY_PROBES = 64  # one-page reads that measure read_latency
PAGE = 4096


@dataclass(frozen=True)
class DiskCosts:
    bandwidth: float
    latency: float
    read_size: int
    reads: int
    bytes_read: int
    page_cache_dropped: bool


def drop_page_cache(fd: int) -> bool:
    """Asks the kernel to forget the file's cached pages; False where it cannot be asked."""
    try:
        os.fdatasync(fd)  # dirty pages (a file just written) are not dropped until written back
    except OSError:
        pass
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        return False
    return True


def _no_readahead(fd: int) -> None:
    """Each read then fetches what it asks for and no more: without this, the first cold read of a small model
    reads ahead most of the file and the rest measure the page cache."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except (AttributeError, OSError):
        pass


def _latency_probes(regions: Sequence[tuple[int, int]], count: int, rng: random.Random) -> list[tuple[int, int]]:
    """Up to `count` distinct pages inside expert regions, picked at random: (offset, PAGE) reads."""
    pages: set[int] = set()
    for _ in range(4 * count):
        if len(pages) == count:
            break
        offset, size = rng.choice(regions)
        pages.add((offset + rng.randrange(max(1, size))) // PAGE * PAGE)
    probes = [(p, PAGE) for p in sorted(pages)]
    rng.shuffle(probes)
    return probes


def _timed_reads(fd: int, reads: Sequence[tuple[int, int]], buf: memoryview, progress: Progress | None,
                 label: str, *, exact: bool) -> list[float]:
    """Seconds of each pread, one at a time; `exact`: a short read is a truncated file."""
    tick = time.get_clock_info("perf_counter").resolution
    times = []
    for offset, size in reads:
        t0 = time.perf_counter()
        n = os.preadv(fd, [buf[:size]], offset)
        times.append(max(time.perf_counter() - t0, tick))  # a read faster than the clock counts one tick
        if exact and n != size:
            raise CalibrationError(f"{label}: truncated file (wanted {size} bytes at offset {offset})")
        if progress is not None:
            progress.advance(size)
    return times


def measure_disk(path: Path, regions: Sequence[tuple[int, int]], read_bytes: int, *,
                 progress: Progress) -> DiskCosts:
    """Cold reads of the model's expert regions, one pread at a time, as misses of the expert cache read them.

    latency: the median of LATENCY_PROBES one-page reads at random places: the cost of a read of nothing much.
    bandwidth: (offset, size) `regions` are read in a fixed random order until `read_bytes` are read (all of them
    if they hold less); bandwidth is chosen so that latency + size / bandwidth, summed over those reads, is the
    time they took: the planner's model of a read. (When latency explains all of it, as in models so small that
    their regions share pages, bandwidth falls back to bytes / time.)
    """
    rng = random.Random(0)
    order = list(regions)
    rng.shuffle(order)
    picks, total = [], 0
    for offset, size in order:
        if total >= read_bytes and picks:
            break
        picks.append((offset, size))
        total += size
    probes = _latency_probes(regions, LATENCY_PROBES, rng)
    buf = memoryview(bytearray(max(PAGE, *(size for _, size in picks))))
    progress.start("calibrate: disk", total)
    fd = os.open(path, os.O_RDONLY)
    try:
        dropped = drop_page_cache(fd)
        _no_readahead(fd)
        latency = statistics.median(_timed_reads(fd, probes, buf, None, str(path), exact=False))
        drop_page_cache(fd)  # the probes' pages must not make region reads warm
        times = _timed_reads(fd, picks, buf, progress, str(path), exact=True)
        drop_page_cache(fd)  # leave no cached copy behind: the runtime counts every byte it keeps
    finally:
        os.close(fd)
    transfer = sum(times) - len(times) * latency
    bandwidth = total / transfer if transfer > 0 else total / sum(times)
    return DiskCosts(bandwidth=bandwidth, latency=latency, read_size=int(statistics.median(s for _, s in picks)),
                     reads=len(picks), bytes_read=total, page_cache_dropped=dropped)
