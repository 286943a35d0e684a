"""The native library's C API as Python sees it: the one size parser (zipmoe_parse_size), and the cffi
declarations of pyzipmoe/_native.py held against the public headers in ggml_zipmoe/include, so that neither can
drift from the other."""

from __future__ import annotations

import pytest

from pyzipmoe._native import ffi, lib

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


def parse_size(text: str) -> int | None:
    out = ffi.new("uint64_t *")
    rc = lib.zipmoe_parse_size(text.encode(), out)
    assert rc in (lib.ZIPMOE_OK, lib.ZIPMOE_ERR_ARG)
    return out[0] if rc == lib.ZIPMOE_OK else None


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0", 0),
        ("1000000", 1000000),
        ("7b", 7),
        ("7B", 7),
        ("512M", 512 * MIB),
        ("512mb", 512 * MIB),
        ("512MiB", 512 * MIB),
        ("1k", KIB),
        ("1kB", KIB),  # binary, as the llama.cpp glue always read it
        ("6GiB", 6 * GIB),
        ("6g", 6 * GIB),
        ("1TiB", TIB),
        ("2tb", 2 * TIB),
        ("3T", 3 * TIB),
        (" 1.5g ", 3 * GIB // 2),
        ("\t16MiB\n", 16 * MIB),
        ("0.5k", 512),
        ("0.1GiB", 107374182),  # rounded down: floor(0.1 * 2**30)
        ("1.9", 1),
        ("1048576TiB", 1 << 60),  # ZIPMOE_SIZE_MAX, the largest
        (str(1 << 60), 1 << 60),
    ],
)
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "", " ", "-1", "+1", "1e3GiB", "1e3", "inf", "nan", "infGiB", "1.", ".5", "1..5", "1.5.2GiB", "6 GiB",
        "60%", "auto", "GiB", "1PiB", "1EiB", "1KiBs", "1 k", "0x10", str((1 << 60) + 1), "1048577TiB",
        "18446744073709551616", "9" * 40, "1." + "0" * 65,
    ],
)
def test_parse_size_refuses(text):
    assert parse_size(text) is None


def test_parse_size_bound_and_arguments():
    assert lib.ZIPMOE_SIZE_MAX == 1 << 60
    out = ffi.new("uint64_t *", 12345)
    assert lib.zipmoe_parse_size(ffi.NULL, out) == lib.ZIPMOE_ERR_ARG
    assert lib.zipmoe_parse_size(b"1k", ffi.NULL) == lib.ZIPMOE_ERR_ARG
    assert lib.zipmoe_parse_size(b"nope", out) == lib.ZIPMOE_ERR_ARG and out[0] == 12345  # untouched on error
