"""Live adaptation: less memory while a model generates, and the run completes with the BF16 model's tokens and
smaller cache tiers.

While llama.cpp runs a zipmoe model, pyzipmoe.runtime.controller.MemoryMonitor re-plans the cache tiers when the memory
the process may use changes, and hands the new slots to the running stores (zipmoe_cache_set_slots); each store
applies them at its next invocation, evicting down. Three tests:

* deterministic (no root): the model is loaded with a budget that holds every expert decoded; a monitor whose
  memory reading is fake is stepped by hand between tokens: after a few tokens the reading says that only a
  fraction of the experts fits any more (another process took the rest), later that memory is back. Every
  token after the shrink must find the tiers within the smaller plan (plus the one layer's routed experts that
  a store keeps pinned until its matmul has run); after the grow nothing is evicted any more and the whole
  prompt fits decoded again; the logits of every position are bit-identical to the BF16 model's.
* real (root, cgroup v1): the worker runs in a fresh memory cgroup with a generous limit, with
  memory_budget="auto" (whose monitor thread reads the cgroup's limit from /proc/self/cgroup), and the test
  lowers memory.limit_in_bytes while it generates: the monitor re-plans on its own, the tiers shrink, the limit
  is never hit, and the tokens and logits are the BF16 model's.
* the store's side (no llama.cpp): new slots arriving around an invocation that ggml runs on two threads must
  not leave the store unable to serve its next invocation.

Models run in a child process with the build's libllama, as in test_llama.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import assert_bit_identical, finish_worker, kill_group, unavailable, worker_env, write_atomic


PROMPT = ("the expert model said hello to the world of water and time, and then the people of the world "
          "said hello to the expert")
N_CTX = 256
TIMEOUT = 60  # seconds for a worker

# the deterministic test: the shrink comes before generated token SHRINK_AT, the grow before GROW_AT, of N_GEN
SHRINK_AT, GROW_AT, N_GEN = 4, 14, 22
SHRINK_SHARE = 0.3  # of the experts' BF16 bytes: what the cache tiers may use after the shrink

# the cgroup test
CGROUP_LIMIT = 2 << 30  # generous: "auto" starts with every expert decoded
CGROUP_TIERS = 12 << 20  # what the lowered limit leaves the tiers (the small model's experts are 48 MiB)
CGROUP_BEFORE, CGROUP_AFTER, CGROUP_N_GEN = 8, 8, 40  # tokens before lowering, at least after the re-plan, all
CGROUP_THREADS = 2  # both of a 2-core CI machine: the runtime's threads must agree however slots change




# ------------------------------------------------------------------------------------------ the worker

WORKER = r"""
import json, os, sys, time
import numpy as np
job = json.loads(sys.argv[1])
from pyzipmoe.runtime import cache_control, controller, memory
from pyzipmoe.plan import solver as planner
from pyzipmoe.runtime.budget import model_memory
from pyzipmoe.runtime.llama import Llama, zipmoe_stats

FIELDS = ("hot_bytes", "warm_bytes", "sm_bytes", "evictions", "experts_decoded", "pool_bytes")

def stats():
    s = zipmoe_stats()
    out = {k: int(s[k]) for k in FIELDS}
    out["resident"] = out["hot_bytes"] + out["warm_bytes"] + out["sm_bytes"]
    return out

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def in_use():
    # the cgroup's memory as the monitor counts it: charged, less the inactive file cache it may drop
    r = memory.read_memory()
    return None if r.cgroup_usage is None else r.cgroup_usage - (r.cgroup_reclaimable or 0)

def wait_for(path, seconds):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"no {path} after {seconds} s")
        time.sleep(0.02)

def load(model, **zipmoe):
    t = job["threads"]
    return Llama(model, n_ctx=job["n_ctx"], n_threads=t, n_threads_batch=t, n_batch=64, n_ubatch=64,
                 logits_all=True, seed=0, verbose=False, **zipmoe)

def fake_run(model, res):
    # a fake memory reading: `room` bytes in all for the model, of which it holds its weights that are not
    # experts and what its tiers hold now; what the tiers give back comes back as available memory, as it would
    need = model_memory(model)
    full = need.minimum + need.expert_bytes
    total = 4 << 30
    room = {"bytes": total}
    def read():
        held = need.other_bytes + cache_control.resident_bytes()
        # psutil's available counts the page cache of the mapped weights (resident here) as available too
        return memory.MemoryReading(total=total, available=max(0, room["bytes"] - held) + need.other_bytes, rss=0)
    margin = memory.safety_margin(read())
    mon = controller.monitor_for(model, full, read=read, interval=3600)  # stepped by hand, never started
    tiers = int(need.expert_bytes * job["shrink_share"])
    res.update(minimum=need.minimum, full=full, tiers=tiers, margin=margin, steps=[])
    res["steps"].append(("steady", mon.step(), mon.budget))
    def at(i):
        if i == job["shrink_at"]:
            res["before_shrink"] = stats()
            room["bytes"] = margin + need.minimum + tiers  # another process took the rest
            res["steps"].append(("shrink", mon.step(), mon.budget))
            res["right_after_shrink"] = stats()
            res["shrink_plan"] = mon.replans[-1][1].encode() if mon.replans else None
            res["expected_shrink_plan"] = planner.plan_tiers(mon.planned.model, tiers).encode()
            res["steps"].append(("same reading", mon.step(), mon.budget))
        if i == job["grow_at"]:
            res["before_grow"] = stats()
            # the tiers gave memory back since the shrink, and the reading says so: no re-plan for that
            res["steps"].append(("same room, tiers shrunk", mon.step(), mon.budget))
            room["bytes"] = total  # it is back
            res["steps"].append(("grow", mon.step(), mon.budget))
            res["grow_plan"] = mon.replans[-1][1].encode() if mon.replans else None
            res["steps"].append(("same reading", mon.step(), mon.budget))
    return mon, at

