"""The running cache, seen from Python: what the memory monitor and the supervisor tell it (a plan's slots, a split
by shares, all in one call each) and what they read from it (routing, activation counts, resident bytes), through
the native library that libllama shares with this process. The budget's arithmetic is the library's
(zipmoe_budget_split_tiers, zipmoe_budget_default_hot_share), as the loader's.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ZipmoeError
from ..plan import inputs
from ..plan import solver as planner

if TYPE_CHECKING:
    from ..file.reader import ZipmoeFile

ROUTING_LOG_TOKENS = 512  # generated tokens whose routing the runtime remembers per store (store-state.h: ROUTE_LOG)


def apply_plan(plan: planner.Plan, lib: Any = None, *, reserve: int | None = None, token_room: int = 0) -> None:
    """Gives the running stores new slots (each applies them at its next invocation), `reserve` bytes of evicted
    experts' pages to keep for the next decodes (the allowance for the expert tensor in flight, which a plan leaves
    beside its slots, as ZIPMOE_PLAN does at load), and `token_room`, what the stores may hold in generation, whose
    misses need neither that allowance nor a prompt's read room: beyond the slots it holds more decoded experts (a
    run's: the budget less the weights that are not experts; 0: the slots as planned). The room is set first: a
    smaller one never meets the larger slots it replaces."""
    if lib is None:
        from .._native import lib
    lib.zipmoe_cache_set_token_room(token_room)
    set_read_room(plan, lib)
    for lp in plan.layers:
        rc = lib.zipmoe_cache_set_slots(f"blk.{lp.layer}.".encode(), lp.hot, lp.warm, lp.sm)
        if rc < 0:
            raise ZipmoeError(f"the runtime refused the slots of layer {lp.layer} (status {rc})")
    if reserve is not None:
        lib.zipmoe_cache_set_reserve(reserve)


def set_read_room(plan: planner.Plan, lib: Any) -> None:
    """Bounds a prompt's read buffers by the room `plan` left them (plan_tiers' read_bytes); a plan made without
    one (read_bytes 0: every expert decoded, or slots a user wrote) leaves them unbounded. (A ZIPMOE_PLAN at load
    gets what its slots leave of the tiers from the loader.)"""
    lib.zipmoe_cache_set_read_room(plan.read_bytes if plan.read_bytes > 0 else _UNBOUNDED)


_UNBOUNDED = 2**64 - 1


def store_sizes(model: ZipmoeFile | str | os.PathLike[str]) -> list[tuple[int, int, int]]:
    """(BF16 bytes, experts, compressed bytes) of each expert tensor of a zipmoe GGUF, as the runtime's glue
    passes them to zipmoe_budget_split_tiers at load."""
    from ..file.reader import as_zipmoe

    return [(c.source.nbytes, c.source.dims[2], c.expert.info.data_size) for c in as_zipmoe(model).compressed]


def warm_decodes_fast(model: ZipmoeFile | str | os.PathLike[str]) -> bool:
    """Whether every expert tensor of a zipmoe GGUF decodes its warm hits with the escape code's SIMD decoder on
    this CPU: the runtime's default split keeps every expert compressed only then (default_hot_share)."""
    from ..file import codec
    from ..file.reader import as_zipmoe

    compressed = as_zipmoe(model).compressed
    return bool(compressed) and codec.esc_simd_level() > 0 and all(c.expert.info.codec == "esc" for c in compressed)


def _store_sizes_struct(sizes: list[tuple[int, int, int]]) -> Any:
    from .._native import ffi

    return ffi.new("zipmoe_store_size[]", [{"bf16_bytes": b, "n_expert": n, "compressed_bytes": c} for b, n, c in sizes])


def default_hot_share(tiers: int, sizes: list[tuple[int, int, int]], warm_fast: bool, sm_share: float = 0.0) -> float:
    """The runtime's hot share where none is set (zipmoe_budget_default_hot_share): 0, every expert compressed,
    where nearly all fit so but not decoded and warm hits decode fast; else 1; at most 1 - sm_share."""
    from .._native import lib as native

    return float(native.zipmoe_budget_default_hot_share(_store_sizes_struct(sizes), len(sizes), tiers,
                                                         int(warm_fast), sm_share))


def policy_id(name: str) -> int:
    """The runtime's number (zipmoe_policy) of the eviction policy `name`, one of config.policies()
    (zipmoe_policy_parse); ZipmoeError for another name."""
    from .._native import ffi, lib

    out = ffi.new("zipmoe_policy *")
    if "\0" in name or lib.zipmoe_policy_parse(name.encode(), out) != lib.ZIPMOE_OK:
        raise ZipmoeError(f"cache policy {name!r} is not one the runtime knows")
    return int(out[0])


