"""Budget strings as people write them, and their way to the runtime."""

from __future__ import annotations

import pytest

from pyzipmoe.runtime.budget import parse_budget
from pyzipmoe.runtime.config import RuntimeConfig
from pyzipmoe.errors import ZipmoeError


@pytest.mark.parametrize("text,expect", [
    ("6GiB", 6 << 30), ("512MiB", 512 << 20), ("512m", 512 << 20), ("1000000", 1_000_000), ("1.5G", 3 << 29),
    ("0", 0), (4096, 4096), ("50%", 500), ("100%", 1000),
])
def test_sizes(text, expect):
    assert parse_budget(text, total=1000) == expect


@pytest.mark.parametrize("text,says", [
    ("-1", "not a size"), ("abc", "not a size"), ("200%", "more than all"), ("12 parsecs", "unknown unit"),
    ("", "not a size"), (-5, "negative"),
])
def test_bad_sizes_say_what_is_wrong(text, says):
    with pytest.raises(ZipmoeError, match=says):
        parse_budget(text, total=1000)


@pytest.mark.parametrize("text,says", [
    ("inf", "not a size"), ("nan", "not a size"), ("1e30", "not a size"), ("infGiB", "not a size"),
    ("9" * 400, "more than zipmoe can address"), ("1048577TiB", "more than zipmoe can address"),
    ("12.34567%", "too many digits"),
])
def test_sizes_past_what_a_machine_has_are_refused_in_one_line(text, says):
    """One bounded parser (the library's): no inf, nan, exponent or number past 1 EiB reaches a budget."""
    with pytest.raises(ZipmoeError, match=says) as e:
        parse_budget(text, total=1000)
    assert "\n" not in str(e.value)


def test_a_modelfile_size_past_the_bound_is_a_modelfile_error():
    from pyzipmoe.models.modelfile import ModelfileError, parse

    with pytest.raises(ModelfileError, match="line 2: .* is more than zipmoe can address"):
        parse("FROM x.gguf\nPARAMETER memory_budget " + "9" * 400 + "\n", source="M")


def test_environment_carries_bytes_policy_and_share():
    env = RuntimeConfig("1MiB", "lru", 0.25).to_env()
    assert env == {"ZIPMOE_MEMORY_BUDGET": str(1 << 20), "ZIPMOE_CACHE_POLICY": "lru", "ZIPMOE_HOT_SHARE": "0.25"}
    assert RuntimeConfig().to_env() == {}
    with pytest.raises(ZipmoeError):
        RuntimeConfig(policy="random").to_env()
    with pytest.raises(ZipmoeError):
        RuntimeConfig(hot_share=1.5).to_env()


def test_programs_spin_briefly_unless_the_user_says_otherwise():
    """llama.cpp programs zipmoe starts get OpenMP's short spinning (pyzipmoe.OPENMP_SPIN), a user's setting wins."""
    from pyzipmoe import OPENMP_SPIN
    from pyzipmoe.runtime import runner

    name, value = OPENMP_SPIN
    assert runner.environment(base={})[name] == value
    assert runner.environment(base={name: "7"})[name] == "7"
    assert name not in runner.environment(base={"OMP_WAIT_POLICY": "active"})


def test_a_build_s_libraries_go_first_once():
    from pyzipmoe.paths import bin_dir
    from pyzipmoe.runtime import runner

    assert runner.library_path("/stock", {}) == "/stock"
    assert runner.library_path("/stock", {"LD_LIBRARY_PATH": "/usr/lib::/stock"}) == "/stock:/usr/lib"
    assert runner.environment(base={"LD_LIBRARY_PATH": "/usr/lib"})["LD_LIBRARY_PATH"] == f"{bin_dir()}:/usr/lib"


@pytest.mark.parametrize("given,expect", [({}, "2000"), ({"GOMP_SPINCOUNT": "7"}, "7"),
                                          ({"OMP_WAIT_POLICY": "passive"}, None)])
