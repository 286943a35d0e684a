"""The cache replay (tools/bench/bench_replay.py) through the real store, and the LFUDA policy, on sequences whose
hits are counted by hand."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from helpers import load_tool, reset_cache

from pyzipmoe._native import ffi, lib
from pyzipmoe.file import reader as zreader
from pyzipmoe.plan.replay import belady_hits

UNBOUNDED = 2**64 - 1


@pytest.fixture(autouse=True)
def defaults():
    reset_cache()
    yield
    reset_cache()


def seq(*steps: list[int]) -> list[np.ndarray]:
    return [np.array(s, np.int32) for s in steps]


# capacity 2: 0 1 0 2 1 0
#   lru:    m m h m(evicts 1) m(evicts 0) m(evicts 2)                                  1 hit
#   lfu:    m m h(0: 2 uses) m(evicts 1) m(evicts 2, 1 use to 0's 2) h                 2 hits
#   lfuda:  m m h m(evicts 1, key 1: age 1; 2's key 1 + 1) m(tie 0/2 at 2: evicts 0) m  1 hit
#   fifo:   m m h m(evicts 0, the first in) h m                                        2 hits
#   belady: m m h m(evicts 0, used after 1) h m                                        2 hits
HAND = seq([0], [1], [0], [2], [1], [0])
EXPECTED = {"lru": 1, "lfu": 2, "tlfu": 2, "lfuda": 1, "fifo": 2}


@pytest.mark.parametrize("policy", list(EXPECTED))
def test_the_replay_counts_the_hits_of_a_sequence_counted_by_hand(zipmoe_model, policy):
    bench = load_tool("bench/bench_replay.py")
    source = bench.Source("hand", [HAND], n_expert=8, k=1, layers_total=1)
    st = bench.run_policy(zipmoe_model, source, policy, hot=2, warm=0)
    assert st["hits_hot"] == EXPECTED[policy], policy
    assert st["hits_hot"] + st["hits_warm"] + st["hits_sm"] + st["misses"] == 6
    assert st["hits_hot"] <= belady_hits(HAND, 2) == 2


class OneStore:
    """Layer 0's gate store under exactly `hot` decoded slots."""

    def __init__(self, path, policy: int, hot: int):
        lib.zipmoe_cache_configure(UNBOUNDED, 0, 0, policy)
        zf = zreader.open_zipmoe(path)
        ct = next(c for c in zf.compressed if c.name == "blk.0.ffn_gate_exps.weight")
        with open(path, "rb") as f:
            f.seek(ct.index.file_offset)
            self.index = f.read(ct.index.nbytes)
            out = ffi.new("zipmoe_store **")
            assert lib.zipmoe_store_open(ct.name.encode(), self.index, len(self.index), ct.data.nbytes, out) == 0
            self.handle = ffi.gc(out[0], lib.zipmoe_store_free)
            assert lib.zipmoe_store_bind(self.handle, f.fileno(), ct.data.file_offset, ffi.new("void **"),
                                         ffi.new("size_t *")) == 0
        assert lib.zipmoe_cache_set_slots(b"", hot, 0, 0) == 0
        self.keys = [ffi.new("char[1]"), ffi.new("char[1]")]
        self.n = 0

    def route(self, *experts: int) -> None:
        ids = np.array(experts, np.int32)
        self.n += 1
        assert lib.zipmoe_store_materialize(self.handle, self.keys[self.n % 2], ffi.from_buffer(ids), len(ids), 1, 4,
                                            4 * len(ids), ffi.NULL, 0, 1) >= 0

    def hot(self) -> set[int]:
        return {e for e in range(8) if lib.zipmoe_store_place(self.handle, e) >= 0}


def test_lfuda_ages_out_an_expert_that_lfu_keeps_for_its_old_uses(zipmoe_model):
    # 2 slots; 0 used three times, then 1, 2, 3, 4 once each.
    #   lfu keeps 0 for ever (3 uses beat 1).
    #   lfuda: 2 evicts 1 (key 1): age 1, 2's key 2; 3 evicts 2 (key 2): age 2, 3's key 3 = 0's (0 + 3);
    #   4 evicts the lower id of the tie: 0.
    for policy, keeps_0 in ((lib.ZIPMOE_POLICY_LFU, True), (lib.ZIPMOE_POLICY_LFUDA, False)):
        store = OneStore(zipmoe_model, policy, 2)
        for e in (0, 0, 0, 1, 2, 3, 4):
            store.route(e)
        assert (0 in store.hot()) == keeps_0, policy
        assert 4 in store.hot()
        del store
        gc.collect()


def test_lfuda_remembers_the_uses_of_an_evicted_expert(zipmoe_model):
    # 2 slots; 0 0 0 1 1: uses 0:3, 1:2. 2 evicts 1 (key 2): age 2; keys 0:3, 2:3.
    # 1 comes back with its 2 earlier uses (a ghost count): key 2 + 3 = 5; the tie 0/2 at 3 evicts 0, age 3.
    # 3 (key 3 + 1 = 4) evicts 2 (key 3), not 1 (5). Without the ghost count 1's key would be 3 and go first (lower id).
    store = OneStore(zipmoe_model, lib.ZIPMOE_POLICY_LFUDA, 2)
    for e in (0, 0, 0, 1, 1, 2, 1):
        store.route(e)
    assert store.hot() == {1, 2}
    store.route(3)
    assert store.hot() == {1, 3}


def test_the_runtime_takes_lfuda_by_name():
    from pyzipmoe.runtime.cache_control import policy_id
    from pyzipmoe.runtime.config import POLICIES

    assert "lfuda" in POLICIES and policy_id("lfuda") == lib.ZIPMOE_POLICY_LFUDA
    assert lib.zipmoe_cache_configure(UNBOUNDED, 0, 0, lib.ZIPMOE_POLICY_LFUDA) == 0
    assert lib.zipmoe_cache_configure(UNBOUNDED, 0, 0, lib.ZIPMOE_POLICY_LFUDA + 1) == lib.ZIPMOE_ERR_ARG


def test_the_replay_reads_a_recorded_routing_and_skips_a_layer_s_empty_step(zipmoe_model, tmp_path):
    from pyzipmoe.plan import trace

    bench = load_tool("bench/bench_replay.py")
    routed = np.zeros((6, 2, 8), bool)
    for t, e in enumerate([0, 1, 0, 2, 1, 0]):  # layer 0: HAND; layer 1: a prompt step that routed nothing there
        routed[t, 0, e] = True
        routed[t, 1, e] = t > 0
    tokens = np.array([4, 1, 1, 1, 1, 1], np.int32)
    trace.save(tmp_path / "r.npz", trace.Routing(routed=routed, layers=np.array([0, 1], np.int32), tokens=tokens, k=2))
    source = bench.routing_source(str(tmp_path / "r.npz"), layers=2)
    assert [s.tolist() for s in source.steps[0]] == [[0], [1], [0], [2], [1], [0]] and source.steps[1][0].size == 0
    st = bench.run_policy(zipmoe_model, source, "lru", hot=2, warm=0)
    # layer 0 as by hand (1 hit); layer 1 sees 1 0 2 1 0 from empty: m m m(evicts 1) m(evicts 0) m -> 0 hits
    assert st["hits_hot"] == 1 and st["misses"] == 5 + 5
    with np.load(tmp_path / "r.npz") as z:
        arrays = dict(z)
    np.savez(tmp_path / "bad.npz", **{**arrays, "version": np.array(9)})
    with pytest.raises(bench.ReplayError, match="version 9"):
        bench.routing_source(str(tmp_path / "bad.npz"), layers=2)