def apply_shares(tiers: int, split: tuple[float | None, float | None, float], sizes: list[tuple[int, int, int]],
                 policy: str, lib: Any = None, warm_fast: bool = False) -> None:
    """Gives the running stores a budget split by shares again, as the loader split ZIPMOE_MEMORY_BUDGET
    (zipmoe_budget_split_tiers: a prompt's read room, the allowance for the tensor in flight, and generation's
    larger hot budget holding both), instead of slots; removes any slots, all in one call
    (zipmoe_cache_apply_split). `tiers`: the budget less its minimum. A hot share of None: the runtime's default
    for these tiers (default_hot_share, as at load), so that a budget that shrinks or grows past its threshold
    changes the split as the loader would have."""
    from .._native import ffi
    from .._native import lib as native

    lib = lib or native
    hot_share, _, sm_share = split
    if hot_share is None:
        hot_share = default_hot_share(tiers, sizes, warm_fast, sm_share)
    stores = _store_sizes_struct(sizes)
    out = ffi.new("zipmoe_budget_split *")
    if native.zipmoe_budget_split_tiers(stores, len(sizes), tiers, hot_share, sm_share, out) < 0:
        raise ZipmoeError(f"the runtime refused to split {tiers} bytes by shares {split}")
    rc = lib.zipmoe_cache_apply_split(out, policy_id(policy))  # at once: no moment between
    if rc < 0:
        raise ZipmoeError(f"the runtime refused the tiers of a {tiers}-byte budget (status {rc})")


def live_counts(geometry: inputs.ModelGeometry, lib: Any = None) -> np.ndarray:
    """Tokens routed to each expert of each block so far, from the runtime's own counters: [n_layer, n_expert]."""
    if lib is None:
        from .._native import lib
    from .._native import ffi

    counts = np.zeros((geometry.n_layer, geometry.n_expert), np.float64)
    buf = ffi.new("uint64_t[]", geometry.n_expert)
    for layer in geometry.layers:
        if lib.zipmoe_cache_activations(f"blk.{layer}.".encode(), buf, geometry.n_expert) > 0:
            counts[layer] = list(buf)
    return counts


def live_routing(geometry: inputs.ModelGeometry, lib: Any = None) -> dict[int, np.ndarray]:
    """The experts each of the last generated tokens routed to, per MoE block, oldest first (the runtime remembers
    512): block -> bool [tokens, n_expert]. Blocks whose stores are not open are left out."""
    if lib is None:
        from .._native import lib
    from .._native import ffi

    words = (geometry.n_expert + 63) // 64
    masks = np.zeros(ROUTING_LOG_TOKENS * words, np.uint64)
    routing = {}
    for layer in geometry.layers:
        n = lib.zipmoe_cache_routing(f"blk.{layer}.".encode(), ffi.cast("uint64_t *", ffi.from_buffer(masks)), words,
                                     ROUTING_LOG_TOKENS)
        if n > 0:
            bits = np.unpackbits(masks[: n * words].view(np.uint8), bitorder="little").reshape(n, words * 64)
            routing[layer] = bits[:, : geometry.n_expert].astype(bool)
    return routing


def resident_bytes(lib: Any = None) -> int:
    """What the runtime holds now, process-wide: its tiers, the experts being decoded (counted in the tiers once
    published), the pages of evicted experts it keeps for the next decodes (within the budget's allowance for the
    tensor in flight), and its read buffers beyond what they keep between uses (a prompt's reads, tens of MiB a
    store, given back after it). Counted as held, what moves between them leaves the room the monitor computes
    unchanged. Left out, each made the held bytes dip during a prompt at 40% of the 2.8g model in a container of
    the budget + 160 MiB, where the room is what is held: a prompt's first store moves generation's share of the
    allowance from the hot tier to those pages (78 MiB), a store of a prompt decodes ~75 MiB beyond its share,
    its read-ahead buffer holds ~36 MiB more, and a reading that fell on a dip shrank the tiers."""
    kept, transient, _ = _runtime_bytes(lib)
    return kept + transient


def _runtime_bytes(lib: Any = None) -> tuple[int, int, int]:
    """resident_bytes in two, what the budget covers and the read buffers' transient bytes, which it does not;
    and the invocations the runtime has served (it is running when they move)."""
    if lib is None:
        from .._native import ffi, lib
    else:
        from .._native import ffi
    s = ffi.new("zipmoe_stats *")
    lib.zipmoe_stats_get(s)
    return (int(s.hot_bytes + s.warm_bytes + s.sm_bytes + s.decoding_bytes + s.pool_bytes),
            int(s.staging_transient_bytes), int(s.materialize_calls))
