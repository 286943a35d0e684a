"""tools/dev/patch_drift.py: what it says of each patch of a series applied to a tree (GNU patch's own report), on a
tiny tree and series made here."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_tool

drift = load_tool("dev/patch_drift.py")

LINES = [f"line {i}" for i in range(1, 41)]

# 0001 changes line 20; 0002's context includes the line 0001 adds, so it applies only after it
FIRST = """the first patch: why it is there.

--- a/src/a.txt
+++ b/src/a.txt
@@ -17,7 +17,7 @@
 line 17
 line 18
 line 19
-line 20
+line twenty
 line 21
 line 22
 line 23
"""
SECOND = """the second patch.

--- a/src/a.txt
+++ b/src/a.txt
@@ -19,5 +19,6 @@
 line 19
 line twenty
+line twenty and a half
 line 21
 line 22
 line 23
"""


def _tree(root: Path, lines: list[str] | None) -> Path:
    (root / "src").mkdir(parents=True)
    if lines is not None:
        (root / "src" / "a.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture
def series(tmp_path: Path) -> list[Path]:
    out = tmp_path / "patches"
    out.mkdir()
    (out / "0001-first.patch").write_text(FIRST)
    (out / "0002-second.patch").write_text(SECOND)
    return sorted(out.glob("*.patch"))


def _verdicts(src: Path, series: list[Path], partial: bool = False) -> list[str]:
    return [r.verdict for r in drift.check(src, series, partial)]


def test_the_series_applies_in_order_and_the_source_is_left_alone(tmp_path: Path, series: list[Path]) -> None:
    src = _tree(tmp_path / "src-tree", LINES)
    assert _verdicts(src, series) == ["clean", "clean"]
    assert (src / "src" / "a.txt").read_text() == "\n".join(LINES) + "\n"  # a copy was patched
    assert drift.main([str(src), "--patches", str(series[0].parent)]) == 0


def test_moved_context_is_an_offset(tmp_path: Path, series: list[Path]) -> None:
    src = _tree(tmp_path / "t", ["new"] * 5 + LINES)
    results = drift.check(src, series)
    assert [r.verdict for r in results] == ["offset (up to 5 lines)"] * 2
    assert results[0].hunks[0].offset == 5 and results[0].hunks[0].at == 22


def test_a_changed_edge_of_the_context_is_fuzz(tmp_path: Path, series: list[Path]) -> None:
    src = _tree(tmp_path / "t", [("line 17 changed" if x == "line 17" else x) for x in LINES])
    assert _verdicts(src, series)[0] == "fuzz (up to 1)"


def test_a_changed_line_fails_and_so_does_what_depends_on_it(tmp_path: Path, series: list[Path]) -> None:
    src = _tree(tmp_path / "t", [("line 20 changed" if x == "line 20" else x) for x in LINES])
    assert _verdicts(src, series) == ["FAILS (1 of 1 hunks do not apply)"] * 2
    assert drift.main([str(src), "--patches", str(series[0].parent)]) == 1
    assert not list((src / "src").glob("*.rej")) and not list((src / "src").glob("*.orig"))


def test_a_missing_file_fails_unless_the_tree_is_partial(tmp_path: Path, series: list[Path]) -> None:
    src = _tree(tmp_path / "t", None)
    assert _verdicts(src, series) == ["FAILS (file missing)"] * 2
    assert _verdicts(src, series, partial=True) == ["not measured"] * 2
    assert drift.main(["--partial", str(src), "--patches", str(series[0].parent)]) == 0


def test_apply_patches_the_tree_itself(tmp_path: Path, series: list[Path]) -> None:
    src = _tree(tmp_path / "t", LINES)
    assert drift.main(["--apply", str(src), "--patches", str(series[0].parent)]) == 0
    text = (src / "src" / "a.txt").read_text()
    assert "line twenty\nline twenty and a half\nline 21\n" in text and "line 20\n" not in text


def test_the_result_file_is_dated_and_says_where_the_tree_came_from(tmp_path: Path, series: list[Path]) -> None:
    src = _tree(tmp_path / "t", LINES)
    out = tmp_path / "results"
    assert drift.main([str(src), "--patches", str(series[0].parent), "--results", str(out), "--label", "x",
                       "--note", "SRC: a tree made by the test"]) == 0
    (written,) = out.glob("*-patch-drift-x.md")
    text = written.read_text()
    assert "- SRC: a tree made by the test" in text and "0001-first.patch: clean" in text
    assert "2 of 2 patches apply (2 clean)" in text


# A patch that removes the line FIRST added: the stack that a bump must merge by hand
REWRITE = """the third patch.

--- a/src/a.txt
+++ b/src/a.txt
@@ -18,5 +18,5 @@
 line 18
 line 19
-line twenty
+line 20 again
 line 21
 line 22
"""


def test_added_lines_and_rewrites_are_counted_per_file(tmp_path: Path, series: list[Path]) -> None:
    third = tmp_path / "0003-third.patch"
    third.write_text(REWRITE)
    assert drift.added_lines(series) == {"src/a.txt": 2}
    assert drift.rewrites(series) == []  # SECOND keeps FIRST's line as context
    assert drift.rewrites([*series, third]) == ["0003-third.patch: src/a.txt: line twenty"]
    assert drift.rewrites([third, *series]) == []  # (only an earlier patch's lines count)
    assert drift.size_line([*series, third]) == ("the series adds 3 lines to 1 upstream files (the most, 3, to "
                                                 "src/a.txt); 1 lines of a patch rewritten by a later one\n")


def test_zipmoe_patches_are_thin_hooks() -> None:
    """The series a llama.cpp bump carries (docs/llama-integration.md): at most 350 added lines in all, at most 60 in
    llama.cpp's most changed file, and no patch rewriting what another added."""
    patches = sorted(drift.PATCHES.glob("*.patch"))
    added = drift.added_lines(patches)
    assert sum(added.values()) <= 350, added
    assert added.get("src/llama-model-loader.cpp", 0) <= 60, added
    assert drift.rewrites(patches) == []
