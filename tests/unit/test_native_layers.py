"""The native library's layers point one way (docs/architecture.md, "The native library"): common <- codec <- format
<- cache <- op. Read from the source: a function of one layer calls no zipmoe_ function that a higher layer defines.

Inside the cache the same holds for its own layers, io <- tiers <- materialise (CACHE_LAYERS): no file uses a
function, a global or a header's macro or inline function of a higher layer, nor includes its header, and the
files of one layer use each other without a circle.
"""

from __future__ import annotations

import re
from pathlib import Path

from helpers import REPO

SRC = REPO / "ggml_zipmoe" / "src"
LAYERS = ["common", "codec", "format", "cache", "op"]  # lowest first

# The cache's files by layer, lowest first (docs/architecture.md, "The native library", says what each holds and why);
# a header is in the layer whose functions and state it declares.
CACHE_LAYERS: list[tuple[str, frozenset[str]]] = [
    ("io", frozenset({"store-state.h", "io.h", "reader.h", "reader.c", "counters.c", "file.c", "buffers.c",
                      "slots.c", "readahead.c"})),
    ("tiers", frozenset({"tiers.h", "stores.c", "config.c", "budget.c", "policy.c", "routing.c", "pages.c",
                         "tiers.c", "prior.c", "plan.c"})),
    ("materialise", frozenset({"cache-impl.h", "materialize.c", "prefill.c", "store.c", "stats.c"})),
]

_DEFINITION = re.compile(r"^[A-Za-z_][\w \*&:<>]*?\b(zipmoe_\w+)\s*\([^;{]*\)\s*(?:const\s*)?\{", re.M)
_CALL = re.compile(r"\b(zipmoe_\w+)\s*\(")
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)

# the cache's own scan: comments and string literals blanked; what a file defines for others and what it uses
_NOT_CODE = re.compile(r"/\*.*?\*/|//[^\n]*|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", re.S)
_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\"", re.M)
_FUNCTION = re.compile(r"^(static[ \t]+inline[ \t]+)?(?!static\b)[A-Za-z_][\w \*]*?\b(\w+)\s*\([^;{]*\)\s*\{", re.M)
_EXTERN = re.compile(r"^extern\b[^;(]*?\b(\w+)\s*;", re.M)
_MACRO = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)(.*)$", re.M)
_IDENTIFIER = re.compile(r"\b[A-Za-z_]\w*\b")


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


def _code(path: Path) -> str:
    """The file's text with comments and string literals blanked (a line continuation of a macro joined)."""
    return _NOT_CODE.sub(" ", path.read_text()).replace("\\\n", " ")


def _body(text: str, start: int) -> str:
    """The braces' contents from the `{` at text[start - 1] to its match."""
    depth, i = 1, start
    while depth and i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[start:i]


class _Cache:
    """The cache's files as the checker reads them: who defines what for the others (a .c file: its functions that
    are not static and its globals, declared extern in a header; a header: its macros and inline functions, whose
    bodies it uses the others' names in), and what each file uses and includes."""

    def __init__(self, root: Path) -> None:
        paths = sorted(p for p in root.iterdir() if p.suffix in (".c", ".h"))
        codes = {p.name: _code(p) for p in paths}
        self.includes = {p.name: set(_INCLUDE.findall(_COMMENT.sub("", p.read_text()))) & set(codes) for p in paths}
        self.owner: dict[str, str] = {}
        self.bodies: dict[str, str] = {}  # a header's macro or inline function: its body
        self.code: dict[str, str] = {}  # where a file uses the others' names
        for name, code in codes.items():
            if name.endswith(".c"):
                self.owner.update({m.group(2): name for m in _FUNCTION.finditer(code) if not m.group(1)})
                self.code[name] = code
                continue
            items = {m.group(2): _body(code, m.end()) for m in _FUNCTION.finditer(code) if m.group(1)}
            items.update(_MACRO.findall(code))
            self.owner.update(dict.fromkeys(items, name))
            self.bodies.update(items)
            self.code[name] = "\n".join(items.values())
            for variable in _EXTERN.findall(code):  # owned by the .c file that defines it
                definition = re.compile(rf"^(?!extern\b)[A-Za-z_][^;(\n]*\b{variable}\s*[=;]", re.M)
                self.owner.update({variable: c for c in codes if c.endswith(".c") and definition.search(codes[c])})

    def names(self, name: str) -> set[str]:
        """The others' names a file (or a header's item, by its body) uses."""
        code = self.code.get(name, self.bodies.get(name, ""))
        return {i for i in _IDENTIFIER.findall(code) if self.owner.get(i, name) != name}

    def sources_used(self, name: str) -> set[str]:
        """The .c files a file uses, seeing through the header items it uses to what their bodies use."""
        found: set[str] = set()
        todo, seen = list(self.names(name)), set()
        while todo:
            item = todo.pop()
            if item in seen:
                continue
            seen.add(item)
            if self.owner[item].endswith(".h"):
                todo.extend(self.names(item))
            elif self.owner[item] != name:
                found.add(self.owner[item])
        return found