def cgroup_run(llm, model, res):
    mon = llm.zipmoe_monitor
    if mon is None:
        raise SystemExit("memory_budget='auto' started no monitor")
    res["auto_budget"] = mon.budget
    stage = {"lowered": False, "replanned_at": None, "stopped": False}
    def at(i):
        if i == job["before"]:
            res["before"] = {**stats(), "rss": rss(), "in_use": in_use(), "replans": len(mon.replans),
                             "budget": mon.budget}
            with open(job["ready"] + ".tmp", "w") as f:
                json.dump(res["before"], f)
            os.rename(job["ready"] + ".tmp", job["ready"])
            wait_for(job["lowered"], 30)
            stage["lowered"] = True
            return
        if not stage["lowered"] or stage["stopped"]:
            return
        if stage["replanned_at"] is None and mon.replans:
            stage["replanned_at"] = i
        if stage["replanned_at"] is None:
            if i < job["n_gen"] - job["after"]:
                time.sleep(0.05)  # generating slowly, while the monitor reads the memory
                return
            deadline = time.monotonic() + 20  # the last tokens must come after a re-plan
            while not mon.replans and time.monotonic() < deadline:
                time.sleep(0.05)
            stage["replanned_at"] = i
        # a settled plan for the last tokens: every store applies it at its next invocation
        mon.stop()
        stage["stopped"] = True
        res["stopped_at"] = i
        res["replanned_at"] = stage["replanned_at"]
    return mon, at

out, arrays = {"runs": []}, {}
for name, model in job["models"]:
    res = {"name": name}
    out["runs"].append(res)
    zipmoe = name != "bf16"
    if not zipmoe:
        llm = load(model)
        mon, at = None, lambda i: None
    elif job["mode"] == "fake":
        need = model_memory(model)
        llm = load(model, memory_budget=need.minimum + need.expert_bytes)
        mon, at = fake_run(model, res)
    else:
        llm = load(model, memory_budget="auto")
        mon, at = cgroup_run(llm, model, res)
    try:
        tokens = llm.tokenize(job["prompt"].encode())
        llm.eval(tokens)
        res["prompt"] = [int(t) for t in tokens]
        res["after_prompt"] = stats() if zipmoe else None
        generated, per_token = [], []
        for i in range(job["n_gen"]):
            at(i)
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            generated.append(nxt)
            llm.eval([nxt])
            if zipmoe:
                per_token.append(stats())
        res["generated"] = generated
        res["per_token"] = per_token
        arrays[name] = np.array(llm.scores[: llm.n_tokens], dtype=np.float32)
        if zipmoe:
            res["end"] = {**stats(), "rss": rss(), "in_use": in_use()}
            res["replans"] = [(b, p.encode() if p is not None else None) for b, p in mon.replans]
            res["final_budget"] = mon.budget
        if zipmoe and job["mode"] == "fake":
            llm.reset()  # the whole prompt again, in one batch, with the grown tiers
            llm.eval(tokens)
            arrays[name + "_again"] = np.array(llm.scores[: llm.n_tokens], dtype=np.float32)
            res["prompt_again"] = stats()
    finally:
        llm.close()
np.savez(job["out"], **arrays)
print(json.dumps(out))
"""


def start_worker(job: dict[str, Any], lib_dir: Path, prefix: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    """The worker on `job`, its argv after `prefix`, in a session of its own (so that kill_group gets all of it)."""
    return subprocess.Popen([*prefix, sys.executable, "-c", WORKER, json.dumps(job)], env=worker_env(lib_dir),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def run_worker(job: dict[str, Any], lib_dir: Path) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    """Runs the worker on `job`: each model's report, and the logits (float32 [positions, n_vocab]) by name."""
    return finish(start_worker(job, lib_dir), job)


def finish(proc: subprocess.Popen[str], job: dict[str, Any],
           timeout: float = TIMEOUT) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    reports = finish_worker(proc, "the worker", timeout)["runs"]
    with np.load(job["out"]) as z:
        arrays = {k: z[k] for k in z.files}
    return reports, arrays


