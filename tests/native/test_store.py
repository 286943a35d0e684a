"""The run-time expert store: materialising routed experts on many threads, as ggml's custom op calls it."""

from __future__ import annotations

import gc
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pyzipmoe.file import reader as zreader
from pyzipmoe._native import ffi, lib

UNBOUNDED = 2**64 - 1
POLICIES = {"tlfu": lib.ZIPMOE_POLICY_TOKEN_LFU, "lru": lib.ZIPMOE_POLICY_LRU, "lfu": lib.ZIPMOE_POLICY_LFU,
            "lfuda": lib.ZIPMOE_POLICY_LFUDA,
            "fifo": lib.ZIPMOE_POLICY_FIFO}


@pytest.fixture(autouse=True)
def default_budget():
    """Every test starts and ends with the library's defaults: hot unbounded, no warm tier; and with no
    store of an earlier test left open, since budgets are shared out among the open stores."""
    gc.collect()
    lib.zipmoe_cache_configure(UNBOUNDED, 0, 0, lib.ZIPMOE_POLICY_TOKEN_LFU)
    lib.zipmoe_cache_set_read_room(UNBOUNDED)
    yield
    lib.zipmoe_cache_configure(UNBOUNDED, 0, 0, lib.ZIPMOE_POLICY_TOKEN_LFU)
    lib.zipmoe_cache_set_read_room(UNBOUNDED)
    lib.zipmoe_cache_begin_graph(2**62)  # out of generation's hot tier, if the test went into it


class Store:
    """A store bound to one compressed tensor of a zipmoe file, with its BF16 memory as numpy."""

    def __init__(self, path: Path, ct: zreader.CompressedTensor):
        with open(path, "rb") as f:
            f.seek(ct.index.file_offset)
            self._index = f.read(ct.index.nbytes)
            self.keys: list = []
            out = ffi.new("zipmoe_store **")
            assert lib.zipmoe_store_open(ct.name.encode(), self._index, len(self._index), ct.data.nbytes, out) == 0
            self.handle = ffi.gc(out[0], lib.zipmoe_store_free)
            dst, size = ffi.new("void **"), ffi.new("size_t *")
            assert lib.zipmoe_store_bind(self.handle, f.fileno(), ct.data.file_offset, dst, size) == 0
        ne0, ne1, n_expert = ct.source.dims
        self.weights = np.frombuffer(ffi.buffer(dst[0], n_expert * ne0 * ne1 * 2), np.uint16).reshape(n_expert, -1)

    def materialize(self, ids: np.ndarray, nth: int, key=None) -> list[int]:
        """Calls materialize from nth threads at once, as ggml does; returns each thread's status."""
        # a new invocation has a new key, as each graph node is one; kept alive so that no later call's key
        # reuses the address (the store takes a thread arriving with the last key, and no other op since, for a
        # late sibling of that invocation)
        key = key or ffi.new("char[1]")
        self.keys.append(key)
        ids = np.ascontiguousarray(ids, np.int32)
        where = np.full(ids.shape, -1, np.int32)  # each thread writes its share of the rows
        results = [0] * nth
        start = threading.Barrier(nth)

        def run(ith: int) -> None:
            start.wait()
            results[ith] = lib.zipmoe_store_materialize(self.handle, key, ffi.from_buffer(ids), ids.shape[1],
                                                        ids.shape[0], 4, ids.shape[1] * 4,
                                                        ffi.from_buffer("int32_t[]", where), ith, nth)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(nth)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.where = where
        return results

    def decoded(self, e: int) -> np.ndarray:
        """Expert e's values where the store decoded them (not always at its own index under a budget)."""
        place = lib.zipmoe_store_place(self.handle, e)
        assert place >= 0, f"expert {e} is not decoded"
        return self.weights[place]


def source_experts(source_path: Path, ct: zreader.CompressedTensor) -> np.ndarray:
    ne0, ne1, n_expert = ct.source.dims
    with open(source_path, "rb") as f:
        f.seek(ct.source.file_offset)
        return np.frombuffer(f.read(n_expert * ne0 * ne1 * 2), np.uint16).reshape(n_expert, -1)


@pytest.fixture
def stats():
    lib.zipmoe_stats_reset()
    s = ffi.new("zipmoe_stats *")

    def read() -> dict[str, int]:
        lib.zipmoe_stats_get(s)
        return {k: getattr(s, k) for k in dir(s)}

    return read


