"""The native library's layers point one way (docs/architecture.md, "The native library"): common <- codec <- format
<- cache <- op. Read from the source: a function of one layer calls no zipmoe_ function that a higher layer defines.
"""

from __future__ import annotations

import re
from pathlib import Path

from helpers import REPO

SRC = REPO / "ggml_zipmoe" / "src"
LAYERS = ["common", "codec", "format", "cache", "op"]  # lowest first

_DEFINITION = re.compile(r"^[A-Za-z_][\w \*&:<>]*?\b(zipmoe_\w+)\s*\([^;{]*\)\s*(?:const\s*)?\{", re.M)
_CALL = re.compile(r"\b(zipmoe_\w+)\s*\(")
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)


def _sources(root: Path, layer: str) -> list[Path]:
    return sorted(p for p in (root / layer).glob("*") if p.suffix in (".c", ".cpp"))


def upward_calls(root: Path = SRC) -> list[str]:
    """`layer/file -> layer/file: function` for each call to a function defined in a higher layer."""
    defined: dict[str, tuple[int, str]] = {}
    for rank, layer in enumerate(LAYERS):
        for path in _sources(root, layer):
            for name in _DEFINITION.findall(_COMMENT.sub("", path.read_text())):
                defined.setdefault(name, (rank, f"{layer}/{path.name}"))
    found = []
    for rank, layer in enumerate(LAYERS):
        for path in _sources(root, layer):
            for name in sorted(set(_CALL.findall(_COMMENT.sub("", path.read_text())))):
                where = defined.get(name)
                if where and where[0] > rank:
                    found.append(f"{layer}/{path.name} -> {where[1]}: {name}")
    return found


def test_the_checker_finds_a_call_up(tmp_path: Path) -> None:
    for layer in LAYERS:
        (tmp_path / layer).mkdir()
    (tmp_path / "format" / "types.c").write_text("int64_t zipmoe_type_layout(int32_t t,\n    void * out) {\n"
                                                 "    return 0;\n}\n")
    (tmp_path / "codec" / "codec.c").write_text("/* zipmoe_nothing() in a comment */\n"
                                                "int64_t zipmoe_codec_create(void) {\n"
                                                "    return zipmoe_type_layout(1, 0);\n}\n")
    (tmp_path / "cache" / "store.c").write_text("void zipmoe_store(void) { zipmoe_codec_create(); }\n")
    assert upward_calls(tmp_path) == ["codec/codec.c -> format/types.c: zipmoe_type_layout"]


def test_the_layers_point_one_way() -> None:
    assert len(_sources(SRC, "cache")) > 5 and _sources(SRC, "op")  # the walk found the library
    assert upward_calls() == []
