"""The supervisor's half of the control channel (pyzipmoe.runtime.supervise): the memory monitor, unchanged,
driving a cache in another process through the control file. The native half (zipmoe-control.cpp) reads the same
words; tests/system/test_pressure.py runs both with llama-server."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pyzipmoe.runtime import cache_control, controller, memory, supervise
from pyzipmoe.runtime.config import DEFAULT_POLICY

MiB = 1 << 20


def test_a_new_budget_reaches_the_control_file_as_the_runtime_s_own_split(zipmoe_model: Path) -> None:
    from pyzipmoe._native import ffi, lib
    from pyzipmoe.runtime.budget import model_memory

    need = model_memory(zipmoe_model)
    ctl = supervise.ControlFile.create()
    try:
        words = np.frombuffer(Path(ctl.path).read_bytes(), dtype="<u8")
        assert words[supervise.W_MAGIC] == int.from_bytes(b"ZMCTL001", "little")
        remote = supervise.RemoteRuntime(ctl)
        # the program reports every expert decoded
        ctl.words[supervise.W_RESIDENT] = need.expert_bytes
        ctl.words[supervise.W_POLLS] = 1
        assert ctl.reporting
        room = {"bytes": need.whole + 64 * MiB}

        def read() -> memory.MemoryReading:  # a 1 GiB machine (margin: the floor)
            return memory.MemoryReading(total=1 << 30, available=room["bytes"] - need.expert_bytes, rss=0)

        mon = controller.monitor_for(zipmoe_model, "auto", loaded=need.whole, read=read, lib=remote,
                                     split=(None, None, 0.0), interval=3600, events=False)
        assert not mon.step() and mon.budget == need.whole  # nothing changed
        room["bytes"] = need.minimum + need.expert_bytes // 2 + memory.MIN_MARGIN
        assert mon.step()
        target = need.minimum + need.expert_bytes // 2
        assert mon.budget == target
        seq = int(ctl.words[supervise.W_SEQ])
        assert seq > 0 and seq % 2 == 0  # complete
        # what the program will apply is zipmoe_budget_split_tiers' split of the new tiers
        sizes = cache_control.store_sizes(zipmoe_model)
        out = ffi.new("zipmoe_budget_split *")
        hot = cache_control.default_hot_share(target - need.minimum, sizes, cache_control.warm_decodes_fast(zipmoe_model))
        assert lib.zipmoe_budget_split_tiers(cache_control._store_sizes_struct(sizes), len(sizes),
                                             target - need.minimum, hot, 0.0, out) == 0
        got = [int(ctl.words[w]) for w in (supervise.W_HOT, supervise.W_WARM, supervise.W_SM, supervise.W_IN_FLIGHT,
                                            supervise.W_READS, supervise.W_TOKEN_HOT)]
        assert got == [out.hot, out.warm, out.sm, out.in_flight, out.reads, out.token_hot]
        assert int(ctl.words[supervise.W_POLICY]) == getattr(lib, cache_control._POLICY_IDS[DEFAULT_POLICY])
        # the floor: less room than the minimum, twice
        room["bytes"] = need.minimum // 2
        mon.step()
        assert mon.floor is None
        mon.step()
        assert mon.floor is not None and "out of memory" in mon.floor and "\n" not in mon.floor
    finally:
        ctl.close()
    assert not Path(ctl.path).exists()