def allowed_bytes(model: Path, plan: str) -> tuple[int, int]:
    """(the bytes the runtime's tier limits come to under `plan`, one layer's routed experts decoded): a store
    keeps the experts its last invocation routed until its matmul has run, beyond its limits, and one graph runs
    a layer at a time, so the tiers hold at most the limits plus that.

    The limits are config.c's, per expert tensor: hot slots of n_per_expert BF16 values, warm slots of the mean
    compressed region (data size / n_expert, rounded up: alignment padding included, so a little more than the
    planner's mean region size), sm slots of n_per_expert bytes."""
    from pyzipmoe.file.reader import open_zipmoe
    from pyzipmoe.plan import inputs
    from pyzipmoe.plan import solver as planner

    slots = planner.decode_plan(plan)
    g = inputs.geometry_from_gguf(model)
    runtime = 0
    for c in open_zipmoe(model).compressed:
        info = c.expert.info
        h, w, s = slots[int(c.name.split(".")[1])]
        runtime += h * 2 * info.n_per_expert + w * -(-info.data_size // info.n_expert) + s * info.n_per_expert
    return runtime, g.n_expert_used * max(g.hot_bytes)


# ------------------------------------------------------------------------------------- deterministic


def _budget_checks(model: Path, plan: str, tiers_budget: int, resident: int, what: str) -> None:
    """resident (hot + warm + sm) is within what `plan` allows the runtime plus one layer's routed experts, and
    within the tiers' budget the plan was made for plus the same."""
    runtime, routed = allowed_bytes(model, plan)
    assert resident <= runtime + routed, (f"{what}: the tiers hold {resident} bytes, more than plan {plan} allows "
                                          f"({runtime} bytes of slots + {routed} of one layer's routed experts)")
    assert resident <= tiers_budget + routed, (f"{what}: the tiers hold {resident} bytes, more than the "
                                               f"{tiers_budget} bytes plan {plan} was made for (+ {routed} routed)")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe"])
def test_shrink_and_grow_while_generating_same_logits(arch: str, threads: int, llama_lib_dir: Path,
                                                     tiny_models: dict[str, Path],
                                                     zipmoe_models: dict[tuple[str, str], Path],
                                                     tmp_path: Path) -> None:
    """The budget holds every expert; after SHRINK_AT tokens the (fake) memory reading leaves the tiers
    SHRINK_SHARE of the experts, after GROW_AT tokens all of them again. Monitor steps are taken by hand between
    tokens, so what the tiers hold is known at every token. With two threads, the new slots also reach
    invocations that ggml runs on two threads (see test_slots_changed_around_an_invocation_keep_the_store_working
    for what must hold there)."""
    from pyzipmoe.plan import inputs
    from pyzipmoe.runtime.budget import model_memory

    model = zipmoe_models[arch, "huff"]
    job = {"mode": "fake", "models": [("bf16", str(tiny_models[arch])), ("zipmoe", str(model))], "prompt": PROMPT,
           "n_ctx": N_CTX, "n_gen": N_GEN, "shrink_at": SHRINK_AT, "grow_at": GROW_AT, "shrink_share": SHRINK_SHARE,
           "threads": threads, "out": str(tmp_path / "logits.npz")}
    (ref, got), arrays = run_worker(job, llama_lib_dir)
    need = model_memory(model)
    full, tiers = need.minimum + need.expert_bytes, int(need.expert_bytes * SHRINK_SHARE)
    where = f"{arch}, {threads} thread(s)"

    # the same computation as the BF16 model's, bit for bit, through the shrink and the grow
    assert got["prompt"] == ref["prompt"] and len(ref["prompt"]) >= 16
    assert got["generated"] == ref["generated"], where
    assert_bit_identical(arrays["zipmoe"], arrays["bf16"], f"{where}: zipmoe with a shrink and a grow vs BF16")
    assert arrays["bf16"].shape[0] == len(ref["prompt"]) + N_GEN

    # the monitor: no re-plan while nothing changes, one per change, none when the same reading comes again nor
    # when the memory the tiers gave back comes back as available
    assert got["full"] == full and got["tiers"] == tiers
    small = need.minimum + tiers
    assert got["steps"] == [["steady", False, full], ["shrink", True, small], ["same reading", False, small],
                            ["same room, tiers shrunk", False, small], ["grow", True, full],
                            ["same reading", False, full]], got["steps"]
    assert got["shrink_plan"] == got["expected_shrink_plan"]
    assert [b for b, _ in got["replans"]] == [small, full]
    shrink_plan, grow_plan = got["shrink_plan"], got["grow_plan"]
    g = inputs.geometry_from_gguf(model)
    assert grow_plan == ";".join(f"{layer}:{g.n_expert},0,0" for layer in g.layers), grow_plan  # all decoded

    # before the shrink every expert is decoded (the prompt, in one batch, routes to all of them)
    before = got["before_shrink"]
    assert before["hot_bytes"] == need.expert_bytes and before["evictions"] == 0, before
    # a re-plan only sets slots: the stores apply them at their next invocation
    assert got["right_after_shrink"] == before, (before, got["right_after_shrink"])

    # every token after the shrink: the tiers within the smaller budget less the weights that are not experts (the
    # plan's slots, and in generation, whose misses take their victims' places, decoded experts in the allowance
    # for the tensor in flight and the read room: zipmoe_cache_set_token_room)
    per_token = got["per_token"]
    runtime, routed = allowed_bytes(model, shrink_plan)
    assert runtime + routed < before["resident"] // 2, "the shrink is too small to show"
    for i in range(SHRINK_AT, GROW_AT):  # (evicted experts' pages kept for the next decodes count too)
        held = per_token[i]["resident"] + per_token[i]["pool_bytes"]
        assert held <= small - need.other_bytes, (f"{where}, token {i} after the shrink", per_token[i], small)
    assert max(t["hot_bytes"] for t in per_token[SHRINK_AT:GROW_AT]) > runtime, "generation kept no more decoded"
    assert per_token[SHRINK_AT]["evictions"] > 0
    assert all(t["resident"] < before["resident"] for t in per_token[SHRINK_AT:GROW_AT])

    # after the grow nothing is evicted, and the whole prompt fits decoded again with the same logits
    grown = per_token[GROW_AT - 1:]
    assert len({t["evictions"] for t in grown}) == 1, [t["evictions"] for t in grown]
    hot = [t["hot_bytes"] for t in grown]
    assert hot == sorted(hot), hot
    again = got["prompt_again"]
    assert again["hot_bytes"] == need.expert_bytes and again["evictions"] == grown[-1]["evictions"], again
    n_prompt = len(ref["prompt"])
    assert_bit_identical(arrays["zipmoe_again"][:n_prompt], arrays["bf16"][:n_prompt], f"{where}: the prompt again")


# --------------------------------------------------------------------------- the store's invocation protocol


def _native_library() -> None:
    """Skip without the native library (helpers.unavailable: fail under CI)."""
    from pyzipmoe.errors import ZipmoeError

    try:
        from pyzipmoe import _native  # noqa: F401
    except (ZipmoeError, OSError) as e:
        unavailable(f"the native library cannot be loaded: {e}")


STORE_RACE = r"""
import json, os, sys, threading
import numpy as np
from pyzipmoe.file import reader
from pyzipmoe._native import ffi, lib

path, source, name, scenario = sys.argv[1:5]
ct = reader.open_zipmoe(path).compressed_by_name[name]
prefix = name[: name.index(".", 4) + 1].encode()  # "blk.N."
lib.zipmoe_cache_configure(2**64 - 1, 0, 0, lib.ZIPMOE_POLICY_TOKEN_LFU)
lib.zipmoe_cache_set_slots(ffi.NULL, 0, 0, 0)
with open(path, "rb") as f:
    f.seek(ct.index.file_offset)
    index = f.read(ct.index.nbytes)
    out = ffi.new("zipmoe_store **")
    assert lib.zipmoe_store_open(name.encode(), index, len(index), ct.data.nbytes, out) == 0
    store = out[0]
    dst, size = ffi.new("void **"), ffi.new("size_t *")
    assert lib.zipmoe_store_bind(store, f.fileno(), ct.data.file_offset, dst, size) == 0
ne0, ne1, n_expert = ct.source.dims
weights = np.frombuffer(ffi.buffer(dst[0], n_expert * ne0 * ne1 * 2), np.uint16).reshape(n_expert, -1)
with open(source, "rb") as f:
    f.seek(ct.source.file_offset)
    expected = np.frombuffer(f.read(n_expert * ne0 * ne1 * 2), np.uint16).reshape(n_expert, -1)

where = {}

def materialize(key, ids, ith, nth):
    ids = np.ascontiguousarray(ids, np.int32)
    out = where.setdefault(ids.tobytes(), np.full(ids.shape, -1, np.int32))
    return lib.zipmoe_store_materialize(store, key, ffi.from_buffer(ids), ids.shape[1], ids.shape[0], 4,
                                        ids.shape[1] * 4, ffi.from_buffer("int32_t[]", out), ith, nth)

def hot_experts():
    s = ffi.new("zipmoe_stats *")
    lib.zipmoe_stats_get(s)
    return s.hot_bytes // (2 * ct.expert.info.n_per_expert)

report = {}
k0, k1, k2 = (ffi.new("char[1]") for _ in range(3))
assert materialize(k0, [[0, 1], [2, 3]], 0, 1) >= 0  # experts 0-3 decoded: within the limits, all hot
# one invocation that routes to hot experts, on two threads that ggml happens to run one after the other
if scenario == "between":  # the slots changed before it: thread 1 plans, refreshing the store's limits,
    lib.zipmoe_cache_set_slots(prefix, 1, 0, 0)  # before thread 0 looks at the fast path
    report["statuses"] = [materialize(k1, [[0, 1]], 1, 2), materialize(k1, [[0, 1]], 0, 2)]
else:  # "during": the monitor thread changes them while it runs, after thread 0 took the fast path
    first = materialize(k1, [[0, 1]], 0, 2)
    lib.zipmoe_cache_set_slots(prefix, 1, 0, 0)
    report["statuses"] = [first, materialize(k1, [[0, 1]], 1, 2)]
# the next token: the same graph node (llama.cpp reuses its graphs), the same two threads, an expert not hot
report["same_key"] = [materialize(k1, [[6]], 0, 2), materialize(k1, [[6]], 1, 2)]
six = int(where[np.int32([[6]]).tobytes()][0, 0])  # both threads' rows: the one row, written by thread 1
report["expert_6_exact"] = six == lib.zipmoe_store_place(store, 6) and bool((weights[six] == expected[6]).all())
# another graph (another batch size, say), on one thread: it must not wait forever for the first one
result = {}
nxt = threading.Thread(target=lambda: result.update(status=materialize(k2, [[5]], 0, 1)), daemon=True)
nxt.start()
nxt.join(5)
report.update(other_key_done=not nxt.is_alive(), other_key=result.get("status"), hot_experts=hot_experts())
print(json.dumps(report), flush=True)
os._exit(0)  # a store that may still be in use must not be freed
"""


class _FakeStats:
    """A stand-in for the native library, as far as the monitor reads and sets it: the tiers hold `resident`
    bytes, and the plans it applies are recorded."""

    def __init__(self, resident: int) -> None:
        self.resident = resident
        self.read_buffers = 0  # beyond what they keep between uses
        self.pool = 0  # pages of evicted experts kept for the next decodes
        self.calls = 0  # invocations served
        self.slots: list[tuple[bytes, int, int, int]] = []
        self.tiers: tuple[int, int, int] | None = None  # the budgets of zipmoe_cache_configure
        self.token_hot = self.token_room = self.reserve = 0
        self.read_room = 2**64 - 1

    def zipmoe_stats_get(self, s: Any) -> None:
        s.hot_bytes, s.warm_bytes, s.sm_bytes = self.resident - self.pool, 0, 0
        s.pool_bytes, s.staging_transient_bytes = self.pool, self.read_buffers
        s.decoding_bytes, s.materialize_calls = 0, self.calls

    def zipmoe_cache_set_slots(self, prefix: bytes, hot: int, warm: int, sm: int) -> int:
        self.slots.append((prefix, hot, warm, sm))
        return 0

    def zipmoe_cache_set_reserve(self, nbytes: int) -> int:
        self.reserve = nbytes
        return 0

    def zipmoe_cache_configure(self, hot: int, warm: int, sm: int, policy: int) -> int:
        self.tiers = (hot, warm, sm)
        self.token_hot = 0  # configure resets it, as the runtime's does
        return 0

    def zipmoe_cache_set_token_hot(self, nbytes: int) -> None:
        self.token_hot = nbytes

    def zipmoe_cache_set_token_room(self, nbytes: int) -> None:
        self.token_room = nbytes

    def zipmoe_cache_set_read_room(self, nbytes: int) -> None:
        self.read_room = nbytes

    def zipmoe_cache_apply_split(self, split: Any, policy: int) -> int:
        self.slots.append((None, 0, 0, 0))  # (every rule removed)
        self.zipmoe_cache_configure(split.hot, split.warm, split.sm, policy)
        self.zipmoe_cache_set_reserve(split.in_flight)
        self.zipmoe_cache_set_token_hot(split.token_hot)
        self.read_room = split.reads
        return 0


def test_a_fixed_budget_in_a_container_sized_to_it_keeps_its_tiers(zipmoe_model: Path) -> None:
    """A container whose limit leaves less room beside the budget than the safety margin (64 MiB or 3%) is how the
    issue's benchmark runs, and how one sizes a container for a model: the monitor must not take the difference
    from the tiers (a monitor that did left 1080-1224 MiB of decoded experts instead of 1503 at 75% of the 2.8g
    model on some runs, 29-33 misses a token instead of 20). Nor may the compute buffers, which the first decode
    touches, nor the kernel moving the mapped weights' pages between its active and inactive lists. Memory that
    another process takes still shrinks the tiers, by as much; "auto" keeps its margin."""
    from pyzipmoe.runtime import controller, memory
    from pyzipmoe.runtime.budget import model_memory

    need = model_memory(zipmoe_model)
    budget = need.minimum + need.expert_bytes
    lib = _FakeStats(need.expert_bytes)  # every expert decoded
    held = need.other_bytes + lib.resident
    limit = 4 << 30
    room = {"bytes": budget + budget // 10}  # what the model could hold: far less than budget + the margin
    inactive = {"share": 0.8}  # of the file cache, on the kernel's inactive list

    def read() -> memory.MemoryReading:
        # a cgroup at its limit: file cache fills what the rest leaves, the mapped weights' pages among it
        file_cache = need.other_bytes + room["bytes"] - held
        return memory.MemoryReading(total=64 << 30, available=32 << 30, rss=0, cgroup_limit=limit,
                                    cgroup_usage=limit, cgroup_reclaimable=int(file_cache * inactive["share"]),
                                    cgroup_file_cache=file_cache)

    assert memory.safety_margin(read()) > budget // 10
    mon = controller.monitor_for(zipmoe_model, budget, read=read, interval=3600, lib=lib)
    assert mon.fixed
    assert not mon.step() and mon.budget == budget  # the room there was at the start is the user's to keep
    room["bytes"] -= budget // 40  # the first decode touched the compute buffers
    mon.note_decode()
    assert not mon.step() and mon.budget == budget
    assert mon.spare == budget // 10 - budget // 40
    inactive["share"] = 0.1  # the pages were used again: the kernel moved them to its active list
    assert not mon.step()
    # a prompt: its first store evicts generation's share of the allowance, whose pages the runtime keeps for the
    # experts in flight, and its reads grow the runtime's buffers (the room beside them shrinks by as much)
    lib.pool = budget // 15
    lib.read_buffers = budget // 15
    room["bytes"] -= lib.read_buffers
    assert not mon.step() and mon.budget == budget
    room["bytes"] += lib.read_buffers  # the prompt ended
    lib.pool = lib.read_buffers = 0
    assert not mon.step()
    taken = budget // 15  # another process takes some
    room["bytes"] -= taken
    assert mon.step() and mon.budget == budget - taken
    assert lib.slots, "the shrink reached the stores"
    # the plan's room bounds a prompt's read buffers; here every expert stays decoded: nothing to read, no bound
    assert mon.planned.plan.read_bytes == 0 and lib.read_room == 2**64 - 1
    assert not mon.step()  # the same reading again

    auto = controller.MemoryMonitor(mon.planned, ceiling=budget, read=read, interval=3600, lib=lib)
    assert auto.step()
    # "auto": what it could hold (the room: its resident bytes and what the cgroup could still give, file cache
    # included) less its margin, as at load
    assert auto.budget == max(need.minimum, room["bytes"] - memory.safety_margin(read()))


def test_a_fixed_budget_makes_room_once_for_the_weights_the_page_cache_lost(zipmoe_model: Path) -> None:
    """A long prompt after short ones touches ~87 MiB more of llama.cpp's compute buffers (the 2.8g model): in a
    container sized to the budget the process no longer fits, the kernel takes page cache of the mapped weights
    that are not experts, and every token reads them again (1.7-2.4 against ~10 tokens/s at 75%). The monitor then
    shrinks the tiers by twice what the cache lacks, whatever the hysteresis, and once: until the stores are down to
    it, readings that still find the weights short change nothing (acting on them shrank three and four times in a
    row). Then it keeps nothing beside the budget free for others any more: the process took that room."""
    from pyzipmoe.runtime import controller, memory
    from pyzipmoe.runtime.budget import model_memory

    need = model_memory(zipmoe_model)
    budget = need.minimum + need.expert_bytes
    lib = _FakeStats(need.expert_bytes)  # every expert decoded
    limit = budget + budget // 20 + budget // 50
    process = {"bytes": budget // 20}  # the process's memory besides the model: compute buffers, KV cache, Python

    def read() -> memory.MemoryReading:
        # a cgroup at its limit: the kernel keeps what fits of the file cache, the mapped weights first
        anon = lib.resident + lib.read_buffers + process["bytes"]
        file_cache = min(limit - anon, need.other_bytes + budget // 50)
        return memory.MemoryReading(total=64 << 30, available=32 << 30, rss=0, cgroup_limit=limit,
                                    cgroup_usage=anon + file_cache, cgroup_reclaimable=file_cache,
                                    cgroup_file_cache=file_cache)

    mon = controller.monitor_for(zipmoe_model, budget, read=read, interval=3600, lib=lib)
    mon.note_decode()
    assert not mon.step() and mon.budget == budget and mon.weights_short == 0
    short = budget // 40
    lib.read_buffers = need.in_flight_bytes + budget // 50 + short  # a prompt's reads: gone when it ends
    assert not mon.step() and mon.weights_short == 0
    lib.read_buffers = 0
    process["bytes"] += need.in_flight_bytes + budget // 50 + short  # a long prompt's batch
    assert mon.step()
    assert mon.budget == need.other_bytes + need.expert_bytes - 2 * short  # what is held, less twice the lack
    assert mon.spare == 0
    for _ in range(controller.PENDING_STEPS + 5):  # an idle model: the stores evict nothing, and nothing changes
        assert not mon.step() and mon.weights_short == short
    for _ in range(3):  # it runs, the stores have not evicted yet: nothing changes either
        lib.calls += 1
        assert not mon.step()
    lib.resident = mon.budget - need.minimum  # they have
    assert not mon.step() and mon.weights_short == 0
    assert not mon.step()


def test_a_fixed_split_shrinks_by_the_runtime_s_shares_not_by_slots(zipmoe_model: Path) -> None:
    """pyzipmoe.Llama's decoded-only split, shrunk by the monitor: the runtime's budgets are split again as the
    loader splits ZIPMOE_MEMORY_BUDGET (zipmoe_budget_split_tiers), not turned into slots, which hold neither a
    prompt's read room (slots leave it since plan_tiers) nor generation's allowance for the tensor in flight: after
    a shrink the hot tier generated with ~36 MiB fewer decoded experts at 75% of the 2.8g model. Generation's hot
    budget is then the whole budget less the weights that are not experts, as at load."""
    _native_library()
    from pyzipmoe.runtime import controller, memory
    from pyzipmoe.runtime.budget import model_memory

    need = model_memory(zipmoe_model)
    budget = need.minimum + need.expert_bytes
    lib = _FakeStats(need.expert_bytes)
    room = {"bytes": budget + budget // 20}  # what the model could hold: the mapped weights are file cache

    def read() -> memory.MemoryReading:
        return memory.MemoryReading(total=64 << 30, available=room["bytes"] - lib.resident, rss=0)

    mon = controller.monitor_for(zipmoe_model, budget, read=read, interval=3600, lib=lib, split=(1.0, 0.0, 0.0))
    assert mon.sizes and not mon.step()
    room["bytes"] -= need.expert_bytes // 2  # another process takes half of the experts' room
    assert mon.step() and mon.budget < budget - need.expert_bytes // 4
    assert lib.slots == [(None, 0, 0, 0)], lib.slots  # no slots: the shares apply
    hot, warm, sm = lib.tiers
    assert (warm, sm) == (0, 0) and 0 < hot and hot + lib.reserve <= mon.budget - need.other_bytes, lib.tiers
    assert 0 < lib.reserve <= need.in_flight_bytes
    assert lib.token_hot == mon.budget - need.other_bytes, (lib.token_hot, mon.budget)
    assert 0 < lib.read_room < lib.token_hot - hot  # (the split's reads bound a prompt's read buffers)
    assert mon.replans == [(mon.budget, None)]


@pytest.mark.parametrize("scenario", ["between", "during"])
def test_slots_changed_around_an_invocation_keep_the_store_working(scenario: str, zipmoe_model: Path,
                                                                   tiny_model: Path) -> None:
    """The threads of one invocation may disagree on the fast path (every routed expert hot, limits current):
    one of them plans on the slow path while another leaves on the fast one. A plan that waited for every thread
    would wait for one that never comes: nobody would publish it nor release it. The store's next invocation under the same key (llama.cpp's
    next token: its graph node is the same) then joins that stale plan instead of planning its own, so its routed
    experts may be left undecoded or half decoded for the matmul; an invocation under another key (another graph)
    waits forever. New slots reach the stores exactly there: between tokens, where the first thread to plan
    refreshes the store's limits before a sibling checks them ("between"), or from the monitor's thread at any
    moment ("during"). Two threads that ggml happens to run one after the other are called one after the other
    here, so the test is deterministic."""
    _native_library()
    done = subprocess.run([sys.executable, "-c", STORE_RACE, str(zipmoe_model), str(tiny_model),
                           "blk.0.ffn_gate_exps.weight", scenario], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(s >= 0 for s in report["statuses"] + report["same_key"]), report
    assert report["expert_6_exact"], f"new slots {scenario} a split invocation: the next one decodes an expert " \
                                     f"only in part: {report}"
    assert report["other_key_done"], f"new slots {scenario} a split invocation: an invocation under another key " \
                                     f"waits forever: {report}"
    assert report["other_key"] >= 0 and report["hot_experts"] == 1, report  # expert 5, within the new limit of 1


# -------------------------------------------------------------------------------------------- cgroup v1


def _read_int(path: Path) -> int:
    return int(path.read_text().strip())


def _file_cache(cg: Path) -> int:
    """The cgroup's file cache, active and inactive (what "auto" counts as room)."""
    stats = dict(line.split(" ", 1) for line in (cg / "memory.stat").read_text().splitlines() if " " in line)
    return int(stats.get("total_inactive_file", 0)) + int(stats.get("total_active_file", 0))


def test_lowered_cgroup_limit_while_generating(llama_lib_dir: Path, cgroup_parent: Path,
                                               small_models: tuple[Path, Path], tmp_path: Path) -> None:
    """memory_budget="auto" in a cgroup with a generous limit keeps every expert decoded; after CGROUP_BEFORE
    tokens the test lowers the limit so that, after the safety margin, the tiers get CGROUP_TIERS bytes. The
    limit stays above what the cgroup uses: nothing forces the tiers down except the monitor's reading.

    Two threads: a re-plan between tokens may split an invocation's threads between the store's fast and slow
    paths, which the store must survive (see test_slots_changed_around_an_invocation_keep_the_store_working)."""
    from pyzipmoe.runtime.budget import model_memory
    from pyzipmoe.runtime.memory import MARGIN_SHARE, MIN_MARGIN

    bf16, packed = small_models
    need = model_memory(packed)
    common = {"mode": "cgroup", "prompt": PROMPT, "n_ctx": N_CTX, "n_gen": CGROUP_N_GEN, "threads": CGROUP_THREADS,
              "before": CGROUP_BEFORE, "after": CGROUP_AFTER}
    (ref,), ref_arrays = run_worker({**common, "models": [("bf16", str(bf16))], "out": str(tmp_path / "bf16.npz")},
                                    llama_lib_dir)

    cg = cgroup_parent / f"zipmoe-adapt-{os.getpid()}"
    cg.mkdir()
    proc = None
    try:
        (cg / "memory.limit_in_bytes").write_text(str(CGROUP_LIMIT))
        job = {**common, "models": [("zipmoe", str(packed))], "out": str(tmp_path / "zipmoe.npz"),
               "ready": str(tmp_path / "ready.json"), "lowered": str(tmp_path / "lowered")}
        # the shell puts itself in the cgroup, then becomes the worker: everything it allocates is charged there
        proc = start_worker(job, llama_lib_dir, ("/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"',
                                                 str(cg / "cgroup.procs")))
        deadline = time.monotonic() + TIMEOUT
        ready = Path(job["ready"])
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                _, err = proc.communicate(timeout=10) if proc.poll() is not None else ("", "")
                raise AssertionError(f"the worker did not get to its first {CGROUP_BEFORE} tokens:\n{err[-3000:]}")
            time.sleep(0.02)
        before = json.loads(ready.read_text())
        assert before["replans"] == 0 and before["budget"] == need.minimum + need.expert_bytes, before
        assert before["resident"] == need.expert_bytes, before  # every expert decoded

        # lower the limit so that what the monitor computes, held + (limit - (usage - file cache)) - margin with
        # held = the tiers' bytes (the weights that are not experts are file cache), comes to the model's
        # minimum + CGROUP_TIERS
        usage, file_cache = _read_int(cg / "memory.usage_in_bytes"), _file_cache(cg)
        in_use = usage - min(file_cache, usage)
        limit = in_use + MIN_MARGIN + need.minimum + CGROUP_TIERS - before["resident"] - before["pool_bytes"]
        assert limit * MARGIN_SHARE < MIN_MARGIN  # so the margin is MIN_MARGIN
        # above what is used: no reclaim, no OOM (by the margin, less what the tiers give back: 13 MiB here)
        assert limit > usage + (8 << 20), (limit, usage, file_cache)
        (cg / "memory.limit_in_bytes").write_text(str(limit))
        write_atomic(Path(job["lowered"]), str(limit))

        (got,), arrays = finish(proc, job, TIMEOUT)
        failcnt = _read_int(cg / "memory.failcnt")
        peak = _read_int(cg / "memory.max_usage_in_bytes")
    finally:
        if proc is not None:
            kill_group(proc)
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)  # the worker may take a moment to leave
    assert not cg.exists(), f"could not remove {cg}"

    where = (f"limit lowered from {CGROUP_LIMIT >> 20} to {limit / 2**20:.1f} MiB (in use {in_use / 2**20:.1f} MiB, "
             f"peak {peak / 2**20:.1f} MiB, failcnt {failcnt}); replans {got['replans']}; before {before}, "
             f"end {got['end']}")
    assert got["generated"] == ref["generated"], where
    assert_bit_identical(arrays["zipmoe"], ref_arrays["bf16"], f"zipmoe with a lowered limit vs BF16 ({where})")
    assert got["replans"], f"the monitor did not re-plan: {where}"
    # the monitor was stopped once it had re-planned, CGROUP_AFTER tokens or more before the end: those ran under
    # the last plan
    assert got.get("stopped_at") is not None and got["stopped_at"] <= CGROUP_N_GEN - CGROUP_AFTER, where
    # the tiers shrank, within the last budget (pyzipmoe.Llama's decoded-only split: the runtime's shares, whose
    # generation holds the allowance for the tensor in flight too), and the process gave the memory back
    budget, plan = got["replans"][-1]
    assert budget < need.minimum + CGROUP_TIERS + (4 << 20), where  # the target, give or take the noise
    end = got["end"]
    assert end["resident"] < before["resident"] // 2, where
    assert plan is None, where  # ("auto" is pyzipmoe.Llama's decoded-only split: the runtime's shares)
    assert end["resident"] + end["pool_bytes"] <= budget - need.other_bytes, where
    freed = before["resident"] - end["resident"]
    assert end["rss"] < before["rss"] - freed // 2, where
    assert end["in_use"] < before["in_use"] - freed // 2, where  # given back to the cgroup, not only unmapped
    assert failcnt == 0, where  # the limit was never reached: the tiers shrank because the monitor asked
