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
        ("6 GiB", 6 * GIB),  # white space between the number and its unit, as pyzipmoe always read it
        ("1 k", KIB),
        ("1048576TiB", 1 << 60),  # ZIPMOE_SIZE_MAX, the largest
        (str(1 << 60), 1 << 60),
    ],
)
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "", " ", "-1", "+1", "1e3GiB", "1e3", "inf", "nan", "infGiB", "1.", ".5", "1..5", "1.5.2GiB", "6 Gi B",
        "60%", "auto", "GiB", "1PiB", "1EiB", "1KiBs", "0x10", str((1 << 60) + 1), "1048577TiB",
        "18446744073709551616", "9" * 40, "1." + "0" * 65,
    ],
)
def test_parse_size_refuses(text):
    assert parse_size(text) is None


def parse_budget(text: str, total: int) -> int | None:
    out = ffi.new("uint64_t *")
    rc = lib.zipmoe_parse_budget(text.encode(), total, out)
    assert rc in (lib.ZIPMOE_OK, lib.ZIPMOE_ERR_ARG)
    return out[0] if rc == lib.ZIPMOE_OK else None


@pytest.mark.parametrize(
    "text, total, expected",
    [
        ("60%", 1000, 600),
        (" 12.5 % ", 1000, 125),
        ("100%", 1 << 60, 1 << 60),
        ("0%", 1 << 40, 0),
        ("33.3333%", 3 * GIB, 3 * GIB * 333333 // 1000000),  # exact: no float rounding
        ("0.0001%", 10**6, 1),
        ("6GiB", 0, 6 * GIB),  # a size is a size, whatever the total
    ],
)
def test_parse_budget_accepts(text, total, expected):
    assert parse_budget(text, total) == expected


@pytest.mark.parametrize("text", ["101%", "100.0001%", "1.00001%", "-5%", "%", "5%%", "5% GiB", "auto", "inf%"])
def test_parse_budget_refuses(text):
    assert parse_budget(text, GIB) is None


def test_parse_budget_refuses_a_total_past_the_bound():
    assert parse_budget("50%", (1 << 60) + 1) is None


def test_parse_size_bound_and_arguments():
    assert lib.ZIPMOE_SIZE_MAX == 1 << 60
    out = ffi.new("uint64_t *", 12345)
    assert lib.zipmoe_parse_size(ffi.NULL, out) == lib.ZIPMOE_ERR_ARG
    assert lib.zipmoe_parse_size(b"1k", ffi.NULL) == lib.ZIPMOE_ERR_ARG
    assert lib.zipmoe_parse_size(b"nope", out) == lib.ZIPMOE_ERR_ARG and out[0] == 12345  # untouched on error


# ---------------------------------------------------------------- the cffi declarations against the headers

import re  # noqa: E402
from pathlib import Path  # noqa: E402

from pyzipmoe import _native  # noqa: E402

INCLUDE = Path(__file__).resolve().parents[2] / "ggml_zipmoe" / "include"
TYPE_WORDS = {"const", "void", "char", "short", "int", "long", "unsigned", "signed", "float", "double", "struct"}


def _strip(text: str) -> str:
    """C text without comments, preprocessor lines but #define, extern "C" braces or ZIPMOE_API."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    lines = [line for line in text.split("\n") if not line.lstrip().startswith("#") or line.lstrip().startswith("#define")]
    text = "\n".join(lines)
    text = text.replace('extern "C" {', " ").replace("ZIPMOE_API", " ")
    return text


def _squash(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return re.sub(r"\s*([*(),\[\]])\s*", r"\1", text)


def _param_type(param: str) -> str:
    """A parameter's type: its declaration less the parameter's name."""
    tokens = re.findall(r"[A-Za-z_]\w*|\*|\[[^\]]*\]", param)
    arrays = []
    while tokens and tokens[-1].startswith("["):
        arrays.insert(0, tokens.pop())
    if len(tokens) > 1 and re.fullmatch(r"[A-Za-z_]\w*", tokens[-1]) and tokens[-1] not in TYPE_WORDS:
        tokens.pop()
    return " ".join(tokens + arrays)


def _declarations(text: str) -> tuple[dict, dict, dict]:
    """(functions, enums, defines) declared in C text: name -> (return type, parameter types), name -> {constant:
    value}, name -> value text."""
    text = _strip(text)
    defines = {m.group(1): m.group(2).strip() for m in re.finditer(r"^\s*#define\s+(\w+)[ \t]+([^\n]+)", text, re.M)}
    text = re.sub(r"^\s*#define[^\n]*", " ", text, flags=re.M)
    enums = {}
    for m in re.finditer(r"typedef\s+enum\s*\w*\s*\{(.*?)\}\s*(\w+)\s*;", text, re.S):
        values, value = {}, -1
        for item in filter(None, (i.strip() for i in m.group(1).split(","))):
            name, _, expr = item.partition("=")
            value = int(expr.strip(), 0) if expr.strip() else value + 1
            values[name.strip()] = value
        enums[m.group(2)] = values
    text = re.sub(r"typedef[^;{]*\{.*?\}[^;]*;", " ", text, flags=re.S)  # struct and enum bodies
    functions = {}
    for m in re.finditer(r"([A-Za-z_][\w\s\*]*?)\b(zipmoe_\w+)\s*\(([^;{]*?)\)\s*;", text):
        ret, name, params = m.groups()
        ret = _squash(re.sub(r"^.*\b(?:typedef|static)\b", "", ret))
        params = [_squash(_param_type(p)) for p in params.split(",")] if params.strip() else []
        functions[name] = (_squash(" ".join(re.findall(r"[A-Za-z_]\w*|\*", ret))), params)
    return functions, enums, defines


def _headers() -> tuple[dict, dict, dict]:
    functions, enums, defines = {}, {}, {}
    for header in sorted(INCLUDE.glob("*.h")):
        f, e, d = _declarations(header.read_text())
        functions.update(f)
        enums.update(e)
        defines.update(d)
    return functions, enums, defines


def _value(text: str) -> int:
    """An integer #define's value: a literal, maybe cast, suffixed or shifted ("((uint64_t) 1 << 60)")."""
    text = re.sub(r"\(\s*(?:u?int\d+_t|size_t|unsigned|int)\s*\)", "", text)
    text = re.sub(r"(?<=[0-9a-fA-F])(?:[uU][lL]{0,2}|[lL]{1,2}[uU]?)\b", "", text)
    if not re.fullmatch(r"[\s0-9a-fA-FxX()<>+\-*|]+", text):
        raise ValueError(text)
    return int(eval(text, {"__builtins__": {}}))  # noqa: S307 (digits and operators only, checked above)


def test_cdef_functions_match_headers():
    cdef, _, _ = _declarations(_native.CDEF)
    header, _, _ = _headers()
    assert cdef, "no prototypes found in the CDEF"
    missing = sorted(set(cdef) - set(header))
    assert not missing, f"declared in pyzipmoe/_native.py but in no header of {INCLUDE}: {missing}"
    drift = {name: (cdef[name], header[name]) for name in cdef if cdef[name] != header[name]}
    assert not drift, "prototypes that differ, (cffi, header): " + "; ".join(f"{k}: {v}" for k, v in drift.items())


def test_cdef_enums_match_headers():
    _, cdef, _ = _declarations(_native.CDEF)
    _, header, _ = _headers()
    assert cdef, "no enums found in the CDEF"
    for name, values in cdef.items():
        assert name in header, f"enum {name} is in no header"
        assert values == header[name], f"enum {name}: cffi {values}, header {header[name]}"


def test_cdef_defines_match_headers():
    _, _, cdef = _declarations(_native.CDEF)
    _, _, header = _headers()
    for name, text in cdef.items():
        assert name in header, f"#define {name} is in no header"
        assert _value(text) == _value(header[name]), f"#define {name}: cffi {text}, header {header[name]}"


def test_the_check_finds_drift():
    """The parser behind the tests above sees what it must: a changed type, a missing constant."""
    header = "ZIPMOE_API int64_t zipmoe_x(const uint8_t lengths[256], zipmoe_store * const * stores, size_t n);\n" \
             "typedef enum { A = 1, B = 2, C = 3 } e;"
    functions, enums, _ = _declarations(header)
    assert functions["zipmoe_x"] == ("int64_t", ["const uint8_t[256]", "zipmoe_store*const*", "size_t"])
    assert enums["e"] == {"A": 1, "B": 2, "C": 3}
    other, other_enums, _ = _declarations("int64_t zipmoe_x(const uint8_t * l, zipmoe_store * const * s, size_t n);"
                                          "typedef enum { A = 1, B = 2 } e;")
    assert other["zipmoe_x"] != functions["zipmoe_x"] and other_enums["e"] != enums["e"]