@pytest.mark.parametrize("nth", [1, 2, 3, 8])
def test_threads_materialise_exactly_the_routed_experts(zipmoe_model, tiny_model, nth, stats):
    zf = zreader.open_zipmoe(zipmoe_model)
    ct = zf.compressed[0]
    store = Store(zipmoe_model, ct)
    ref = source_experts(tiny_model, ct)
    ids = np.array([[1, 5], [5, 6], [1, 1]])
    assert all(r >= 0 for r in store.materialize(ids, nth))
    np.testing.assert_array_equal(store.weights[store.where], ref[ids])  # what ggml_mul_mat_id reads
    for e in range(ref.shape[0]):
        if e in (1, 5, 6):
            np.testing.assert_array_equal(store.decoded(e), ref[e])
        else:
            # never decoded: no place, and without a budget each expert's place is its own index, still untouched
            assert lib.zipmoe_store_place(store.handle, e) == -1 and not store.weights[e].any()
    assert stats()["experts_decoded"] == 3
    # resident experts are not decoded again; a new one is
    assert all(r >= 0 for r in store.materialize(np.array([[5, 2]]), nth))
    np.testing.assert_array_equal(store.decoded(2), ref[2])
    assert stats()["experts_decoded"] == 4


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_a_turn_s_decoded_experts_are_ready_at_once_and_the_others_after_its_wait(zipmoe_model, tiny_model, nth,
                                                                                   stats):
    """The fused matmul's protocol: _begin gives every thread all places, which experts are pending, and lets the
    decoded ones be read while the others are read and decoded; _end calls the idle work while a chunk's bytes are
    in flight; after _wait every routed expert is decoded."""
    zf = zreader.open_zipmoe(zipmoe_model)
    ct = zf.compressed[0]
    lib.zipmoe_cache_configure(budget_for(zf, ct, 3)[0], 0, 0, lib.ZIPMOE_POLICY_TOKEN_LFU)
    store = Store(zipmoe_model, ct)
    ref = source_experts(tiny_model, ct)
    assert all(r >= 0 for r in store.materialize(np.array([[1, 2]]), nth))
    ids = np.array([[2, 5, 1, 6]], np.int32)
    key = ffi.new("char[1]")
    store.keys.append(key)
    wheres = [np.full(ids.size, -1, np.int32) for _ in range(nth)]
    pendings = [np.full(ids.size, 9, np.uint8) for _ in range(nth)]
    ready_at_begin = [None] * nth
    idle_calls = [0] * nth
    results = [None] * nth
    start = threading.Barrier(nth)

    def run(ith: int) -> None:
        turn = ffi.new("zipmoe_turn *")

        @ffi.callback("int(void *)")
        def idle(_ctx):
            idle_calls[ith] += 1
            return 0  # no work left: the thread sleeps until its chunk's bytes are read

        start.wait()
        begun = lib.zipmoe_store_materialize_begin(store.handle, key, ffi.from_buffer(ids), ids.shape[1], 1, 4,
                                                   ids.shape[1] * 4, ffi.from_buffer("int32_t[]", wheres[ith]),
                                                   ffi.from_buffer("uint8_t[]", pendings[ith]), 0, ith, nth, turn)
        ready = pendings[ith] == 0
        ready_at_begin[ith] = np.array_equal(store.weights[wheres[ith][ready]], ref[ids[0][ready]])
        turn.idle = idle
        ended = lib.zipmoe_store_materialize_end(store.handle, turn, ffi.from_buffer(ids), ids.shape[1], 1, 4,
                                                 ids.shape[1] * 4)
        waited = lib.zipmoe_store_materialize_wait(store.handle, turn)
        # whichever thread ends first: after its wait the others' shares are decoded too
        results[ith] = (begun, ended, waited, np.array_equal(store.weights[wheres[ith]], ref[ids[0]]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(nth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for ith in range(nth):
        begun, ended, waited, all_after_wait = results[ith]
        assert begun == 0 and ended >= 0 and waited == 0 and all_after_wait
        # every thread sees every place and the same pending experts: 5 and 6, which the budget did not hold; or,
        # a thread descheduled until its siblings had finished the turn (a late sibling), none pending: all decoded
        assert pendings[ith].tolist() in ([0, 1, 0, 1], [0, 0, 0, 0]) and ready_at_begin[ith]
        np.testing.assert_array_equal(store.weights[wheres[ith]], ref[ids[0]])
        assert wheres[ith].tolist() == wheres[0].tolist()
    assert any(p.tolist() == [0, 1, 0, 1] for p in pendings)  # (the thread that planned)
    assert stats()["experts_decoded"] == 4  # 1 and 2 once, then 5 and 6
    # all decoded now: a turn on the fast path has nothing pending and nothing to wait for
    turn = ffi.new("zipmoe_turn *")
    where, pending = np.full(2, -1, np.int32), np.full(2, 9, np.uint8)
    again = np.array([[5, 6]], np.int32)
    assert lib.zipmoe_store_materialize_begin(store.handle, ffi.new("char[1]"), ffi.from_buffer(again), 2, 1, 4, 8,
                                              ffi.from_buffer("int32_t[]", where),
                                              ffi.from_buffer("uint8_t[]", pending), 0, 0, 1, turn) == 0
    assert pending.tolist() == [0, 0] and turn.plan_n == 0
    assert lib.zipmoe_store_materialize_end(store.handle, turn, ffi.from_buffer(again), 2, 1, 4, 8) == 0
    assert lib.zipmoe_store_materialize_wait(store.handle, turn) == 0
    np.testing.assert_array_equal(store.weights[where], ref[again[0]])
    # pending without where is refused
    assert lib.zipmoe_store_materialize_begin(store.handle, ffi.new("char[1]"), ffi.from_buffer(again), 2, 1, 4, 8,
                                              ffi.NULL, ffi.from_buffer("uint8_t[]", pending), 0, 0, 1, turn) == \
        lib.ZIPMOE_ERR_ARG


def _stream_turn(store: Store, ids: np.ndarray) -> tuple[int, np.ndarray, np.ndarray, object]:
    """A one-token turn that lets the caller stream warm experts (ZIPMOE_TURN_STREAM), on one thread."""
    turn = ffi.new("zipmoe_turn *")
    key = ffi.new("char[1]")
    store.keys.append(key)
    where, pending = np.full(ids.size, -1, np.int32), np.full(ids.size, 9, np.uint8)
    begun = lib.zipmoe_store_materialize_begin(store.handle, key, ffi.from_buffer(ids), ids.shape[1], 1, 4,
                                               ids.shape[1] * 4, ffi.from_buffer("int32_t[]", where),
                                               ffi.from_buffer("uint8_t[]", pending), lib.ZIPMOE_TURN_STREAM, 0, 1,
                                               turn)
    assert lib.zipmoe_store_materialize_end(store.handle, turn, ffi.from_buffer(ids), ids.shape[1], 1, 4,
                                            ids.shape[1] * 4) >= 0
    assert lib.zipmoe_store_materialize_wait(store.handle, turn) == 0
    return begun, where, pending, turn


def _streamed_values(store: Store, ct: zreader.CompressedTensor, e: int) -> np.ndarray:
    """Expert e decoded chunk by chunk through zipmoe_store_stream_chunk, as the fused op decodes it."""
    n, chunk = ct.expert.info.n_per_expert, ct.expert.info.chunk_n
    out = np.zeros(-(-n // chunk) * chunk, np.uint16)
    for c in range(-(-n // chunk)):
        got = lib.zipmoe_store_stream_chunk(store.handle, e, c, ffi.from_buffer("uint16_t[]", out[c * chunk:]))
        assert got == min(chunk, n - c * chunk), got
    return out[:n]


def _streamed_planes(store: Store, ct: zreader.CompressedTensor, e: int) -> np.ndarray:
    """Expert e through zipmoe_store_stream_exponents: each chunk's exponent plane, merged here with the expert's
    sign+mantissa plane as the fused op merges a row."""
    n, chunk = ct.expert.info.n_per_expert, ct.expert.info.chunk_n
    exp = np.zeros(n, np.uint8)
    sm_at = ffi.new("const uint8_t **")
    for c in range(-(-n // chunk)):
        got = lib.zipmoe_store_stream_exponents(store.handle, e, c, ffi.from_buffer("uint8_t[]", exp[c * chunk:]),
                                                sm_at)
        assert got == min(chunk, n - c * chunk), got
    sm = np.frombuffer(ffi.buffer(sm_at[0], n), np.uint8).astype(np.uint16)
    return ((sm & 0x80) << 8) | (exp.astype(np.uint16) << 7) | (sm & 0x7F)


@pytest.mark.parametrize("hot_slots", [0, 1])
def test_a_streaming_turn_leaves_warm_experts_to_its_caller_pinned_until_the_next(zipmoe_model, tiny_model, stats,
                                                                                 hot_slots):
    """ZIPMOE_TURN_STREAM: routed warm experts stay compressed (pending 2) and their chunks decode exactly, even once
    the tiers settle below them at the turn's end; with a full hot tier the one that outranks its coldest expert is
    decoded into a place instead. The next invocation unpins them."""
    zf = zreader.open_zipmoe(zipmoe_model)
    stores = [Store(zipmoe_model, ct) for ct in zf.compressed]  # all of the model's stores share the budget
    ct, store = zf.compressed[0], stores[0]
    ref = source_experts(tiny_model, ct)
    n_expert = ref.shape[0]
    region = max(ct.expert.span(e).size for e in range(n_expert))
    hot, warm_all = budget_for(zf, ct, hot_slots, n_expert * region)
    lib.zipmoe_cache_configure(hot if hot_slots else 0, warm_all, 0, lib.ZIPMOE_POLICY_TOKEN_LFU)
    prompt = np.concatenate([np.arange(n_expert), np.arange(4)])  # all warm; 0..3 outrank the others (TLFU)
    assert all(r >= 0 for r in store.materialize(prompt.reshape(-1, 1), 2))
    last = n_expert - 1
    assert all(r >= 0 for r in store.materialize(np.array([[last]]), 1))  # the hot tier settles to its slots
    routed = np.array([list(range(4))], np.int32)
    assert routed.size == 4
    _, warm_two = budget_for(zf, ct, 0, 2 * region)  # the tier settles to two experts at the turn's end
    lib.zipmoe_cache_configure(hot if hot_slots else 0, warm_two, 0, lib.ZIPMOE_POLICY_TOKEN_LFU)
    before = stats()
    begun, where, pending, turn = _stream_turn(store, routed)
    assert begun == 0
    promoted = [e for e, p in zip(routed[0], pending) if p == 1]
    assert sorted(pending.tolist()) == ([2, 2, 2, 2] if hot_slots == 0 else [1, 2, 2, 2])
    assert turn.plan_n == len(promoted)
    for e, p, w in zip(routed[0], pending, where):
        if p == 2:
            np.testing.assert_array_equal(_streamed_values(store, ct, int(e)), ref[e])
            np.testing.assert_array_equal(_streamed_planes(store, ct, int(e)), ref[e])
        else:
            np.testing.assert_array_equal(store.weights[w], ref[e])  # decoded into its place, as without streaming
            assert lib.zipmoe_store_stream_chunk(store.handle, int(e), 0, ffi.new("uint16_t[]", ct.expert.info.chunk_n)) \
                == lib.ZIPMOE_ERR_ARG
            assert lib.zipmoe_store_stream_exponents(store.handle, int(e), 0, ffi.new("uint8_t[]", ct.expert.info.chunk_n),
                                                     ffi.new("const uint8_t **")) == lib.ZIPMOE_ERR_ARG
    after = stats()
    assert after["experts_streamed"] - before["experts_streamed"] == 4 - len(promoted)
    assert after["hits_warm"] - before["hits_warm"] == 4
    assert after["experts_decoded"] - before["experts_decoded"] == len(promoted)
    buf = ffi.new("uint16_t[]", ct.expert.info.chunk_n)
    streamed = int(routed[0][list(pending).index(2)])
    assert lib.zipmoe_store_stream_chunk(store.handle, streamed, -1, buf) == lib.ZIPMOE_ERR_ARG
    assert lib.zipmoe_store_stream_chunk(store.handle, streamed, ct.expert.info.n_chunks, buf) == lib.ZIPMOE_ERR_ARG
    # the next plan (a turn without the flag, of an expert not hot) unpins them: the tier is back within budget
    assert all(r >= 0 for r in store.materialize(np.array([[last]]), 1))
    assert lib.zipmoe_store_stream_chunk(store.handle, streamed, 0, buf) == lib.ZIPMOE_ERR_ARG
    assert lib.zipmoe_store_stream_exponents(store.handle, streamed, 0, ffi.new("uint8_t[]", ct.expert.info.chunk_n),
                                             ffi.new("const uint8_t **")) == lib.ZIPMOE_ERR_ARG
    assert stats()["warm_bytes"] <= warm_two


def test_cache_none_decodes_on_every_use(zipmoe_model, tiny_model, stats):
    zf = zreader.open_zipmoe(zipmoe_model)
    ct = zf.compressed[1]
    lib.zipmoe_cache_configure(0, 0, 0, lib.ZIPMOE_POLICY_TOKEN_LFU)
    store = Store(zipmoe_model, ct)
    for _ in range(3):
        store.materialize(np.array([[0, 3]]), 2)
    assert stats()["experts_decoded"] == 6
    np.testing.assert_array_equal(store.decoded(3), source_experts(tiny_model, ct)[3])


def test_concurrent_invocations_on_one_store_each_complete(zipmoe_model, tiny_model):
    """Two 'graphs' (different keys) at once: each one's experts are decoded when its threads return.

    With an unbounded budget: under a budget, one graph's eviction could take experts that the other's
    matmul still has to read (two graphs computing on one model at once is not supported with a budget)."""
    zf = zreader.open_zipmoe(zipmoe_model)
    ct = zf.compressed[2]
    store = Store(zipmoe_model, ct)
    ref = source_experts(tiny_model, ct)
    n_expert = ref.shape[0]
    rng = np.random.default_rng(0)
    for _ in range(20):
        a, b = rng.integers(0, n_expert, (2, 4, 2))
        results = [None, None]

        def run(i, ids):
            results[i] = store.materialize(ids, 3)

        threads = [threading.Thread(target=run, args=(0, a)), threading.Thread(target=run, args=(1, b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for e in set(a.ravel()) | set(b.ravel()):
            np.testing.assert_array_equal(store.decoded(e), ref[e])


def damaged_copy(zipmoe_model: Path, tmp_path: Path, expert: int) -> tuple[Path, zreader.ZipmoeFile]:
    """A copy of the model with one bit flipped inside `expert`'s sign+mantissa plane of the first tensor."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(zipmoe_model.read_bytes())
    zf = zreader.open_zipmoe(bad)
    with open(bad, "r+b") as f:
        pos = zf.compressed[0].region_file_offset(expert) + 3
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x10]))
    return bad, zf


def test_corrupt_chunk_is_reported_with_tensor_and_expert(zipmoe_model, tmp_path, stats):
    bad, zf = damaged_copy(zipmoe_model, tmp_path, 4)
    ct = zf.compressed[0]
    store = Store(bad, ct)
    lib.zipmoe_store_take_error(store.handle, ffi.NULL, 0)
    results = store.materialize(np.array([[4, 0]]), 2)
    assert any(r == lib.ZIPMOE_ERR_CHECKSUM for r in results)
    msg = ffi.new("char[256]")
    assert lib.zipmoe_store_take_error(store.handle, msg, 256) == lib.ZIPMOE_ERR_CHECKSUM
    assert ffi.string(msg).decode() == f"zipmoe: {ct.name}, expert 4: checksum mismatch (the stored bytes were modified or damaged)"
    assert lib.zipmoe_store_take_error(store.handle, ffi.NULL, 0) == 0  # taken
    # the failed expert is not marked resident: using it again fails again, never silently
    assert any(r == lib.ZIPMOE_ERR_CHECKSUM for r in store.materialize(np.array([[4]]), 1))
    assert stats()["decoding_bytes"] == 0  # a discarded plan's experts are not being decoded any more


def test_a_late_sibling_of_a_failed_invocation_fails_too_and_plans_nothing(zipmoe_model, tmp_path, stats):
    """A thread that arrives after its siblings finished a failed invocation (same key, no other op since) must not
    plan it again: its siblings may still be streaming from what the plan pinned. It fails too, decoding nothing."""
    bad, zf = damaged_copy(zipmoe_model, tmp_path, 4)
    store = Store(bad, zf.compressed[0])
    key = ffi.new("char[1]")
    store.keys.append(key)
    ids = np.ascontiguousarray([[4, 0]], np.int32)
    where = np.full(ids.shape, -1, np.int32)
    first = lib.zipmoe_store_materialize(store.handle, key, ffi.from_buffer(ids), 2, 1, 4, 8,
                                         ffi.from_buffer("int32_t[]", where), 1, 2)  # thread 1 does the work
    assert first == lib.ZIPMOE_ERR_CHECKSUM
    assert lib.zipmoe_store_take_error(store.handle, ffi.NULL, 0) == lib.ZIPMOE_ERR_CHECKSUM
    decoded = stats()["experts_decoded"]
    late = lib.zipmoe_store_materialize(store.handle, key, ffi.from_buffer(ids), 2, 1, 4, 8,
                                        ffi.from_buffer("int32_t[]", where), 0, 2)  # thread 0 comes late
    assert late >= 0 and stats()["experts_decoded"] == decoded  # nothing planned nor decoded again
    assert lib.zipmoe_store_take_error(store.handle, ffi.NULL, 0) == lib.ZIPMOE_ERR_CORRUPT  # and it failed
    # a new invocation (a new key) plans again, and fails again on the damaged expert, never silently
    assert any(r == lib.ZIPMOE_ERR_CHECKSUM for r in store.materialize(np.array([[4]]), 1))


def test_out_of_range_expert_ids_are_an_error_not_a_write(zipmoe_model):
    zf = zreader.open_zipmoe(zipmoe_model)
    store = Store(zipmoe_model, zf.compressed[0])
    store.materialize(np.array([[0, 999]]), 2)
    assert lib.zipmoe_store_take_error(store.handle, ffi.NULL, 0) == lib.ZIPMOE_ERR_ARG


def test_a_guess_names_experts_of_the_store(zipmoe_model):
    """zipmoe_store_predict (the engine's guess at a store's next routing) refuses ids outside the store; a guess
    changes nothing of what an invocation decodes."""
    zf = zreader.open_zipmoe(zipmoe_model)
    store = Store(zipmoe_model, zf.compressed[0])
    n_expert = zf.compressed[0].source.dims[2]
    assert lib.zipmoe_store_predict(store.handle, ffi.new("int32_t[]", [0, n_expert]), 2) == lib.ZIPMOE_ERR_ARG
    assert lib.zipmoe_store_predict(store.handle, ffi.new("int32_t[]", [-1]), 1) == lib.ZIPMOE_ERR_ARG
    assert lib.zipmoe_store_predict(ffi.NULL, ffi.NULL, 0) == lib.ZIPMOE_ERR_ARG
    assert lib.zipmoe_store_predict(store.handle, ffi.new("int32_t[]", [1, 0]), 2) == lib.ZIPMOE_OK
    assert all(r >= 0 for r in store.materialize(np.array([[0, 1]]), 2))


@pytest.mark.parametrize("right", [True, False])
def test_guessed_experts_are_read_ahead_and_decode_bit_exact(zipmoe_model, tiny_model, stats, right):
    """A store of layer 1 given a guess (zipmoe_store_predict) has the reader read the guessed experts ahead once
    the store invoked before it (layer 0's, which learned the order) is done with its reads; a right guess is
    decoded from those bytes, a wrong one is dropped and the store reads what it routed. Values exact either way."""
    zf = zreader.open_zipmoe(zipmoe_model)
    first = next(c for c in zf.compressed if c.name.startswith("blk.0."))
    second = next(c for c in zf.compressed if c.name.startswith("blk.1.") and c.name[6:] == first.name[6:])
    stores = [Store(zipmoe_model, ct) for ct in zf.compressed]
    a, b = (stores[zf.compressed.index(ct)] for ct in (first, second))
    ref = source_experts(tiny_model, second)
    n_expert = ref.shape[0]
    lib.zipmoe_cache_configure(budget_for(zf, second, 1)[0], 0, 0, lib.ZIPMOE_POLICY_TOKEN_LFU)
    rng = np.random.default_rng(3)
    for token in range(24):
        ids_a, ids_b = (rng.choice(n_expert, 2, replace=False)[None, :] for _ in range(2))
        guess = ids_b.ravel().tolist() if right else [e for e in range(n_expert) if e not in ids_b][:2]
        assert lib.zipmoe_store_predict(b.handle, ffi.new("int32_t[]", guess), len(guess)) == lib.ZIPMOE_OK
        assert all(r >= 0 for r in a.materialize(ids_a, 2))
        time.sleep(0.02)  # the reader reads the guess while "layer 0 computes"
        assert all(r >= 0 for r in b.materialize(ids_b, 2))
        for e in ids_b.ravel():
            np.testing.assert_array_equal(b.decoded(e), ref[e])
    st = stats()
    assert st["bytes_read_guessed"] > 0, st
    assert (st["guesses_used"] > 0) == right, st


def test_a_prompts_read_ahead_takes_back_a_buffer_left_to_a_store_not_invoked(zipmoe_model, tiny_model, stats):
    """A prompt's read-ahead (larger than ZIPMOE_READ_BUFFER) waits for a buffer held by a store whose invocation is
    in flight, but takes back one left to a store that was read ahead for and then not invoked (the graph went
    elsewhere): else it would wait for that store forever and read nothing ahead."""
    zf = zreader.open_zipmoe(zipmoe_model)
    stores = [Store(zipmoe_model, ct) for ct in zf.compressed]
    layer = [[k for k, ct in enumerate(zf.compressed) if ct.name.startswith(f"blk.{n}.")] for n in (0, 1)]
    a, b, c = stores[layer[0][0]], stores[layer[1][0]], stores[layer[1][1]]
    ct_a = zf.compressed[layer[0][0]]
    n_expert = ct_a.source.dims[2]
    prompt = np.arange(n_expert).reshape(-1, 2)  # routes to every expert: a prompt's read-ahead reads them all
    lib.zipmoe_cache_configure(budget_for(zf, ct_a, 1)[0], 0, 0, lib.ZIPMOE_POLICY_TOKEN_LFU)
    lib.zipmoe_cache_set_read_buffer(4096)
    try:
        # the order a, b, c, a: then a's invocation reads b ahead (a layer's plan evicts the other layer's experts)
        for store in (a, b, c, a):
            assert all(r >= 0 for r in store.materialize(prompt, 2))
            time.sleep(0.05)
        before = stats()["bytes_read_ahead"]
        assert before > 0
        assert all(r >= 0 for r in c.materialize(prompt, 2))  # not b: c's read-ahead for a takes b's buffer back
        time.sleep(0.05)
        assert stats()["bytes_read_ahead"] > before
        assert all(r >= 0 for r in a.materialize(prompt, 2))
        ref = source_experts(tiny_model, ct_a)
        for e in range(n_expert):
            np.testing.assert_array_equal(a.decoded(e), ref[e])
    finally:
        lib.zipmoe_cache_set_read_buffer(16 << 20)


def test_the_read_buffers_report_what_a_prompt_grew_them_by(zipmoe_model, stats):
    """staging_transient_bytes: what the read buffers hold beyond what each keeps between uses (a prompt's reads),
    which the memory monitor counts as held; gone once the reads fit what a buffer keeps again."""
    zf = zreader.open_zipmoe(zipmoe_model)
    stores = [Store(zipmoe_model, ct) for ct in zf.compressed]
    ct, store = zf.compressed[0], stores[0]
    lib.zipmoe_cache_configure(budget_for(zf, ct, 1)[0], 0, 0, lib.ZIPMOE_POLICY_TOKEN_LFU)
    keep = 8192  # one expert's compressed region of the tiny preset, laid out for O_DIRECT
    lib.zipmoe_cache_set_read_buffer(keep)
    try:
        # (the read-ahead buffers are the process's and keep what earlier tests sized them to: deltas only)
        assert all(r >= 0 for r in store.materialize(np.array([[1]]), 2))  # a token: its read fits `keep`
        base = stats()
        assert all(r >= 0 for r in store.materialize(np.arange(ct.source.dims[2]).reshape(1, -1), 2))  # a prompt
        s = stats()
        grown = s["staging_bytes"] - base["staging_bytes"]
        assert grown > 0 and s["staging_transient_bytes"] - base["staging_transient_bytes"] == grown, (base, s)
        for e in (1, 2):  # tokens: the first settles the store down to one decoded expert, the second misses
            assert all(r >= 0 for r in store.materialize(np.array([[e]]), 2))
        s = stats()
        assert (s["staging_bytes"], s["staging_transient_bytes"]) == (base["staging_bytes"],
                                                                    base["staging_transient_bytes"]), (base, s)
    finally:
        lib.zipmoe_cache_set_read_buffer(16 << 20)


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_a_prompt_s_reads_beyond_the_read_room_go_through_a_ring(zipmoe_model, tiny_model, stats, nth):
    """zipmoe_cache_set_read_room: a prompt that reads more than the room lets a buffer hold is staged through a
    ring (the reader waits for decoded experts' bytes to be free) and reads the next store ahead only as far as the
    room goes: the same experts, the buffers no larger than what they keep. Without the room they grow."""
    zf = zreader.open_zipmoe(zipmoe_model)
    layer = [k for k, ct in enumerate(zf.compressed) if ct.name.startswith("blk.0.")]
    stores = [Store(zipmoe_model, zf.compressed[k]) for k in layer[:2]]  # the first reads the second ahead
    refs = [source_experts(tiny_model, zf.compressed[k]) for k in layer[:2]]
    ct = zf.compressed[layer[0]]
    n_expert = ct.source.dims[2]
    prompt = np.arange(n_expert).reshape(-1, 2)
    keep = 8192  # one expert's compressed region of the tiny preset, laid out for O_DIRECT
    lib.zipmoe_cache_configure(budget_for(zf, ct, 1)[0], 0, 0, lib.ZIPMOE_POLICY_TOKEN_LFU)
    lib.zipmoe_cache_set_read_buffer(keep)
    try:
        def prompt_grows_buffers_by() -> int:
            for store in stores:  # tokens first
                for e in (1, 2):
                    assert all(r >= 0 for r in store.materialize(np.array([[e]]), nth))
            time.sleep(0.05)
            grown = 0  # beyond what each buffer keeps (a buffer not used before may come into being at that size)
            for store, ref in zip(stores + stores, refs + refs):  # the second pass reads ahead, the order learned
                assert all(r >= 0 for r in store.materialize(prompt, nth))
                grown = max(grown, stats()["staging_transient_bytes"])
                for e in range(n_expert):  # (decoded until another store plans)
                    np.testing.assert_array_equal(store.decoded(e), ref[e])
                time.sleep(0.05)
            return grown

        assert prompt_grows_buffers_by() > 0  # unbounded: each buffer takes a store's reads at once
        lib.zipmoe_cache_set_read_room(0)  # each buffer: what it keeps, one expert's region here
        # the idle buffers the prompt grew are given back at once, one read ahead for a store at its invocation
        assert all(r >= 0 for r in stores[0].materialize(np.array([[3]]), nth))
        assert stats()["staging_transient_bytes"] == 0
        before = stats()["bytes_read_ahead"]
        assert prompt_grows_buffers_by() == 0
        assert stats()["bytes_read_ahead"] > before  # (still read ahead, as far as the buffer goes)
    finally:
        lib.zipmoe_cache_set_read_buffer(16 << 20)


def test_a_damaged_expert_in_a_ring_fails_its_invocation_without_a_hang(zipmoe_model, tmp_path):
    """A decode that fails in a ring never releases its bytes: the reader must not wait for them."""
    bad, zf = damaged_copy(zipmoe_model, tmp_path, 1)
    ct = zf.compressed[0]
    store = Store(bad, ct)
    lib.zipmoe_cache_configure(budget_for(zf, ct, 1)[0], 0, 0, lib.ZIPMOE_POLICY_TOKEN_LFU)
    lib.zipmoe_cache_set_read_buffer(8192)
    lib.zipmoe_cache_set_read_room(0)
    try:
        results = store.materialize(np.arange(ct.source.dims[2]).reshape(-1, 2), 2)
        assert any(r == lib.ZIPMOE_ERR_CHECKSUM for r in results)
        assert lib.zipmoe_store_take_error(store.handle, ffi.NULL, 0) == lib.ZIPMOE_ERR_CHECKSUM
        assert all(r >= 0 for r in store.materialize(np.array([[3, 0]]), 2))  # the store works on
    finally:
        lib.zipmoe_cache_set_read_buffer(16 << 20)


@pytest.mark.parametrize("tiers", [(80 << 10) + 64, 128 << 10], ids=["capped", "not capped"])
def test_a_budget_split_by_shares_leaves_a_prompt_s_reads_room_and_generation_all_of_it(zipmoe_model, tiers):
    """zipmoe_budget_split_tiers, which libllama's loader and the memory monitor both apply: a prompt's read
    buffers take twice what the largest store reads of the experts the hot tier does not keep (its compressed
    bytes, each expert's read in its span of O_DIRECT blocks: up to two blocks more), at most half the tiers (the
    tiny preset's 3 KiB regions make the blocks most of it: 80 KiB are capped; test_llama's
    test_the_decoded_experts_in_flight_count_once measures the same through the loader); the hot tier and the
    allowance for the tensor in flight share the rest with the largest tensor's experts, and generation's hot
    budget holds all of it; with an sm tier, no generation budget; with compressed tiers, the room holds what the
    warm tier does not keep whole and the sm tier's codes, with or without a hot tier; bad shares are refused."""
    from pyzipmoe.runtime.cache_control import store_sizes

    sizes = store_sizes(zipmoe_model)
    cold = 1 - tiers / sum(b for b, _, _ in sizes)  # of every store's experts, with the tiers all hot
    reads = min(tiers // 2, max(2 * int(c * cold + n * cold * 2 * 4096 + 0.999) for _, n, c in sizes))
    assert (reads == tiers // 2) == (tiers < 100 << 10)
    stores = ffi.new("zipmoe_store_size[]", [{"bf16_bytes": b, "n_expert": n, "compressed_bytes": c}
                                             for b, n, c in sizes])
    working_set = max(b for b, _, _ in sizes)
    out = ffi.new("zipmoe_budget_split *")
    assert lib.zipmoe_budget_split_tiers(stores, len(sizes), tiers, 1.0, 0.0, out) == 0
    assert out.reads == reads and (out.warm, out.sm) == (0, 0)
    assert out.hot + out.in_flight == tiers - reads + working_set and out.in_flight <= working_set
    assert out.token_hot == tiers + working_set
    assert lib.zipmoe_budget_split_tiers(stores, len(sizes), tiers, 0.5, 0.25, out) == 0
    assert out.sm > 0 and out.warm > 0 and out.token_hot == 0
    assert out.hot + out.warm + out.sm + out.reads <= tiers + working_set - out.in_flight

    # without a hot tier too: the experts the warm tier does not keep are read whole, the sm tier's their codes;
    # where generation does not get the room back, two regions a buffer
    def room(hot: float, sm: float) -> int:
        total = sum(b for b, _, _ in sizes)
        most = 0
        for b, n, c in sizes:
            rest = n * (1 - min(1.0, tiers * hot / total))
            warm = min(rest, tiers * (1 - hot - sm) * b / total / (c / n))
            in_sm = min(rest - warm, tiers * sm * b / total / (b / n / 2))
            cold = rest - warm - in_sm
            most = max(most, 2 * int(cold * (c / n + 2 * 4096) + in_sm * (c / n - b / n / 2 + 2 * 4096) + 0.999))
        if not (hot > 0 and sm == 0):  # never given back in generation: two regions a buffer, rings beyond
            most = min(most, 4 * max(int(c / n + 2 * 4096 + 0.999) for _, n, c in sizes))
        return min(tiers // 2, most)

    for hot, sm in ((0.0, 0.0), (0.0, 0.5), (0.5, 0.25)):
        assert lib.zipmoe_budget_split_tiers(stores, len(sizes), tiers, hot, sm, out) == 0
        assert abs(out.reads - room(hot, sm)) <= 2, (hot, sm, out.reads, room(hot, sm))  # (rounding)
        assert out.reads > 0 and out.hot + out.warm + out.sm + out.reads <= tiers + working_set - out.in_flight
    # a store without sizes reads nothing and divides by nothing
    empty = ffi.new("zipmoe_store_size[]", [{"bf16_bytes": 1 << 20, "n_expert": 8, "compressed_bytes": 0}])
    assert lib.zipmoe_budget_split_tiers(empty, 1, tiers, 1.0, 0.0, out) == 0 and out.reads == 0
    assert lib.zipmoe_budget_split_tiers(stores, len(sizes), tiers, 0.8, 0.3, out) == lib.ZIPMOE_ERR_ARG
    assert lib.zipmoe_budget_split_tiers(ffi.NULL, 1, tiers, 1.0, 0.0, out) == lib.ZIPMOE_ERR_ARG


def test_bind_refuses_a_data_companion_outside_the_file(zipmoe_model, tmp_path):
    zf = zreader.open_zipmoe(zipmoe_model)
    ct = zf.compressed[-1]
    short = tmp_path / "short.gguf"
    short.write_bytes(zipmoe_model.read_bytes()[: ct.data.file_offset + 10])
    with open(zipmoe_model, "rb") as f:
        f.seek(ct.index.file_offset)
        index = f.read(ct.index.nbytes)
    out = ffi.new("zipmoe_store **")
    assert lib.zipmoe_store_open(b"t", index, len(index), ct.data.nbytes, out) == 0
    store = ffi.gc(out[0], lib.zipmoe_store_free)
    fd = os.open(short, os.O_RDONLY)
    try:
        assert lib.zipmoe_store_bind(store, fd, ct.data.file_offset, ffi.new("void **"), ffi.new("size_t *")) == lib.ZIPMOE_ERR_CORRUPT
    finally:
        os.close(fd)


def expert_bytes(ct: zreader.CompressedTensor) -> int:
    ne0, ne1, _ = ct.source.dims
    return ne0 * ne1 * 2


def budget_for(zf: zreader.ZipmoeFile, ct: zreader.CompressedTensor, n_hot: int, n_warm_bytes: int = 0) -> tuple[int, int]:
    """Process budgets that give store `ct` room for n_hot decoded experts (budgets are shared by BF16 size)."""
    total = sum(expert_bytes(c) * c.source.dims[2] for c in zf.compressed)
    share = expert_bytes(ct) * ct.source.dims[2] / total
    return int(n_hot * expert_bytes(ct) / share) + 1, int(n_warm_bytes / share) + 1


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("warm_experts", [0, 3])
def test_every_tier_and_transition_stays_bit_exact_under_a_tiny_budget(zipmoe_model, tiny_model, stats, policy, warm_experts):
    zf = zreader.open_zipmoe(zipmoe_model)
    stores = [Store(zipmoe_model, ct) for ct in zf.compressed]  # all of the model's stores share the budget
    ct = zf.compressed[0]
    store = stores[0]
    ref = source_experts(tiny_model, ct)
    n_expert = ref.shape[0]
    region = max(ct.expert.span(e).size for e in range(n_expert))
    hot, warm = budget_for(zf, ct, 2, warm_experts * region)
    lib.zipmoe_cache_configure(hot, warm, 0, POLICIES[policy])
    rng = np.random.default_rng(1)
    for step in range(40):
        ids = rng.integers(0, n_expert, (int(rng.integers(1, 4)), 2))
        assert all(r >= 0 for r in store.materialize(ids, int(rng.integers(1, 4))))
        np.testing.assert_array_equal(store.weights[store.where], ref[ids])  # what ggml_mul_mat_id reads
        for e in set(ids.ravel()):
            np.testing.assert_array_equal(store.decoded(e), ref[e])
    st = stats()
    assert st["evictions"] > 0 and st["misses"] > 0
    if warm_experts:
        assert st["hits_warm"] > 0
        assert st["warm_bytes"] <= warm
    else:
        assert st["hits_warm"] == 0 and st["warm_bytes"] == 0
    # what stays decoded between invocations is the budget, plus the experts of the invocation in flight
    assert st["hot_bytes"] <= 2 * expert_bytes(ct) + 6 * expert_bytes(ct)
    assert st["bytes_read"] > 0


def test_lru_keeps_the_recent_and_lfu_the_frequent(zipmoe_model, stats):
    zf = zreader.open_zipmoe(zipmoe_model)
    stores = [Store(zipmoe_model, ct) for ct in zf.compressed]
    ct, store = zf.compressed[0], stores[0]
    for policy, expect_hot in (("lru", 1), ("lfu", 0)):
        lib.zipmoe_cache_configure(budget_for(zf, ct, 2)[0], 0, 0, POLICIES[policy])
        for ids in ([[0]], [[0]], [[0]], [[1]], [[2]]):  # 0 used often, then 1, then 2: one of 0 and 1 goes
            store.materialize(np.array(ids), 1)
        lib.zipmoe_stats_reset()
        store.materialize(np.array([[expect_hot]]), 1)
        assert stats()["hits_hot"] == 1, policy
        store.materialize(np.array([[3], [4], [5], [6], [7]]), 1)  # flush: 3..7 pinned, others evicted


@pytest.mark.parametrize("sm_tier", [False, True])
def test_a_miss_takes_the_place_of_the_expert_it_evicts(zipmoe_model, tiny_model, stats, sm_tier):
    """Under a budget a miss is decoded where the expert evicted for it lay, its pages still mapped (no slot moves),
    and the op's `where` sends the matmul there. Not with an sm tier, whose contests must see the eviction after
    the decode: there the miss takes a free place, its own index if free."""
    zf = zreader.open_zipmoe(zipmoe_model)
    stores = [Store(zipmoe_model, ct) for ct in zf.compressed]
    ct, store = zf.compressed[0], stores[0]
    ref = source_experts(tiny_model, ct)
    sm = budget_for(zf, ct, 0, 4 * expert_bytes(ct) // 2)[1] if sm_tier else 0
    lib.zipmoe_cache_configure(budget_for(zf, ct, 2)[0], 0, sm, POLICIES["lru"])
    store.materialize(np.array([[0]]), 1)
    store.materialize(np.array([[1]]), 1)
    place_of_0 = lib.zipmoe_store_place(store.handle, 0)
    assert place_of_0 >= 0
    store.materialize(np.array([[2]]), 2)  # LRU evicts 0
    assert lib.zipmoe_store_place(store.handle, 0) == -1 and stats()["evictions"] == 1
    place_of_2 = lib.zipmoe_store_place(store.handle, 2)
    assert place_of_2 == (2 if sm_tier else place_of_0)
    assert store.where.tolist() == [[place_of_2]]
    np.testing.assert_array_equal(store.weights[place_of_2], ref[2])
    store.materialize(np.array([[0, 1]]), 1)  # 0 comes back: wherever it lands, the matmul finds it
    np.testing.assert_array_equal(store.weights[store.where], ref[[[0, 1]]])
    assert lib.zipmoe_store_place(store.handle, 99) == lib.ZIPMOE_ERR_ARG


@pytest.mark.parametrize("sm_tier", [False, True], ids=["hot", "sm tier"])
@pytest.mark.parametrize("how", ["shares", "split", "plan"])
def test_generation_keeps_the_allowance_decoded_and_a_batch_takes_it_back_first(zipmoe_model, tiny_model, stats,
                                                                              sm_tier, how):
    """While every store of a graph is routed no more experts than it keeps decoded (a token's top-k), each miss
    takes its victim's place and the allowance for the tensor in flight can hold decoded experts too
    (zipmoe_cache_set_token_hot; for a planner's slots zipmoe_cache_set_token_room, the same bytes beyond the
    rules' as extra hot slots). A graph that may route more (a prompt's batch) gets the smaller hot tier back
    before its first store decodes beyond its share, so it peaks where it always did. Not with an sm tier, whose
    misses do not evict first."""
    zf = zreader.open_zipmoe(zipmoe_model)
    stores = [Store(zipmoe_model, ct) for ct in zf.compressed]
    size, n_expert = expert_bytes(zf.compressed[0]), zf.compressed[0].source.dims[2]
    assert all(expert_bytes(ct) == size and ct.source.dims[2] == n_expert for ct in zf.compressed)
    refs = [source_experts(tiny_model, ct) for ct in zf.compressed]
    batch, excess = 4 * len(stores), n_expert - 4  # hot experts in a batch; what a store routed to all decodes beyond
    sm = budget_for(zf, zf.compressed[0], 0, size)[1] if sm_tier else 0  # two sign+mantissa planes a store
    layers = sorted({ct.name[: ct.name.index(".", 4) + 1] for ct in zf.compressed})  # "blk.N."

    def configure() -> None:
        if how == "plan":  # every store 4 hot slots (2 sm), and the room the shares' token budget has (apply_plan)
            for prefix in layers:
                assert lib.zipmoe_cache_set_slots(prefix.encode(), 4, 0, 2 if sm_tier else 0) == 0
            lib.zipmoe_cache_set_token_room((batch + excess) * size + len(stores))  # (sm: no room taken)
        elif how == "split":  # the same budgets in one call, as the memory monitor applies a split
            split = ffi.new("zipmoe_budget_split *", {"hot": batch * size, "sm": sm, "token_hot": 0 if sm_tier else
                                                      (batch + excess) * size + len(stores)})
            assert lib.zipmoe_cache_apply_split(split, POLICIES["tlfu"]) == 0
        else:  # as the loader applies them
            lib.zipmoe_cache_configure(batch * size, 0, sm, POLICIES["tlfu"])
            lib.zipmoe_cache_set_token_hot((batch + excess) * size + len(stores))  # (the shares are rounded down)

    def run(ids: np.ndarray) -> None:
        for k, st in enumerate(stores):
            assert all(r >= 0 for r in st.materialize(ids, 2))
            np.testing.assert_array_equal(st.weights[st.where], refs[k][ids])

    try:
        configure()
        lib.zipmoe_cache_begin_graph(2)
        for t in range(n_expert):
            run(np.array([[t, (t + 3) % n_expert]]))
        assert stats()["hot_bytes"] == (batch if sm_tier else batch + excess) * size
        configure()  # as another model's load (or the monitor) configures it: still token-sized until the next graph
        lib.zipmoe_cache_begin_graph(5)  # more than the stores that keep 4 experts decoded in generation
        assert stats()["hot_bytes"] == batch * size
        lib.zipmoe_stats_reset()
        run(np.arange(n_expert).reshape(1, -1))
        assert stats()["peak_hot_bytes"] == (batch + excess) * size
        lib.zipmoe_cache_begin_graph(2)  # generation again: the tier grows back as misses come
        for t in range(n_expert):
            run(np.array([[t, (t + 5) % n_expert]]))
        assert stats()["hot_bytes"] == (batch if sm_tier else batch + excess) * size
        assert stats()["peak_hot_bytes"] == (batch + excess) * size
        assert stats()["decoding_bytes"] == 0  # (counted from the plan's places to its publish)
    finally:
        lib.zipmoe_cache_set_slots(ffi.NULL, 0, 0, 0)


@pytest.mark.parametrize("how", ["shares", "plan"])
def test_a_step_of_a_few_tokens_stays_in_generation_s_tier_within_the_budget(zipmoe_model, tiny_model, stats, how):
    """A step that verifies drafted tokens or serves parallel slots routes a few tokens' top-k, more than some stores
    keep decoded in generation. It stays in generation's tier, which holds back what one store decodes beyond its
    slots (only one store at a time does), and keeps holding it back for the steps that follow: no trim to a batch's
    tier between steps and single tokens, every value exact, and the decoded bytes within generation's budget."""
    zf = zreader.open_zipmoe(zipmoe_model)
    stores = [Store(zipmoe_model, ct) for ct in zf.compressed]
    size, n_expert = expert_bytes(zf.compressed[0]), zf.compressed[0].source.dims[2]
    assert all(expert_bytes(ct) == size and ct.source.dims[2] == n_expert for ct in zf.compressed)
    refs = [source_experts(tiny_model, ct) for ct in zf.compressed]
    batch, tokens = 2 * len(stores), 5 * len(stores)  # a step of 3 tokens (top-2) routes up to 6 experts a store
    layers = sorted({ct.name[: ct.name.index(".", 4) + 1] for ct in zf.compressed})
    if how == "plan":  # every store 2 hot slots, and generation's room beyond them (apply_plan)
        for prefix in layers:
            assert lib.zipmoe_cache_set_slots(prefix.encode(), 2, 0, 0) == 0
        lib.zipmoe_cache_set_token_room(tokens * size + len(stores))  # (the shares are rounded down)
    else:
        lib.zipmoe_cache_configure(batch * size, 0, 0, POLICIES["lfuda"])
        lib.zipmoe_cache_set_token_hot(tokens * size + len(stores))
    lib.zipmoe_cache_set_reserve((n_expert - 2) * size)
    rng = np.random.default_rng(7)

    def step(n_tokens: int) -> int:
        ids = np.array([rng.choice(n_expert, 2, replace=False) for _ in range(n_tokens)])
        lib.zipmoe_cache_begin_step(min(2 * n_tokens, n_expert))  # as the glue counts a step's routing
        for k, st in enumerate(stores):
            assert all(r >= 0 for r in st.materialize(ids, 2))
            np.testing.assert_array_equal(st.weights[st.where], refs[k][ids])
            s = stats()  # the pages kept for the decodes beyond a store's slots are within the room held back
            assert s["hot_bytes"] + s["pool_bytes"] <= tokens * size + len(stores), s
        return stats()["hot_bytes"]

    try:
        for _ in range(4 * n_expert):  # single tokens fill generation's tier
            step(1)
        assert stats()["hot_bytes"] == tokens * size
        lib.zipmoe_stats_reset()
        held = step(3)  # the first step holds back one store's experts beyond its slots, once
        assert batch * size < held < tokens * size
        kept = [step(n) for n in [1, 2, 3, 1, 1, 3, 2, 1, 2, 3] * 4]
        # 6 routed of a store that keeps 5 goes 1 beyond; holding 1 back leaves a store 4 (the shares carry whole
        # experts), so 2 are held back, once: never trimmed further (a batch's tier would be batch * size)
        assert min(kept) >= (tokens - 2) * size
        before = stats()["hot_bytes"]
        lib.zipmoe_cache_begin_graph(6)  # a short prompt (its last token's logits) that the room held back covers
        assert stats()["hot_bytes"] == before
        lib.zipmoe_cache_begin_step(n_expert)  # a whole prompt's logits: a batch, which takes the batch's tier back
        assert stats()["hot_bytes"] == batch * size
        assert stats()["peak_resident_bytes"] <= tokens * size
        assert stats()["peak_hot_bytes"] <= tokens * size
        assert stats()["decoding_bytes"] == 0
    finally:
        lib.zipmoe_cache_set_slots(ffi.NULL, 0, 0, 0)


def test_a_shrink_in_generation_keeps_no_evicted_pages_beside_the_full_tier(zipmoe_model, tiny_model, stats):
    """In generation (token mode) a miss takes its victim's place, so the pages of experts a shrink evicts are not
    kept for the next decodes (zipmoe_cache_set_reserve's pool): generation's hot tier holds that room already, and
    kept pages came on top of it (by up to the whole reserve) until the next prompt."""
    zf = zreader.open_zipmoe(zipmoe_model)
    stores = [Store(zipmoe_model, ct) for ct in zf.compressed]
    size, n_expert = expert_bytes(zf.compressed[0]), zf.compressed[0].source.dims[2]
    refs = [source_experts(tiny_model, ct) for ct in zf.compressed]
    batch, excess = 4 * len(stores), n_expert - 4

    def configure(hot: int) -> None:  # as the memory monitor applies a budget split by shares
        lib.zipmoe_cache_configure(hot * size, 0, 0, POLICIES["tlfu"])
        lib.zipmoe_cache_set_reserve(excess * size)
        lib.zipmoe_cache_set_token_hot((hot + excess) * size + len(stores))

    def tokens(n: int, step: int) -> None:
        for t in range(n):
            ids = np.array([[t % n_expert, (t + step) % n_expert]])
            for k, st in enumerate(stores):
                assert all(r >= 0 for r in st.materialize(ids, 2))
                np.testing.assert_array_equal(st.weights[st.where], refs[k][ids])

    try:
        configure(batch)
        lib.zipmoe_cache_begin_graph(2)
        tokens(2 * n_expert, 3)  # the tier grows to generation's budget, in slots
        assert stats()["hot_bytes"] == (batch + excess) * size
        configure(batch - len(stores))  # one expert a store less
        lib.zipmoe_cache_begin_graph(2)
        tokens(n_expert, 5)
        s = stats()
        assert s["hot_bytes"] == (batch - len(stores) + excess) * size, s
        assert s["hot_bytes"] + s["pool_bytes"] <= (batch - len(stores) + excess) * size + len(stores), s
    finally:
        lib.zipmoe_cache_set_reserve(0)


def test_generation_without_a_hot_tier_lends_the_allowance_to_the_warm_tier(zipmoe_model, tiny_model, stats):
    """With every expert kept compressed, a prompt decodes each routed expert anew into the allowance for the tensor
    in flight (zipmoe_cache_set_reserve), a token only its few misses: in generation the reserve keeps their pages
    and the warm tier grows by the rest (zipmoe_cache_begin_graph), and a larger graph takes it back before any
    store decodes. The values stay the source's throughout."""
    zf = zreader.open_zipmoe(zipmoe_model)
    stores = [Store(zipmoe_model, ct) for ct in zf.compressed]
    size, n_expert = expert_bytes(zf.compressed[0]), zf.compressed[0].source.dims[2]
    refs = [source_experts(tiny_model, ct) for ct in zf.compressed]
    data = sum(ct.data.nbytes for ct in zf.compressed)
    warm, reserve, routed = data // 4, n_expert * size, 2
    need = routed * max(expert_bytes(ct) for ct in zf.compressed)
    assert warm + reserve - need < data, "the test needs experts that no tier keeps"

    def run(ids: np.ndarray) -> None:
        for k, st in enumerate(stores):
            assert all(r >= 0 for r in st.materialize(ids, 2))
            np.testing.assert_array_equal(st.weights[st.where], refs[k][ids])

    def tokens(step: int) -> None:
        for t in range(3 * n_expert):
            run(np.array([[t % n_expert, (t + step) % n_expert]]))

    try:
        lib.zipmoe_cache_configure(0, warm, 0, POLICIES["tlfu"])
        lib.zipmoe_cache_set_reserve(reserve)
        lib.zipmoe_cache_begin_graph(n_expert)  # prompts first (pages of these small experts are not kept: see
        # test_llama for the pool's trim)
        run(np.arange(n_expert).reshape(1, -1))
        run(np.arange(n_expert).reshape(1, -1))  # (each store's plan evicts what the one before decoded)
        lib.zipmoe_cache_begin_graph(routed)  # generation: the pages beyond a token's go back at once
        assert stats()["pool_bytes"] <= need
        tokens(3)
        s = stats()
        assert warm < s["warm_bytes"] <= warm + reserve - need, s
        assert s["pool_bytes"] <= need and s["misses"] > 0, s
        lib.zipmoe_cache_begin_graph(n_expert)  # a prompt again: the warm tier gives the room back first
        assert stats()["warm_bytes"] <= warm
        lib.zipmoe_stats_reset()
        run(np.arange(n_expert).reshape(1, -1))
        assert stats()["warm_bytes"] <= warm
        lib.zipmoe_cache_begin_graph(routed)
        tokens(5)
        assert warm < stats()["warm_bytes"] <= warm + reserve - need
    finally:
        lib.zipmoe_cache_set_reserve(0)


def test_steps_of_a_few_tokens_without_a_hot_tier_keep_the_warm_tier_they_grew(zipmoe_model, tiny_model, stats):
    """Without a hot tier, generation's warm tier holds the allowance beyond what a graph's misses decode into. A step
    of two tokens decodes into more than a token: its need is held for the steps that follow, so that single tokens
    and steps in turns never take warm experts back at a graph's start (each time, every compressed copy given up
    would be read from disk again)."""
    zf = zreader.open_zipmoe(zipmoe_model)
    stores = [Store(zipmoe_model, ct) for ct in zf.compressed]
    size, n_expert = expert_bytes(zf.compressed[0]), zf.compressed[0].source.dims[2]
    refs = [source_experts(tiny_model, ct) for ct in zf.compressed]
    data = sum(ct.data.nbytes for ct in zf.compressed)
    warm, reserve = data // 4, n_expert * size
    rng = np.random.default_rng(3)

    def step(n_tokens: int) -> int:
        before = stats()["warm_bytes"]
        lib.zipmoe_cache_begin_step(2 * n_tokens)
        trimmed = before - stats()["warm_bytes"]
        ids = np.array([rng.choice(n_expert, 2, replace=False) for _ in range(n_tokens)])
        for k, st in enumerate(stores):
            assert all(r >= 0 for r in st.materialize(ids, 2))
            np.testing.assert_array_equal(st.weights[st.where], refs[k][ids])
        return trimmed

    try:
        lib.zipmoe_cache_configure(0, warm, 0, POLICIES["lfuda"])
        lib.zipmoe_cache_set_reserve(reserve)
        for _ in range(3 * n_expert):
            step(1)
        assert stats()["warm_bytes"] > warm  # generation's tier grew into the allowance
        step(2)  # the first step takes its room once
        assert [step(n) for n in [1, 2, 1, 1, 2, 2, 1, 2] * 4] == [0] * 32
        assert warm < stats()["warm_bytes"] <= warm + reserve - 4 * size
    finally:
        lib.zipmoe_cache_set_reserve(0)


def test_warm_shares_carry_what_a_store_cannot_use_to_the_next(zipmoe_model, tiny_model, stats):
    """A store's share of the warm budget holds whole regions; what it holds beyond them goes to the next store, as
    the hot tier's slots do: a budget a quarter of a region a store short of every region leaves out about a
    quarter as many regions as there are stores (and what regions larger than the mean take), not one a store
    (7.0 of the 6 stores' regions before the shares carried, 3.3 after)."""
    zf = zreader.open_zipmoe(zipmoe_model)
    stores = [Store(zipmoe_model, ct) for ct in zf.compressed]
    refs = [source_experts(tiny_model, ct) for ct in zf.compressed]
    n_expert = zf.compressed[0].source.dims[2]
    data = sum(ct.data.nbytes for ct in zf.compressed)
    region = max(-(-ct.data.nbytes // ct.source.dims[2]) for ct in zf.compressed)
    lib.zipmoe_cache_configure(0, data - len(stores) * region // 4, 0, POLICIES["lfu"])
    for t in range(3):
        ids = np.arange(n_expert).reshape(1, -1)
        for k, st in enumerate(stores):
            assert all(r >= 0 for r in st.materialize(ids, 2))
            np.testing.assert_array_equal(st.weights[st.where], refs[k][ids])
    left_out = (data - stats()["warm_bytes"]) / region
    assert left_out <= 0.75 * len(stores), (left_out, len(stores))


@pytest.mark.parametrize("turns", [1, 0])
def test_a_plan_evicts_what_the_store_before_it_decoded_beyond_its_limits(zipmoe_model, turns):
    """The engine runs each op's matmul before the next expert tensor's op, so a store's plan evicts what the other
    stores' last invocations decoded beyond their limits, those of its own layer too: one tensor in flight. With
    store turns off (a graph that breaks that order), only the stores of other layers."""
    zf = zreader.open_zipmoe(zipmoe_model)
    stores = [Store(zipmoe_model, ct) for ct in zf.compressed]
    first, second = [k for k, ct in enumerate(zf.compressed) if ct.name.startswith("blk.0.")][:2]
    lib.zipmoe_cache_configure(budget_for(zf, zf.compressed[first], 1)[0], 0, 0, lib.ZIPMOE_POLICY_LRU)
    lib.zipmoe_cache_set_store_turns(turns)
    try:
        a, b = stores[first], stores[second]
        a.materialize(np.array([[0, 1, 2, 3]]), 2)  # 3 beyond a's one hot slot, pinned for its matmul
        b.materialize(np.array([[0]]), 2)
        decoded = sum(lib.zipmoe_store_place(a.handle, e) >= 0 for e in range(4))
        assert decoded == (1 if turns else 4)
    finally:
        lib.zipmoe_cache_set_store_turns(1)


def test_activation_counts_are_tokens_routed(zipmoe_model):
    zf = zreader.open_zipmoe(zipmoe_model)
    store = Store(zipmoe_model, zf.compressed[0])
    store.materialize(np.array([[1, 2], [1, 3], [1, 2]]), 2)
    counts = np.zeros(zf.compressed[0].source.dims[2], np.uint64)
    assert lib.zipmoe_store_activations(store.handle, ffi.cast("uint64_t *", ffi.from_buffer(counts)), counts.size) == counts.size
    assert counts.tolist()[:4] == [0, 3, 2, 1]


def routing_log(prefix: str, n_expert: int, max_tokens: int = 1024) -> list[list[int]]:
    words = (n_expert + 63) // 64
    masks = np.zeros(max_tokens * words, np.uint64)
    n = lib.zipmoe_cache_routing(prefix.encode(), ffi.cast("uint64_t *", ffi.from_buffer(masks)), words, max_tokens)
    assert n >= 0
    return [[e for e in range(n_expert) if int(masks[t * words + e // 64]) >> (e % 64) & 1] for t in range(n)]


def test_routing_log_keeps_generated_tokens_oldest_first(zipmoe_model):
    """The planner's recency model reads the order in which invocations routed: generated tokens on the slow path
    and on the lock-free fast path (all routed experts decoded), a prompt's batch as one entry; 512 at most."""
    zf = zreader.open_zipmoe(zipmoe_model)
    ct = zf.compressed[0]
    n_expert = ct.source.dims[2]
    store = Store(zipmoe_model, ct)
    assert routing_log(ct.name, n_expert) == []
    store.materialize(np.array([[0, 1], [2, 3]]), 2)  # a prompt: one entry, every expert it routed to
    store.materialize(np.array([[1, 0]]), 2)  # fast path: both decoded already
    store.materialize(np.array([[4, 2]]), 1)  # slow path: 4 is new
    assert routing_log(ct.name, n_expert) == [[0, 1, 2, 3], [0, 1], [2, 4]]
    assert routing_log(ct.name, n_expert, max_tokens=1) == [[2, 4]]
    assert routing_log("no.such.tensor", n_expert) == []
    for t in range(600):
        store.materialize(np.array([[t % n_expert]]), 1)
    log = routing_log(ct.name, n_expert)
    assert len(log) == 512 and log[-1] == [599 % n_expert] and log[0] == [(600 - 512) % n_expert]
    assert lib.zipmoe_cache_routing(ct.name.encode(), ffi.new("uint64_t[1]"), 0, 1) < 0  # words too few


@pytest.mark.parametrize("policy", ["lru", "tlfu"])
@pytest.mark.parametrize("slots", [(1, 0, 0), (2, 0, 0), (3, 0, 0), (2, 0, 3), (1, 0, 4), (0, 2, 0), (0, 3, 2), (0, 0, 3)])
def test_the_planners_recency_model_predicts_the_runtimes_hits(zipmoe_model, stats, slots, policy):
    """The planner models a layer's tiers as one stack: under LRU an expert is hot when fewer than `hot` experts
    were used since it was, under token-weighted LFU when fewer than `hot` rank above it by uses (then sm, or warm
    then sm without a hot tier). The runtime must agree token by token, ties and all (with fewer hot slots than
    routed experts, too: another layer's invocation trims this one's between tokens, as in a model)."""
    from pyzipmoe.plan import routing as plan_routing

    zf = zreader.open_zipmoe(zipmoe_model)
    ct = zf.compressed[0]
    other = next(c for c in zf.compressed if c.name.split(".")[1] != ct.name.split(".")[1])
    n_expert = ct.source.dims[2]
    lib.zipmoe_cache_configure(UNBOUNDED, 0, 0, lib.ZIPMOE_POLICY_LRU if policy == "lru" else lib.ZIPMOE_POLICY_TOKEN_LFU)
    assert lib.zipmoe_cache_set_slots(ct.name.encode(), *slots) == 0
    assert lib.zipmoe_cache_set_slots(other.name.encode(), 1, 0, 0) == 0  # it plans every token, trimming ct's
    try:
        store, other_layer = Store(zipmoe_model, ct), Store(zipmoe_model, other)
        rng = np.random.default_rng(sum(slots))
        routing = np.zeros((64, n_expert), bool)
        last = [0, 1]
        hits = []
        for t in range(len(routing)):
            ids = [e if rng.random() < 0.5 else int(rng.integers(n_expert)) for e in last]
            if ids[0] == ids[1]:
                ids[1] = (ids[0] + 1) % n_expert
            routing[t, ids] = True
            before = stats()
            store.materialize(np.array([ids]), 2)
            after = stats()
            hits.append([after[k] - before[k] for k in ("hits_hot", "hits_warm", "hits_sm", "misses")])
            other_layer.materialize(np.array([ids]), 1)
            last = ids
        assert [[e for e in range(n_expert) if routing[t, e]] for t in range(len(routing))] == \
            routing_log(ct.name, n_expert)
        design = plan_routing.recency_design(routing, 2, history=0, policy=policy)
        assert design.tier_counts(*slots).tolist() == hits
    finally:
        lib.zipmoe_cache_set_slots(ffi.NULL, 0, 0, 0)


def test_reading_activations_while_layers_plan_does_not_deadlock(zipmoe_model):
    """A plan trims the other layers' stores, taking the store list's lock under its own; the controller reads
    activation counts taking the list's lock, then each store's. Found as a hang of a planner run."""
    zf = zreader.open_zipmoe(zipmoe_model)
    layers = {}
    for ct in zf.compressed:
        layers.setdefault(ct.name.split(".")[1], ct)
    cts = list(layers.values())[:2]
    for ct in cts:
        assert lib.zipmoe_cache_set_slots(ct.name.encode(), 1, 0, 0) == 0
    try:
        stores = [Store(zipmoe_model, ct) for ct in cts]
        n_expert = cts[0].source.dims[2]
        done = threading.Event()

        def read_counts() -> None:
            counts = ffi.new("uint64_t[]", n_expert)
            while not done.is_set():
                for ct in cts:
                    lib.zipmoe_cache_activations(ct.name.encode(), counts, n_expert)

        def generate() -> None:
            rng = np.random.default_rng(0)
            for _ in range(300):
                for store in stores:
                    store.materialize(rng.integers(0, n_expert, (1, 2)), 2)

        reader, worker = threading.Thread(target=read_counts, daemon=True), threading.Thread(target=generate, daemon=True)
        reader.start()
        worker.start()
        worker.join(timeout=60)
        done.set()
        reader.join(timeout=10)
        assert not worker.is_alive() and not reader.is_alive(), "deadlock"
    finally:
        lib.zipmoe_cache_set_slots(ffi.NULL, 0, 0, 0)


@pytest.mark.parametrize("hot", ["unbounded", "none"])
def test_a_late_sibling_neither_decodes_nor_counts_again(zipmoe_model, stats, hot):
    """ggml may run one thread of an invocation after its siblings finished it (a descheduled thread): that thread
    must find the experts decoded, not decode them again (ZIPMOE_CACHE=none would) nor count their use twice."""
    zf = zreader.open_zipmoe(zipmoe_model)
    lib.zipmoe_cache_configure(UNBOUNDED if hot == "unbounded" else 0, 0, 0, lib.ZIPMOE_POLICY_TOKEN_LFU)
    store = Store(zipmoe_model, zf.compressed[0])
    ids = np.ascontiguousarray([[1, 2]], np.int32)
    counts = np.zeros(zf.compressed[0].source.dims[2], np.uint64)
    for step in range(1, 4):
        lib.zipmoe_stats_reset()
        key = ffi.new("char[1]")
        store.keys.append(key)
        for ith in (1, 0):  # thread 1 does all of the work and publishes; thread 0 comes late
            assert lib.zipmoe_store_materialize(store.handle, key, ffi.from_buffer(ids), 2, 1, 4, 8, ffi.NULL, ith, 2) >= 0
        decoded = stats()["experts_decoded"]
        assert decoded == (2 if step == 1 or hot == "none" else 0), (step, decoded)
        lib.zipmoe_store_activations(store.handle, ffi.cast("uint64_t *", ffi.from_buffer(counts)), counts.size)
        assert counts.tolist()[:3] == [0, step, step]


def prefill(stores: list[Store], threads: int = 2) -> dict[str, int]:
    handles = ffi.new("zipmoe_store *[]", [s.handle for s in stores])
    out = ffi.new("zipmoe_prefill_stats *")
    rc = lib.zipmoe_cache_prefill(handles, len(stores), threads, out)
    assert rc >= 0
    assert rc == out.experts
    return {"experts": out.experts, "failed": out.failed}


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_prefill_fills_the_tiers_exactly_and_counts_no_routing(zipmoe_model, tiny_model, stats, threads):
    """At load the tiers are filled as generation would fill them (the last batch decoded, the earlier ones in
    the compressed tiers), bit-exact, with none of it counted as the model's routing."""
    zf = zreader.open_zipmoe(zipmoe_model)
    stores = [Store(zipmoe_model, ct) for ct in zf.compressed]
    ct, store = zf.compressed[0], stores[0]
    n_expert = ct.source.dims[2]
    hot, _ = budget_for(zf, ct, 2)
    sm_size = expert_bytes(ct) // 2
    _, sm = budget_for(zf, ct, 0, 3 * sm_size)  # three sign+mantissa planes a store
    lib.zipmoe_cache_configure(hot, 0, sm, lib.ZIPMOE_POLICY_LRU)
    got = prefill(stores, threads)
    assert got == {"experts": 5 * len(stores), "failed": 0}
    st = stats()
    assert st["materialize_calls"] == 0 and st["hits_hot"] + st["hits_warm"] + st["hits_sm"] + st["misses"] == 0
    assert st["stall_ns"] == 0 and st["experts_decoded"] == 5 * len(stores)
    assert st["hot_bytes"] == 2 * sum(expert_bytes(c) for c in zf.compressed)
    assert st["sm_bytes"] == 3 * sum(expert_bytes(c) // 2 for c in zf.compressed)
    assert routing_log(ct.name, n_expert) == []
    counts = np.zeros(n_expert, np.uint64)
    lib.zipmoe_store_activations(store.handle, ffi.cast("uint64_t *", ffi.from_buffer(counts)), n_expert)
    assert not counts.any()
    ref = source_experts(tiny_model, ct)
    for e in (0, 1):  # the last batch stays decoded
        np.testing.assert_array_equal(store.decoded(e), ref[e])
    # generation finds them: the hot ones decoded, the sm ones without reading their planes again
    lib.zipmoe_stats_reset()
    store.materialize(np.array([[0, 1]]), 2)
    assert stats()["hits_hot"] == 2 and stats()["experts_decoded"] == 0
    store.materialize(np.array([[2, 3]]), 2)
    assert stats()["hits_sm"] == 2 and stats()["misses"] == 0
    for e in (2, 3):
        np.testing.assert_array_equal(store.decoded(e), ref[e])


def test_the_prefill_teaches_no_order_to_the_first_prompts_read_ahead(zipmoe_model, tiny_model, stats):
    """A store reads ahead for the store the graph invoked after it last time. The prefill invokes the stores too,
    layer by layer in its own order; had it taught that order, a model's first prompt would read ahead for stores
    that come later or came already, and read their experts again for themselves (1.8 GB read for 1.1 GB
    decoded on the 2.8g model). The first prompt reads each decoded expert's region once, and nothing ahead."""
    zf = zreader.open_zipmoe(zipmoe_model)
    stores = [Store(zipmoe_model, ct) for ct in zf.compressed]
    n_expert = zf.compressed[0].source.dims[2]
    lib.zipmoe_cache_configure(budget_for(zf, zf.compressed[0], 1)[0], 0, 0, lib.ZIPMOE_POLICY_TOKEN_LFU)
    prefill(stores)
    lib.zipmoe_stats_reset()
    prompt = np.arange(n_expert).reshape(-1, 2)  # routes to every expert
    for store in reversed(stores):  # not the prefill's order
        assert all(r >= 0 for r in store.materialize(prompt, 2))
        time.sleep(0.02)  # a read-ahead would run meanwhile
    st = stats()
    assert st["misses"] == st["experts_decoded"] == len(stores) * (n_expert - 1)  # all but the hot expert 0
    assert st["bytes_read_ahead"] == 0
    assert st["bytes_read"] == sum(ct.expert.span(e).size for ct in zf.compressed for e in range(1, n_expert))
    ref = source_experts(tiny_model, zf.compressed[0])
    for e in range(n_expert):
        np.testing.assert_array_equal(stores[0].decoded(e), ref[e])


def test_prefill_without_a_budget_decodes_every_expert(zipmoe_model, tiny_model, stats):
    zf = zreader.open_zipmoe(zipmoe_model)
    stores = [Store(zipmoe_model, ct) for ct in zf.compressed]
    assert prefill(stores)["experts"] == sum(ct.source.dims[2] for ct in zf.compressed)
    for ct, store in zip(zf.compressed, stores):
        np.testing.assert_array_equal(store.weights, source_experts(tiny_model, ct))
    lib.zipmoe_stats_reset()
    stores[0].materialize(np.array([[0, 1], [2, 3]]), 2)
    assert stats()["experts_decoded"] == 0


def disk_read_bytes() -> int:
    """Bytes this process has had read from a block device (/proc/self/io read_bytes)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def cold_copy(src: Path, dst: Path) -> Path:
    """src copied to dst, written out and dropped from the page cache (clean pages: no privilege needed)."""
    dst.write_bytes(src.read_bytes())
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return dst


def test_a_model_that_stays_decoded_is_read_from_disk_once(zipmoe_model, tiny_model, tmp_path):
    """Where the hot tier holds every expert, binding a store has the kernel read all its bytes ahead into the
    page cache; its reads must then come from there, not around it (O_DIRECT) from the disk again, which read a
    Q4_K_M file 1.8 times at 150% of its size."""
    control = cold_copy(zipmoe_model, tmp_path / "control.gguf")
    before = disk_read_bytes()
    control.read_bytes()
    if disk_read_bytes() - before < control.stat().st_size // 2:
        pytest.skip(f"reads of {tmp_path} come from no block device (/proc/self/io counts none)")
    model = cold_copy(zipmoe_model, tmp_path / "model.gguf")
    zf = zreader.open_zipmoe(model)  # (reads the header and indexes: before the count starts)
    before = disk_read_bytes()
    stores = [Store(model, ct) for ct in zf.compressed]
    assert prefill(stores)["experts"] == sum(ct.source.dims[2] for ct in zf.compressed)
    time.sleep(0.2)  # the kernel's read-ahead, had it been asked twice
    data = sum(ct.data.nbytes for ct in zf.compressed)
    assert disk_read_bytes() - before < 1.3 * data + 64 * 1024
    for ct, store in zip(zf.compressed, stores):
        np.testing.assert_array_equal(store.weights, source_experts(tiny_model, ct))


def test_prefill_leaves_a_damaged_expert_to_fail_when_routed(zipmoe_model, tmp_path):
    bad, zf = damaged_copy(zipmoe_model, tmp_path, 1)
    ct = zf.compressed[0]
    stores = [Store(bad, c) for c in zf.compressed]
    got = prefill(stores)
    assert got["failed"] == 1
    assert got["experts"] == sum(c.source.dims[2] for c in zf.compressed) - ct.source.dims[2]
    assert lib.zipmoe_store_take_error(stores[0].handle, ffi.NULL, 0) == 0  # nothing for the engine yet
    assert any(r == lib.ZIPMOE_ERR_CHECKSUM for r in stores[0].materialize(np.array([[1]]), 1))


def test_prefill_of_nothing(zipmoe_model):
    assert lib.zipmoe_cache_prefill(ffi.NULL, 0, 2, ffi.NULL) == 0
    assert lib.zipmoe_cache_prefill(ffi.NULL, 1, 2, ffi.NULL) == lib.ZIPMOE_ERR_ARG


def test_the_default_split_keeps_experts_compressed_only_where_nearly_all_fit_so():
    """zipmoe_budget_default_hot_share (in the library; pyzipmoe.runtime.controller asks it through cffi): every
    expert compressed (0) where the tiers hold >= 90% of the compressed bytes and < 90% of the BF16 bytes, and warm
    hits decode fast; decoded-only (1) everywhere else."""
    from pyzipmoe.runtime.cache_control import default_hot_share

    sizes = [(3000, 8, 2000), (3000, 8, 2000)]  # BF16 6000, compressed 4000
    assert [default_hot_share(t, sizes, True) for t in (3500, 3600, 4000, 5399, 5400, 9000)] == [1, 0, 0, 0, 1, 1]
    assert {default_hot_share(t, sizes, False) for t in (3500, 3600, 4000, 5399, 5400)} == {1.0}
    assert default_hot_share(4000, [], True) == 1.0 and default_hot_share(0, sizes, True) == 1.0


# ------------------------------------------------------------------ raw stores (a plain GGUF's experts, any type)


class RawStore(Store):
    """A raw store over expert bytes at `offset` of `path`: n_expert experts of `rows` rows of `row_bytes` each."""

    def __init__(self, path: Path, offset: int, n_expert: int, rows: int, row_bytes: int, name: str = "blk.0.ffn_up_exps.weight"):
        self.keys = []
        out = ffi.new("zipmoe_store **")
        ne = ffi.new("int64_t[4]", [row_bytes, rows, n_expert, 1])  # (the type only names: sizes are row_bytes')
        assert lib.zipmoe_store_open_raw(name.encode(), 24, ne, row_bytes, out) == 0  # 24: GGML_TYPE_I8
        self.handle = ffi.gc(out[0], lib.zipmoe_store_free)
        dst, size = ffi.new("void **"), ffi.new("size_t *")
        with open(path, "rb") as f:
            assert lib.zipmoe_store_bind(self.handle, f.fileno(), offset, dst, size) == 0
        self.weights = np.frombuffer(ffi.buffer(dst[0], n_expert * rows * row_bytes), np.uint8).reshape(n_expert, -1)


def raw_file(tmp_path: Path, n_expert: int, rows: int, row_bytes: int, offset: int = 4133) -> tuple[Path, np.ndarray]:
    """A file with random expert bytes at an unaligned offset (GGUF aligns tensors to 32 bytes only)."""
    experts = np.random.default_rng(0).integers(0, 256, (n_expert, rows * row_bytes), np.uint8)
    path = tmp_path / "raw.bin"
    path.write_bytes(b"\x5a" * offset + experts.tobytes() + b"\xa5" * 100)
    return path, experts


def test_a_raw_store_says_what_it_serves_and_refuses_shapes_it_cannot(tmp_path):
    out = ffi.new("zipmoe_store **")
    for ne, row_bytes in (([64, 4, 8, 2], 68), ([64, 0, 8, 1], 68), ([64, 4, 8, 1], 0), ([0, 4, 8, 1], 68)):
        assert lib.zipmoe_store_open_raw(b"blk.0.ffn_up_exps.weight", 8, ffi.new("int64_t[4]", ne), row_bytes,
                                         out) == lib.ZIPMOE_ERR_ARG, (ne, row_bytes)
    assert lib.zipmoe_store_open_raw(b"blk.0.ffn_up_exps.weight", 8, ffi.new("int64_t[4]", [64, 300, 8, 1]), 68,
                                     out) == 0
    s = ffi.gc(out[0], lib.zipmoe_store_free)
    info = ffi.new("zipmoe_tensor_info *")
    lib.zipmoe_store_get_info(s, info)
    assert lib.zipmoe_store_is_raw(s) == 1 and lib.zipmoe_store_tensor(s) == ffi.NULL
    assert (info.codec, info.ggml_type, list(info.ne), info.n_expert) == (0, 8, [64, 300, 8, 1], 8)
    assert info.data_size == 8 * 300 * 68 and info.chunk_n % 64 == 0  # chunks of whole rows
    assert info.n_chunks == -(-300 // (info.chunk_n // 64))


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_a_raw_store_materialises_the_routed_experts_bytes_as_stored(tmp_path, stats, nth):
    n_expert, rows, row_bytes = 6, 100, 4099  # odd rows of an odd size, 400 KB experts: two chunks each
    path, ref = raw_file(tmp_path, n_expert, rows, row_bytes)
    store = RawStore(path, 4133, n_expert, rows, row_bytes)
    ids = np.array([[1, 5], [5, 3]])
    assert all(r >= 0 for r in store.materialize(ids, nth))
    np.testing.assert_array_equal(store.weights[store.where], ref[ids])  # what ggml_mul_mat_id reads
    st = stats()
    assert st["experts_decoded"] == 3 and st["misses"] == 3 and st["bytes_read"] >= 3 * rows * row_bytes
    assert st["hot_bytes"] == 3 * rows * row_bytes and st["warm_bytes"] == 0
    assert all(r >= 0 for r in store.materialize(np.array([[3, 1]]), nth))
    assert stats()["experts_decoded"] == 3  # kept: nothing read or copied again


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_raw_store_under_a_tiny_budget_keeps_only_decoded_experts_and_stays_exact(tmp_path, stats, policy):
    n_expert, rows, row_bytes = 8, 20, 51
    path, ref = raw_file(tmp_path, n_expert, rows, row_bytes)
    store = RawStore(path, 4133, n_expert, rows, row_bytes)
    expert = rows * row_bytes
    # room for two experts decoded and plenty compressed: a raw store keeps no compressed copy (the same bytes)
    lib.zipmoe_cache_configure(2 * expert + 1, 100 * expert, 100 * expert, POLICIES[policy])
    rng = np.random.default_rng(1)
    for _ in range(40):
        ids = rng.integers(0, n_expert, (int(rng.integers(1, 4)), 2))
        assert all(r >= 0 for r in store.materialize(ids, int(rng.integers(1, 4))))
        np.testing.assert_array_equal(store.weights[store.where], ref[ids])
        for e in set(ids.ravel()):
            np.testing.assert_array_equal(store.decoded(e), ref[e])
    st = stats()
    assert st["evictions"] > 0 and st["misses"] > 0
    assert st["warm_bytes"] == 0 and st["sm_bytes"] == 0 and st["hits_warm"] == 0 and st["hits_sm"] == 0
    assert st["hot_bytes"] <= 2 * expert + 6 * expert  # the budget, plus the invocation in flight


def test_a_raw_store_s_put_lays_each_chunk_of_whole_row_groups_into_its_place(tmp_path, stats):
    """An engine that keeps weights in a layout of its own (llama.cpp's repacked quantized types) gets each chunk
    read as stored and puts it into its place itself: whole groups of row_align rows, at their own offsets."""
    n_expert, rows, row_bytes, align = 4, 24, 20000, 8  # 480 KB experts: chunks of 16 and 8 rows (13 rounded up)
    path, ref = raw_file(tmp_path, n_expert, rows, row_bytes)
    out = ffi.new("zipmoe_store **")
    ne = ffi.new("int64_t[4]", [row_bytes, rows, n_expert, 1])
    assert lib.zipmoe_store_open_raw(b"blk.0.ffn_up_exps.weight", 24, ne, row_bytes, out) == 0
    handle = ffi.gc(out[0], lib.zipmoe_store_free)
    groups = []

    @ffi.callback("void(void *, void *, const void *, int64_t)")
    def put(ctx, dst, src, n_rows):  # a layout of its own: every byte inverted
        groups.append(n_rows)
        data = np.frombuffer(ffi.buffer(src, n_rows * row_bytes), np.uint8)
        ffi.buffer(dst, n_rows * row_bytes)[:] = (data ^ 0xFF).tobytes()

    assert lib.zipmoe_store_set_raw_put(handle, put, ffi.NULL, align) == 0
    info = ffi.new("zipmoe_tensor_info *")
    lib.zipmoe_store_get_info(handle, info)
    assert info.n_chunks == 2 and (info.chunk_n // row_bytes) % align == 0
    store = RawStore.__new__(RawStore)
    store.keys, store.handle = [], handle
    dst, size = ffi.new("void **"), ffi.new("size_t *")
    with open(path, "rb") as f:
        assert lib.zipmoe_store_bind(handle, f.fileno(), 4133, dst, size) == 0
    store.weights = np.frombuffer(ffi.buffer(dst[0], n_expert * rows * row_bytes), np.uint8).reshape(n_expert, -1)
    assert lib.zipmoe_store_set_raw_put(handle, put, ffi.NULL, align) == lib.ZIPMOE_ERR_ARG  # (bound already)
    ids = np.array([[0, 3], [2, 3]])
    assert all(r >= 0 for r in store.materialize(ids, 2))
    np.testing.assert_array_equal(store.weights[store.where], ref[ids] ^ 0xFF)
    assert sorted(groups) == sorted([16, 8] * 3) and sum(groups) == 3 * rows
