"""A model's calibration on this machine: the costs the planner needs (`Calibration.as_costs_dict()`), and the cache
that keeps them per machine and model file (pyzipmoe.runtime.measure measures them).

The cache is one JSON file per (model path, machine) under $XDG_CACHE_HOME/zipmoe/calibration (default
~/.cache/...). It records the file's size, mtime_ns and inode and the machine's identity (CPU model, CPU count,
memory, the runtime's build); when any of them differs, the calibration is measured again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import tempfile
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..errors import ZipmoeError
from ..paths import bin_dir
from ..cgroup import CGROUP_ROOT, PROC_SELF, cgroup_dirs

SCHEMA = 4  # of the cache files; another value is measured again (1: tier costs from the stores alone; 2: t_layer
#             fitted; 3: engine runs that generated token 0 forever, see llama.last_logits)


class CalibrationError(ZipmoeError):
    """The model cannot be calibrated: missing, or not a MoE GGUF (exit status 2, bad input)."""


@dataclass(frozen=True)
class Calibration:
    """Costs measured on one machine for one model file; `as_costs_dict()` is what the planner takes."""

    model: dict[str, Any]  # path (real), size, mtime_ns, inode: the file measured
    machine: dict[str, Any]  # cpu, cpu_count, memory: the machine measured on
    measured_at: float  # Unix time
    seconds: float  # how long measuring took
    codec: str  # the model's exponent codec; "raw" for a model whose experts are all stored raw (a plain GGUF's)
    chunk_size: int  # values per chunk (0: no split experts)
    layer: int  # the layer whose experts were timed
    expert_tensors: int  # expert tensors in that layer (gate, up, down: 3)
    expert_values: int  # values of one expert over those tensors
    expert_compressed_bytes: int  # their regions' bytes in the file (a raw expert's: its bytes)
    t_decode: float  # core-seconds the runtime spends to decode one expert of a layer from RAM (wall x cores); 0
    #                  where the layer's experts are stored raw: they are read, never decoded
    t_decode_fresh: float | None  # the decoder alone into freshly mapped memory, one core (page faults included)
    t_read_sm: float | None  # wall seconds per expert when the exponent codes come from disk (page cache dropped)
    t_read_cold: float  # ... when the whole region comes from disk (read and decode overlapping; a raw one: read)
    decode_values_per_second: dict[str, float]  # per codec, one core, checksum + exponents + merge
    merge_seconds_per_value: float | None  # exponent and sign+mantissa planes into BF16/F16, one core
    split_seconds_per_value: float | None  # the reverse
    # (None, and no decode speeds: a model with no expert stored through the split codec, no sm tier)
    disk_bandwidth: float  # bytes/s, cold, one region per read, one read in flight, net of read_latency
    read_latency: float  # seconds, median cold one-page read
    read_size: int  # bytes, median region size read
    reads: int
    bytes_read: int
    page_cache_dropped: bool  # False where posix_fadvise is missing: the reads may have been warm
    cores: int  # usable now (re-read when loaded from the cache: a container's quota can change)
    base_seconds_per_token: float | None = None  # measured through the engine, or given by the caller, or None
    t_layer: float | None = None  # wall seconds a layer adds per token whenever it reads (engine only)
    tier_source: str = "stores"  # "engine": tier costs and base from generating; "stores": the stores alone
    plain: bool = False  # a plain GGUF (not zipmoe), its experts served as stored
    from_cache: bool = field(default=False, compare=False)  # not stored

    def as_costs_dict(self) -> dict[str, Any]:
        """The planner's `Costs` fields."""
        return {"cores": self.cores, "t_decode": self.t_decode, "disk_bandwidth": self.disk_bandwidth,
                "read_latency": self.read_latency, "base_seconds_per_token": self.base_seconds_per_token,
                "t_read_sm": self.t_read_sm, "t_read_cold": self.t_read_cold, "t_layer": self.t_layer}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["from_cache"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        """ValueError, KeyError or TypeError when `data` is not a sane calibration (a damaged cache file)."""
        names = {f.name for f in fields(cls)} - {"from_cache"}
        cal = cls(**{k: data[k] for k in names if k in data})
        decoder = [cal.t_decode_fresh, cal.merge_seconds_per_value, cal.split_seconds_per_value]
        positive = [cal.disk_bandwidth, cal.read_latency, cal.t_read_cold, *cal.decode_values_per_second.values(),
                    *(v for v in decoder if v is not None)]
        if cal.t_read_sm is not None:
            positive.append(cal.t_read_sm)
        if not all(_number(v) and v > 0 for v in positive) or not (_number(cal.t_decode) and cal.t_decode >= 0):
            raise ValueError("calibration numbers must be positive and finite")
        return cal


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ------------------------------------------------------------------------------------------ identity


def model_fingerprint(model_path: str | os.PathLike[str]) -> dict[str, Any]:
    """What changes when the file is replaced or rewritten (OSError if it cannot be stat'ed)."""
    real = os.path.realpath(model_path)
    st = os.stat(real)
    return {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's name as /proc/cpuinfo gives it (x86: model name; Arm: Hardware or CPU part), else platform's."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        text = ""
    for key in ("model name", "Hardware", "cpu model", "CPU part"):
        m = re.search(rf"^{key}\s*:\s*(.+)$", text, re.MULTILINE)
        if m:
            return m.group(1).strip()
    return platform.processor() or platform.machine() or "unknown"


def runtime_id() -> str:
    """The runtime's build: size and mtime of the native library the process loads and of the libllama the
    engine runs (the custom op and the budget's rules live there). The engine's costs change when either does."""
    from .._native import library_candidates

    native = next((p for p in library_candidates() if p.is_file()), None)
    parts = []
    for path in (native, (bin_dir() / "libllama.so").resolve()):
        if path is not None and path.is_file():
            st = path.stat()
            parts.append(f"{st.st_size}-{st.st_mtime_ns}")
    return "+".join(parts) or "unknown"


def machine_id() -> dict[str, Any]:
    """What makes measurements of one machine (and one build of the runtime) invalid on another."""
    import psutil

    return {"cpu": cpu_model(), "cpu_count": os.cpu_count() or 1, "memory": int(psutil.virtual_memory().total),
            "runtime": runtime_id()}


def cgroup_cpu_quota(*, cgroup_root: Path = CGROUP_ROOT, proc_self: Path = PROC_SELF) -> float | None:
    """CPUs' worth of time the cgroup hierarchy allows per period (v1 cfs quota/period, v2 cpu.max); None: no
    quota. The tightest of the process's cgroup and its ancestors."""
    version, dirs = cgroup_dirs("cpu", cgroup_root=cgroup_root, proc_self=proc_self)
    quotas = []
    for d in dirs:
        try:
            if version == 1:
                quota, period = ((d / f).read_text().strip() for f in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
            else:
                quota, period = (d / "cpu.max").read_text().split()
            if quota not in ("max", "-1") and int(period) > 0 and int(quota) > 0:
                quotas.append(int(quota) / int(period))
        except (OSError, ValueError):
            continue  # missing or garbled: no quota there
    return min(quotas) if quotas else None


def usable_cores(*, cgroup_root: Path = CGROUP_ROOT, proc_self: Path = PROC_SELF) -> int:
    """CPUs this process may run on (affinity), capped by its CPU quota rounded down; at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(cgroup_root=cgroup_root, proc_self=proc_self)
    if quota is not None:
        cores = min(cores, int(quota))
    return max(1, cores)


# ------------------------------------------------------------------------------------------ cache


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/zipmoe/calibration; ~/.cache/... when it is unset or relative (as the XDG spec says)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "zipmoe" / "calibration"


def cache_file(model_path: str | os.PathLike[str], machine: dict[str, Any] | None = None) -> Path:
    """Where the calibration of this file on this machine is kept.

    Named by the file's real path and the machine, so that a rewritten model replaces its stale entry instead of
    adding one, and machines sharing a home directory keep one each; the file's size, mtime and inode are checked
    against the entry's when it is loaded."""
    key = json.dumps([os.path.realpath(model_path), machine if machine is not None else machine_id()],
                     sort_keys=True)
    return cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def load_calibration(model_path: str | os.PathLike[str]) -> Calibration | None:
    """The cached calibration of this file as it is now, on this machine; None if there is none (or it is stale,
    or damaged: a cache is never worth an error)."""
    try:
        fingerprint = model_fingerprint(model_path)
    except OSError:
        return None
    machine = machine_id()
    try:
        data = json.loads(cache_file(model_path, machine).read_text())
        if data.get("schema") != SCHEMA or data.get("model") != fingerprint or data.get("machine") != machine:
            return None
        cal = Calibration.from_dict(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return replace(cal, cores=usable_cores(), from_cache=True)


def save_calibration(cal: Calibration, path: Path) -> None:
    """Atomically: a reader sees the old entry or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"schema": SCHEMA, **cal.to_dict()}, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
