"""The eviction policies' prior (cache/prior.c): a store ranks what it has not seen routed by the prior, its own uses
overturn it, the fill at load takes the prior's order, and a prior file seeds a model's stores or is refused with a
reason (zipmoe_cache_seed_prior, what ZIPMOE_PRIOR runs at load); pyzipmoe.plan.prior writes and reads the files."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import reset_cache

from pyzipmoe._native import ffi, lib
from pyzipmoe.file import reader as zreader
from pyzipmoe.plan import prior, trace

UNBOUNDED = 2**64 - 1
N = 8  # the tiny model's experts


@pytest.fixture(autouse=True)
def defaults():
    reset_cache()
    yield
    reset_cache()


class Stores:
    """Every expert tensor of a zipmoe file as a store, under exactly `hot` decoded slots each."""

    def __init__(self, path, policy: int, hot: int):
        lib.zipmoe_cache_configure(UNBOUNDED, 0, 0, policy)
        zf = zreader.open_zipmoe(path)
        self.names, self.handles = [], []
        with open(path, "rb") as f:
            for ct in zf.compressed:
                f.seek(ct.index.file_offset)
                index = f.read(ct.index.nbytes)
                out = ffi.new("zipmoe_store **")
                assert lib.zipmoe_store_open(ct.name.encode(), index, len(index), ct.data.nbytes, out) == 0
                handle = ffi.gc(out[0], lib.zipmoe_store_free)
                assert lib.zipmoe_store_bind(handle, f.fileno(), ct.data.file_offset, ffi.new("void **"),
                                             ffi.new("size_t *")) == 0
                self.names.append(ct.name)
                self.handles.append(handle)
        self.n_layer = 1 + max(int(n.split(".")[1]) for n in self.names)
        assert lib.zipmoe_cache_set_slots(b"", hot, 0, 0) == 0
        self.keys = [ffi.new("char[1]"), ffi.new("char[1]")]
        self.n = 0

    @property
    def first(self):
        return self.handles[self.names.index("blk.0.ffn_gate_exps.weight")]

    def route(self, *experts: int) -> None:
        ids = np.array(experts, np.int32)
        self.n += 1
        assert lib.zipmoe_store_materialize(self.first, self.keys[self.n % 2], ffi.from_buffer(ids), len(ids), 1, 4,
                                            4 * len(ids), ffi.NULL, 0, 1) >= 0

    def hot(self, handle=None) -> set[int]:
        return {e for e in range(N) if lib.zipmoe_store_place(handle or self.first, e) >= 0}

    def set_prior(self, counts, handle=None) -> int:
        row = np.ascontiguousarray(counts, np.uint64)
        return lib.zipmoe_store_set_prior(handle or self.first, ffi.cast("uint64_t *", ffi.from_buffer(row)),
                                          len(row))

    def prefill(self) -> None:
        arr = ffi.new("zipmoe_store *[]", self.handles)
        assert lib.zipmoe_cache_prefill(arr, len(self.handles), 1, ffi.NULL) >= 0

    def seed(self, data: bytes) -> tuple[int, str]:
        arr = ffi.new("zipmoe_store *[]", self.handles)
        msg = ffi.new("char[256]")
        rc = lib.zipmoe_cache_seed_prior(arr, len(self.handles), data, len(data), msg, 256)
        return rc, ffi.string(msg).decode()


def popular(*experts: int, weight: int = 10) -> list[int]:
    return [weight if e in experts else 1 for e in range(N)]


COUNTING = ["lfuda", "lfu", "tlfu"]


def policy_of(name: str) -> int:
    out = ffi.new("zipmoe_policy *")
    assert lib.zipmoe_policy_parse(name.encode(), out) == 0
    return out[0]


@pytest.mark.parametrize("policy", COUNTING)
def test_what_a_store_has_not_seen_routed_it_ranks_by_the_prior(zipmoe_model, policy):
    # two slots, 0 and 1 used once each, then 2: without a prior the tie goes against the lower id (0 leaves)
    for counts, kept in ((None, {1, 2}), (popular(0), {0, 2})):
        st = Stores(zipmoe_model, policy_of(policy), hot=2)
        if counts:
            assert st.set_prior(counts) == lib.ZIPMOE_OK
        st.route(0)
        st.route(1)
        st.route(2)
        assert st.hot() == kept, (policy, counts)


@pytest.mark.parametrize("policy", COUNTING)
def test_a_prompt_s_own_uses_overturn_the_prior(zipmoe_model, policy):
    # expert 0 holds 3/10 of the prior (2.4 uses ahead), 1 holds 1/10 (0.8): used twice more than 0, 1 stays
    st = Stores(zipmoe_model, policy_of(policy), hot=2)
    assert st.set_prior([3, 1, 1, 1, 1, 1, 1, 1]) == lib.ZIPMOE_OK
    st.route(0)
    for _ in range(3):
        st.route(1)
    st.route(2)
    assert st.hot() == {1, 2}, policy


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_lru_and_fifo_ignore_the_prior(zipmoe_model, policy):
    st = Stores(zipmoe_model, policy_of(policy), hot=2)
    assert st.set_prior(popular(0)) == lib.ZIPMOE_OK
    st.route(0)
    st.route(1)
    st.route(2)
    assert st.hot() == {1, 2}


def test_the_fill_at_load_takes_the_prior_s_most_used_first(zipmoe_model):
    st = Stores(zipmoe_model, lib.ZIPMOE_POLICY_LFUDA, hot=3)
    st.prefill()
    assert st.hot() == {0, 1, 2}  # without a prior: by id
    st = Stores(zipmoe_model, lib.ZIPMOE_POLICY_LFUDA, hot=3)
    for h in st.handles:
        assert st.set_prior([1, 9, 2, 8, 0, 7, 3, 1], h) == lib.ZIPMOE_OK
    st.prefill()
    assert all(st.hot(h) == {1, 3, 5} for h in st.handles)


def test_set_prior_checks_its_arguments(zipmoe_model):
    st = Stores(zipmoe_model, lib.ZIPMOE_POLICY_LFUDA, hot=2)
    assert st.set_prior([1] * (N - 1)) == lib.ZIPMOE_ERR_ARG
    assert st.set_prior([1] * (N + 1)) == lib.ZIPMOE_ERR_ARG
    assert lib.zipmoe_store_set_prior(st.first, ffi.NULL, N) == lib.ZIPMOE_ERR_ARG
    assert lib.zipmoe_store_set_prior(ffi.NULL, ffi.NULL, 0) == lib.ZIPMOE_ERR_ARG
    assert st.set_prior(popular(0)) == lib.ZIPMOE_OK
    assert lib.zipmoe_store_set_prior(st.first, ffi.NULL, 0) == lib.ZIPMOE_OK  # removed: the tie goes against 0
    st.route(0)
    st.route(1)
    st.route(2)
    assert st.hot() == {1, 2}


def test_a_prior_file_seeds_every_store_of_its_layer(zipmoe_model):
    st = Stores(zipmoe_model, lib.ZIPMOE_POLICY_LFUDA, hot=2)
    counts = np.ones((st.n_layer, N), np.uint64)
    for layer in range(st.n_layer):
        counts[layer, [layer % N, (layer + 3) % N]] = 50
    rc, msg = st.seed(prior.encode(counts))
    assert (rc, msg) == (lib.ZIPMOE_OK, "")
    st.prefill()
    for name, h in zip(st.names, st.handles):
        layer = int(name.split(".")[1])
        assert st.hot(h) == {layer % N, (layer + 3) % N}, name


def damaged(st: Stores) -> dict[str, tuple[bytes, int, str]]:
    good = prior.encode(np.ones((st.n_layer, N), np.uint64))
    return {
        "truncated": (good[:-1], lib.ZIPMOE_ERR_CORRUPT, "damaged"),
        "longer": (good + b"\0", lib.ZIPMOE_ERR_CORRUPT, "damaged"),
        "magic": (b"ZMPRIOR2" + good[8:], lib.ZIPMOE_ERR_CORRUPT, "not a prior file"),
        "empty": (b"", lib.ZIPMOE_ERR_CORRUPT, "not a prior file"),
        "header only": (good[:16], lib.ZIPMOE_ERR_CORRUPT, "damaged"),
        "layers": (prior.encode(np.ones((st.n_layer + 1, N), np.uint64)), lib.ZIPMOE_ERR_ARG,
                   f"a model of {st.n_layer + 1} layers"),
        "fewer layers": (prior.encode(np.ones((st.n_layer - 1, N), np.uint64)), lib.ZIPMOE_ERR_ARG,
                         f"a model of {st.n_layer - 1} layers"),
        "experts": (prior.encode(np.ones((st.n_layer, N + 2), np.uint64)), lib.ZIPMOE_ERR_ARG,
                    f"a model of {N + 2} experts"),
    }


@pytest.mark.parametrize("case", ["truncated", "longer", "magic", "empty", "header only", "layers", "fewer layers",
                                  "experts"])
def test_a_damaged_or_foreign_prior_file_is_refused_with_a_reason_and_seeds_nothing(zipmoe_model, case):
    st = Stores(zipmoe_model, lib.ZIPMOE_POLICY_LFUDA, hot=2)
    data, rc, words = damaged(st)[case]
    got, msg = st.seed(data)
    assert got == rc and words in msg, (case, got, msg)
    st.prefill()
    assert all(st.hot(h) == {0, 1} for h in st.handles)  # by id: no store took a prior


def test_prior_files_round_trip_and_the_reader_refuses_what_the_runtime_refuses(tmp_path):
    counts = np.arange(3 * N, dtype=np.uint64).reshape(3, N)
    path = tmp_path / "m.prior"
    prior.save(path, counts)
    data = path.read_bytes()
    assert data[:8] == b"ZMPRIOR1" and len(data) == 16 + 3 * N * 8
    assert int.from_bytes(data[8:12], "little") == 3 and int.from_bytes(data[12:16], "little") == N
    assert np.array_equal(prior.load(path), counts)
    (tmp_path / "bad").write_bytes(data[:-8])
    with pytest.raises(prior.PriorFileError, match="damaged"):
        prior.load(tmp_path / "bad")
    (tmp_path / "other").write_bytes(b"GGUF" + data[4:])
    with pytest.raises(prior.PriorFileError, match="not a prior file"):
        prior.load(tmp_path / "other")
    with pytest.raises(prior.PriorFileError, match="cannot be read"):
        prior.load(tmp_path / "missing")
    with pytest.raises(prior.PriorFileError):
        prior.encode(np.array([[-1, 2]]))


def test_a_prior_from_recorded_routing_counts_each_block_s_steps():
    routed = np.zeros((3, 2, 4), bool)
    routed[0, 0, [0, 1]] = routed[1, 0, [1, 2]] = routed[2, 0, [1, 3]] = True
    routed[:, 1, 3] = True
    r = trace.Routing(routed=routed, layers=np.array([1, 3], np.int32), tokens=np.ones(3, np.int32), k=2)
    got = prior.from_routing(r)
    assert got.shape == (4, 4)
    assert got[1].tolist() == [1, 3, 1, 1] and got[3].tolist() == [0, 0, 0, 3]
    assert got[0].sum() == got[2].sum() == 0


def test_any_bytes_are_a_prior_the_stores_match_or_refused(zipmoe_model):
    # truncations and byte flips of a good file: the parser checks the shape before a count is read
    st = Stores(zipmoe_model, lib.ZIPMOE_POLICY_LFUDA, hot=2)
    good = prior.encode(np.ones((st.n_layer, N), np.uint64))
    rng = np.random.default_rng(0)
    for i in range(300):
        data = bytearray(good[: int(rng.integers(0, len(good) + 1))] if i % 2 else good)
        for _ in range(int(rng.integers(1, 4))):
            if data:
                data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        rc, msg = st.seed(bytes(data))
        header_ok = bytes(data[:16]) == good[:16] and len(data) == len(good)
        assert rc == (lib.ZIPMOE_OK if header_ok else rc) and rc in (lib.ZIPMOE_OK, lib.ZIPMOE_ERR_CORRUPT,
                                                                      lib.ZIPMOE_ERR_ARG), (bytes(data[:16]), rc)
        assert (rc == lib.ZIPMOE_OK) == (msg == ""), msg


def test_a_runs_record_holds_each_blocks_expert_uses_and_seeds_the_same_model(zipmoe_model, tmp_path):
    # what ZIPMOE_PRIOR_RECORD writes at unload (zipmoe_prior_record): the stores' activations as a prior file
    st = Stores(zipmoe_model, policy_of("lfuda"), hot=2)
    for e in (0, 0, 3, 0, 5, 3):
        st.route(e)
    arr = ffi.new("zipmoe_store *[]", st.handles)
    msg = ffi.new("char[256]")
    path = tmp_path / "run.prior"
    assert lib.zipmoe_prior_record(arr, len(st.handles), str(path).encode(), msg, 256) == lib.ZIPMOE_OK
    expected = np.zeros((st.n_layer, N), np.uint64)
    expected[0, [0, 3, 5]] = [3, 2, 1]  # only blk.0's gate was invoked: the block's count is its busiest store's
    np.testing.assert_array_equal(prior.load(path), expected)
    assert [p.name for p in tmp_path.iterdir()] == ["run.prior"]  # no temporary file left beside it
    assert st.seed(path.read_bytes()) == (lib.ZIPMOE_OK, "")
    missing = tmp_path / "no" / "run.prior"
    assert lib.zipmoe_prior_record(arr, len(st.handles), str(missing).encode(), msg, 256) == lib.ZIPMOE_ERR_IO
    assert "cannot be written" in ffi.string(msg).decode() and not missing.parent.exists()
    assert lib.zipmoe_prior_record(arr, 0, str(path).encode(), msg, 256) == lib.ZIPMOE_ERR_ARG


def test_a_prompts_read_ahead_of_the_next_layer_takes_the_prior_s_likeliest_experts_first(zipmoe_model):
    """A prompt's invocation has the reader read the next store's experts ahead before that store's routing is known;
    where the buffer holds fewer than it would read (here one expert: the read room 0), it reads the prior's
    likeliest first, by id without a prior. ahead_used counts the experts an invocation then decoded from those
    bytes: the next store routed to the prior's favourite finds it read ahead only with the prior."""
    import time

    def ahead_hits(counts) -> int:
        reset_cache()
        st = Stores(zipmoe_model, policy_of("lfuda"), hot=1)
        a = st.handles[st.names.index("blk.0.ffn_gate_exps.weight")]
        b = st.handles[st.names.index("blk.1.ffn_gate_exps.weight")]
        if counts is not None:
            assert st.set_prior(counts, b) == lib.ZIPMOE_OK
        keys = []

        def invoke(handle, ids: np.ndarray) -> None:
            ids = np.ascontiguousarray(ids, np.int32)
            keys.append(ffi.new("char[1]"))
            assert lib.zipmoe_store_materialize(handle, keys[-1], ffi.from_buffer(ids), ids.shape[1], ids.shape[0], 4,
                                                4 * ids.shape[1], ffi.NULL, 0, 1) >= 0

        prompt = np.arange(N).reshape(-1, 2)  # every expert of a: a prompt, whose next store is read ahead whole
        invoke(a, prompt)
        invoke(b, np.array([[0]]))  # b follows a (the graph's order); expert 0 stays b's one decoded expert
        lib.zipmoe_cache_set_read_buffer(8192)  # one expert's region of the tiny preset, laid out for O_DIRECT
        lib.zipmoe_cache_set_read_room(0)
        try:
            invoke(a, prompt)
            time.sleep(0.1)  # the reader reads b ahead while "a computes"
            s = ffi.new("zipmoe_stats *")
            lib.zipmoe_stats_get(s)
            before = s.ahead_used
            invoke(b, np.array([[6]]))
            lib.zipmoe_stats_get(s)
            return s.ahead_used - before
        finally:
            lib.zipmoe_cache_set_read_buffer(16 << 20)
            lib.zipmoe_cache_set_read_room(2**64 - 1)

    assert ahead_hits(popular(6)) == 1  # 6 is the prior's likeliest: read ahead, decoded from those bytes
    assert ahead_hits(None) == 0  # by id: expert 1 was read ahead (0 is decoded), 6 is read when routed
    assert ahead_hits(popular(2)) == 0