def test_importing_pyzipmoe_sets_the_spinning_for_this_process(given, expect):
    """libgomp reads it when llama_cpp loads libllama, so importing pyzipmoe (before llama_cpp) sets it."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")} | given
    done = subprocess.run([sys.executable, "-c", "import json, os, pyzipmoe; "
                           "print(json.dumps(os.environ.get('GOMP_SPINCOUNT')))"],
                          env=env, capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == expect


def test_a_token_embedding_is_charged_for_the_pages_of_a_batch_of_rows():
    """zipmoe_budget_embd_charge: 2048 rows (llama.cpp's default batch), each on the pages it may span, at most the
    whole table."""
    from pyzipmoe._native import lib

    embd_charge = lib.zipmoe_budget_embd_charge

    page = 4096
    assert embd_charge(1 << 30, 2048, page) == 2048 * 2 * page       # a row within a page may cross into the next
    assert embd_charge(1 << 30, 4096, page) == 2048 * 2 * page
    assert embd_charge(1 << 30, 5000, page) == 2048 * 3 * page
    assert embd_charge(10 << 20, 2048, page) == 10 << 20             # a small table: all of it
    assert embd_charge(1 << 30, 0, page) == 1 << 30                  # no row size: charged whole


def test_a_plain_gguf_is_budgeted_at_its_expert_tensors_own_sizes(tiny_model, tmp_path):
    """A plain GGUF's expert tensors are served as stored: the accounting takes their bytes (whatever the type), the
    largest of them in flight; the runtime's environment then carries the budget, checked against that minimum."""
    from pyzipmoe.file.gguf import read_gguf
    from pyzipmoe.file.metadata import EXPERT_NAME
    from pyzipmoe.runtime.budget import model_memory, plain_experts
    from pyzipmoe.runtime.controller import runtime_environment

    tensors = read_gguf(tiny_model).tensors
    experts = [t for t in tensors if EXPERT_NAME.fullmatch(t.name)]
    assert plain_experts(tiny_model) == [(t.name, t.nbytes) for t in experts] and experts
    need = model_memory(tiny_model, mapped=False)  # (the token embedding charged whole)
    assert need.in_flight_bytes == max(t.nbytes for t in experts)
    assert need.expert_bytes == sum(t.nbytes for t in experts)
    assert need.other_bytes == sum(t.nbytes for t in tensors) - need.expert_bytes
    env = runtime_environment(str(tiny_model), budget=str(need.minimum + 1000), is_zipmoe=False, mapped=False)
    assert env["ZIPMOE_MEMORY_BUDGET"] == str(need.minimum + 1000)
    with pytest.raises(ZipmoeError, match=f"is below the minimum of {need.minimum} bytes"):
        runtime_environment(str(tiny_model), budget=str(need.minimum - 1), is_zipmoe=False, mapped=False)
    assert "ZIPMOE_MEMORY_BUDGET" not in runtime_environment(str(tiny_model), budget=None, is_zipmoe=False)


def test_a_budget_is_resolved_once_and_passed_on(zipmoe_model):
    """runtime_settings resolves what the user gave into one Budget: the bytes the environment carries, and the
    budget as given for messages; a monitor takes that Budget as it is, without resolving it again."""
    from pyzipmoe.runtime import controller
    from pyzipmoe.runtime.budget import Budget, model_memory

    need = model_memory(zipmoe_model)
    given = f"{need.minimum + need.expert_bytes // 2}"
    settings = controller.runtime_settings(zipmoe_model, budget=given)
    assert settings.budget == Budget(need.minimum + need.expert_bytes // 2, given)
    assert settings.env["ZIPMOE_MEMORY_BUDGET"] == str(settings.budget.nbytes)
    assert not settings.budget.automatic and Budget(1, " AUTO ").automatic
    assert controller.runtime_settings(zipmoe_model).budget is None
    monitor = controller.monitor_for(zipmoe_model, Budget(need.whole, "auto"), interval=3600, events=False)
    assert monitor.budget == need.whole and not monitor.fixed and monitor.ceiling == need.whole
    fixed = controller.monitor_for(zipmoe_model, settings.budget, interval=3600, events=False)
    assert fixed.budget == settings.budget.nbytes and fixed.fixed and fixed.ceiling == settings.budget.nbytes


def test_a_refused_budget_is_said_as_the_user_gave_it(zipmoe_model):
    """The refusal is the native library's (zipmoe_budget_check), with the budget in the user's words."""
    from pyzipmoe.runtime.budget import check_budget, human_size, model_memory, resolve_budget

    need = model_memory(zipmoe_model)
    check_budget(need.minimum, need, "anything")  # the minimum itself holds
    with pytest.raises(ZipmoeError) as e:
        resolve_budget("0%", need)
    said = str(e.value)
    assert said.startswith("memory budget 0% (0 B) is below") and said.endswith("; raise --memory-budget")
    assert f"is below the minimum of {human_size(need.minimum)} for this model" in said
    with pytest.raises(ZipmoeError, match=r"^memory budget 100 KiB is below the minimum"):
        resolve_budget("100KiB", need)
    with pytest.raises(ZipmoeError, match=f"^memory budget {need.minimum - 1} bytes .*\\({need.minimum - 1} bytes\\) "
                                          f"is below the minimum of {need.minimum} bytes"):
        check_budget(need.minimum - 1, need, str(need.minimum - 1))