def cache_uses(root: Path = SRC / "cache") -> dict[tuple[str, str], set[str]]:
    """(file, file it depends on) -> what of it the file uses: functions, globals, a header's macros and inline
    functions, or the header itself (included)."""
    return _uses(_Cache(root))


def _uses(cache: _Cache) -> dict[tuple[str, str], set[str]]:
    uses: dict[tuple[str, str], set[str]] = {}
    for name in cache.code:
        for identifier in cache.names(name):
            uses.setdefault((name, cache.owner[identifier]), set()).add(identifier)
        for header in cache.includes[name]:
            uses.setdefault((name, header), set()).add(f'#include "{header}"')
    return uses


def _circles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(n: str) -> None:
        index[n] = low[n] = len(index)
        stack.append(n)
        for b in sorted(b for a, b in edges if a == n):
            if b not in index:
                visit(b)
                low[n] = min(low[n], low[b])
            elif b in stack:
                low[n] = min(low[n], index[b])
        if low[n] == index[n]:
            component = [stack.pop()]
            while component[-1] != n:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for n in sorted({n for edge in edges for n in edge}):
        if n not in index:
            visit(n)
    return sorted(found)


def cache_layer_problems(root: Path = SRC / "cache",
                         layers: list[tuple[str, frozenset[str]]] = CACHE_LAYERS) -> list[str]:
    """Files in no layer; each use of a higher layer (`file (layer) -> file (layer): what`); each circle within a
    layer (`circle in layer: files`), between its .c files (a header item used is seen through to what it uses)."""
    rank = {name: r for r, (_, names) in enumerate(layers) for name in names}
    problems = [f"{p.name}: in no layer of CACHE_LAYERS" for p in sorted(root.iterdir())
                if p.suffix in (".c", ".h") and p.name not in rank]
    cache = _Cache(root)
    for (a, b), what in sorted(_uses(cache).items()):
        if a in rank and b in rank and rank[b] > rank[a]:
            problems.append(f"{a} ({layers[rank[a]][0]}) -> {b} ({layers[rank[b]][0]}): {', '.join(sorted(what))}")
    level = {(a, b) for a in cache.code if a.endswith(".c") and a in rank
             for b in cache.sources_used(a) if rank.get(b) == rank[a]}
    for circle in _circles(level):
        problems.append(f"circle in {layers[rank[circle[0]]][0]}: {', '.join(circle)}")
    return problems


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


def test_the_cache_checker_finds_uses_up_and_circles(tmp_path: Path) -> None:
    layers = [("low", frozenset({"low.h", "a.c", "b.c", "c.c"})), ("high", frozenset({"high.h", "top.c"}))]
    (tmp_path / "low.h").write_text("extern int g_low;\n#define LOW_LIMIT (g_low + 1)\nint cache_a(void);\n"
                                    "static inline int cache_b_twice(void) { return 2 * cache_b(); }\n")
    (tmp_path / "high.h").write_text('#include "low.h"\nextern int g_high;\n#define HIGH_LIMIT (g_high * 2)\n')
    (tmp_path / "a.c").write_text('#include "low.h"\nint g_low = 1;\n'
                                  "int cache_a(void) {\n    return cache_b_twice(); /* cache_top() */\n}\n")
    (tmp_path / "b.c").write_text('#include "low.h"\nint cache_b(void) {\n    return LOW_LIMIT + cache_c();\n}\n')
    (tmp_path / "c.c").write_text('#include "high.h"\nstatic int cache_c_alone(void) { return g_high; }\n'
                                  "int cache_c(void) {\n    return cache_a() + cache_c_alone() + cache_top() +\n"
                                  '        HIGH_LIMIT + sizeof "cache_x()";\n}\n')
    (tmp_path / "top.c").write_text('#include "high.h"\nint g_high = 2;\n'
                                    "int cache_top(void) {\n    return cache_a() + HIGH_LIMIT + LOW_LIMIT;\n}\n")
    (tmp_path / "stray.c").write_text("int cache_x(void) {\n    return 0;\n}\n")
    assert cache_layer_problems(tmp_path, layers) == [
        "stray.c: in no layer of CACHE_LAYERS",
        'c.c (low) -> high.h (high): #include "high.h", HIGH_LIMIT',  # a higher layer's header, and its macro;
        "c.c (low) -> top.c (high): cache_top, g_high",  # its function, and its global (read in a static function)
        "circle in low: a.c, b.c, c.c",  # a -> b (low.h's inline), b -> a (LOW_LIMIT reads g_low), b -> c -> a
    ]


def test_the_cache_layers_point_one_way_without_a_circle() -> None:
    uses = cache_uses()
    # the walk sees calls, globals, a header's macros and the includes (else an empty answer would prove nothing)
    assert "cache_make_plan" in uses[("materialize.c", "plan.c")] and "g_cfg" in uses[("plan.c", "config.c")]
    assert "STAGE_KEEP" in uses[("readahead.c", "io.h")] and ("tiers.h", "io.h") in uses
    assert cache_layer_problems() == []
