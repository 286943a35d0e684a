"""The budget's rules that live in the native library alone and reach pyzipmoe through cffi: the check of a budget
against a model's minimum and its message (zipmoe_budget_check), the sizes messages print (zipmoe_size_text), the
eviction policies (cache/policy.c) and OpenMP's spin count (zipmoe_openmp_spincount)."""

from __future__ import annotations

import pytest

from pyzipmoe._native import ffi, lib
from pyzipmoe.runtime.budget import human_size

MIB, GIB = 1 << 20, 1 << 30


def size_text(n: int, size: int = 32) -> tuple[int, str]:
    buf = ffi.new("char[]", size)
    rc = lib.zipmoe_size_text(n, buf, size)
    return rc, ffi.string(buf).decode()


@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 1025, 1536, 10 * 1024 - 52, 10 * 1024 - 51, MIB - 1, MIB,
                               3 * MIB + MIB // 20, GIB - 1, 5 * GIB + 123456789, (1 << 40) * 3 // 2, 1 << 50,
                               (1 << 60) - 1, 1 << 60, (1 << 64) - 1])
def test_sizes_read_as_pyzipmoe_writes_them(n):
    """The loader's messages and pyzipmoe's say a size the same way, rounding included (a tenth on the edge)."""
    rc, text = size_text(n)
    assert text == human_size(n) and rc == len(text)


def test_size_text_says_when_it_is_cut():
    assert size_text(5 * GIB, 6) == (lib.ZIPMOE_ERR_DST_TOO_SMALL, "5.0 G")
    assert lib.zipmoe_size_text(1, ffi.NULL, 8) == lib.ZIPMOE_ERR_ARG
    assert lib.zipmoe_size_text(1, ffi.new("char[]", 1), 0) == lib.ZIPMOE_ERR_ARG


def need_of(other: int, in_flight: int, experts: int, embd_charged: int = 0) -> object:
    return ffi.new("zipmoe_budget_need *", {"other": other, "embd_charged": embd_charged, "in_flight": in_flight,
                                            "experts": experts, "minimum": other + in_flight})


def check(budget: int, need: object, said: str | None, embd_bytes: int = 0, size: int = 1024) -> tuple[int, str]:
    msg = ffi.new("char[]", size)
    rc = lib.zipmoe_budget_check(budget, need, embd_bytes, said.encode() if said is not None else ffi.NULL, msg,
                                 size)
    return rc, ffi.string(msg).decode()


def test_a_budget_that_holds_the_minimum_passes():
    need = need_of(100 * MIB, 50 * MIB, 400 * MIB)
    assert check(150 * MIB, need, "150MiB") == (lib.ZIPMOE_OK, "")
    assert check(GIB, need, None) == (lib.ZIPMOE_OK, "")


def test_a_budget_below_the_minimum_is_refused_in_one_sentence():
    """The budget as its user gave it, the minimum and what it is made of, and what to do."""
    need = need_of(100 * MIB, 50 * MIB, 400 * MIB)
    rc, msg = check(100 * MIB, need, "60% (100.0 MiB)")
    assert rc == lib.ZIPMOE_ERR_ARG
    assert msg == ("memory budget 60% (100.0 MiB) is below the minimum of 150.0 MiB for this model (100.0 MiB of "
                   "weights that are not experts + 50.0 MiB for the experts of one expert tensor in flight); raise "
                   "--memory-budget")
    assert check(100 * MIB, need, None)[1].startswith("memory budget 100.0 MiB is below the minimum of 150.0 MiB ")


def test_one_byte_short_is_said_in_bytes():
    """A budget that reads as the minimum once rounded is said in bytes, and so is the minimum."""
    need = need_of(100 * MIB, 50 * MIB, 400 * MIB)
    rc, msg = check(150 * MIB - 1, need, "157286399")
    assert rc == lib.ZIPMOE_ERR_ARG
    assert msg.startswith(f"memory budget 157286399 ({150 * MIB - 1} bytes) is below the minimum of {150 * MIB} "
                          "bytes for this model"), msg


def test_a_token_embedding_charged_for_a_batch_s_rows_is_named():
    need = need_of(100 * MIB, 50 * MIB, 400 * MIB, embd_charged=16 * MIB)
    rc, msg = check(MIB, need, "1MiB", embd_bytes=64 * MIB)
    assert rc == lib.ZIPMOE_ERR_ARG
    assert ("100.0 MiB of weights that are not experts (token_embd: the rows of a batch, 16.0 MiB of 64.0 MiB) + "
            "50.0 MiB") in msg
    assert "token_embd" not in check(MIB, need, "1MiB", embd_bytes=16 * MIB)[1]  # charged whole: no note


def test_the_message_is_cut_to_the_buffer_and_a_missing_need_is_refused():
    need = need_of(100 * MIB, 50 * MIB, 400 * MIB)
    rc, msg = check(0, need, "0", size=20)
    assert rc == lib.ZIPMOE_ERR_ARG and msg == "memory budget 0 is "  # 19 bytes and the NUL
    assert check(0, ffi.NULL, "0") == (lib.ZIPMOE_ERR_ARG, "")


def policy_names() -> list[str]:
    names = []
    while (name := lib.zipmoe_policy_name(len(names))) != ffi.NULL:
        names.append(ffi.string(name).decode())
    return names


def test_one_list_of_policies_every_name_of_which_parses():
    names = policy_names()
    assert names[0] == "lfuda" and sorted(names) == ["fifo", "lfu", "lfuda", "lru", "tlfu"]
    out = ffi.new("zipmoe_policy *")
    ids = []
    for name in names:
        assert lib.zipmoe_policy_parse(name.encode(), out) == lib.ZIPMOE_OK
        ids.append(out[0])
    assert ids[0] == lib.ZIPMOE_POLICY_LFUDA and sorted(ids) == list(range(5))  # one name for each policy
    for bad in (b"LRU", b"lru ", b"", b"lfudaa"):
        assert lib.zipmoe_policy_parse(bad, out) == lib.ZIPMOE_ERR_ARG
    assert lib.zipmoe_policy_parse(ffi.NULL, out) == lib.ZIPMOE_ERR_ARG
    assert lib.zipmoe_policy_parse(b"lru", ffi.NULL) == lib.ZIPMOE_OK


def test_the_policies_message_lists_the_same_names():
    buf = ffi.new("char[]", 64)
    n = lib.zipmoe_policy_names(buf, 64)
    names = policy_names()
    assert ffi.string(buf).decode() == ", ".join(names[:-1]) + " or " + names[-1] and n == len(ffi.string(buf))
    assert lib.zipmoe_policy_names(ffi.new("char[]", 10), 10) == lib.ZIPMOE_ERR_DST_TOO_SMALL


def test_pyzipmoe_takes_the_library_s_policies_and_spin_count():
    from pyzipmoe.runtime import cache_control, config

    assert config.POLICIES == tuple(policy_names()) and config.DEFAULT_POLICY == "lfuda"
    assert [cache_control.policy_id(p) for p in config.POLICIES] == [
        lib.ZIPMOE_POLICY_LFUDA, lib.ZIPMOE_POLICY_TOKEN_LFU, lib.ZIPMOE_POLICY_LRU, lib.ZIPMOE_POLICY_LFU,
        lib.ZIPMOE_POLICY_FIFO]
    assert config.OPENMP_SPIN == ("GOMP_SPINCOUNT", ffi.string(lib.zipmoe_openmp_spincount()).decode())
    assert config.OPENMP_SPIN[1].isdigit()
