"""Budget strings as people write them, and their way to the runtime."""

from __future__ import annotations

import pytest

from pyzipmoe.budget import cache_environment, parse_budget
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


def test_environment_carries_bytes_policy_and_share():
    env = cache_environment("1MiB", "lru", 0.25)
    assert env == {"ZIPMOE_MEMORY_BUDGET": str(1 << 20), "ZIPMOE_CACHE_POLICY": "lru", "ZIPMOE_HOT_SHARE": "0.25"}
    assert cache_environment() == {}
    with pytest.raises(ZipmoeError):
        cache_environment(policy="random")
    with pytest.raises(ZipmoeError):
        cache_environment(hot_share=1.5)
