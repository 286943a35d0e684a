#!/usr/bin/env python3
"""How zipmoe's patches apply to a llama.cpp source tree: for each patch of the series, in order, whether it applies
cleanly, at an offset, with fuzz, or not, hunk by hunk, as GNU patch reports it.

    python3 tools/dev/patch_drift.py SRC                 report on a copy of the files the patches touch (SRC unchanged)
    python3 tools/dev/patch_drift.py --apply SRC         apply the series to SRC itself (what fetch_llama.sh does)
    python3 tools/dev/patch_drift.py SRC --results bench/results --label WORD --note TEXT
                                                         also write the dated result file (bench/results/README.md)
    python3 tools/dev/patch_drift.py --partial SRC       SRC holds only some of the files: the others are not measured

Each patch is applied after the ones before it, as the build applies them, with `patch -p1 --forward` and its
default fuzz. "clean": every hunk at the line it names; "offset": every hunk's context found as it is, at other
lines (the largest shift is shown); "fuzz": a hunk applied only after patch ignored up to N lines of its context
(read it: the code around the hook changed); "FAILS": a hunk did not apply (its place must be found by hand); a
file the patch names that SRC lacks is "missing" (with --partial: "not measured", and a patch none of whose files
SRC holds is left out). Exit status: 0 when every patch measured applies (clean, offset or fuzz), 1 when one does
not, 2 on bad arguments. docs/llama-integration.md, "Following llama.cpp", says how it is used.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PATCHES = REPO / "patches"

_FILE = re.compile(r"^patching file (\S+)")
_HUNK = re.compile(r"^Hunk #(\d+) (succeeded|FAILED|ignored) at (\d+)"
                   r"(?: with fuzz (\d+))?(?: \(offset (-?\d+) lines?\))?")
_MISSING = re.compile(r"^(?:can't find file to patch|No file to patch)")


@dataclasses.dataclass
class Hunk:
    file: str
    number: int          # within its file, from 1, as patch counts
    line: int            # the old line its header names
    status: str = "clean"  # clean, offset, fuzz, FAILED, ignored, missing, unmeasured
    at: int | None = None
    offset: int = 0
    fuzz: int = 0

    def describe(self) -> str:
        where = f"{self.file} hunk {self.number} (line {self.line})"
        if self.status == "clean":
            return f"{where}: clean"
        if self.status == "offset":
            return f"{where}: offset {self.offset:+d}"
        if self.status == "fuzz":
            return f"{where}: fuzz {self.fuzz}, offset {self.offset:+d}"
        if self.status == "missing":
            return f"{where}: file missing"
        if self.status == "unmeasured":
            return f"{where}: not measured (the file is not in SRC)"
        return f"{where}: {self.status}"


@dataclasses.dataclass
class PatchResult:
    name: str
    hunks: list[Hunk]

    @property
    def verdict(self) -> str:
        measured = [h for h in self.hunks if h.status != "unmeasured"]
        if not measured:
            return "not measured"
        states = {h.status for h in measured}
        failed = sum(h.status in ("FAILED", "ignored", "missing") for h in measured)
        if failed:
            what = "file missing" if states == {"missing"} else f"{failed} of {len(measured)} hunks do not apply"
            return f"FAILS ({what})"
        left = len(self.hunks) - len(measured)
        partly = f", {left} hunk{'s' if left != 1 else ''} not measured" if left else ""
        if "fuzz" in states:
            return f"fuzz (up to {max(h.fuzz for h in measured)}{partly})"
        if "offset" in states:
            return f"offset (up to {max(abs(h.offset) for h in measured)} lines{partly})"
        return f"clean{' (' + partly[2:] + ')' if partly else ''}"

    @property
    def applies(self) -> bool:
        return not self.verdict.startswith("FAILS")


def hunks_of(patch: Path) -> list[Hunk]:
    """The hunks a patch holds, per file, in the order patch applies them."""
    hunks: list[Hunk] = []
    current, count = "", 0
    for line in patch.read_text(errors="replace").splitlines():
        if line.startswith("+++ "):
            current = line[4:].split("\t")[0].strip()
            current = current[2:] if current.startswith("b/") else current
            count = 0
        elif line.startswith("@@ ") and current:
            count += 1
            old = line.split()[1]  # -L[,N]
            hunks.append(Hunk(current, count, int(old[1:].split(",")[0])))
    return hunks


def _changes(patch: Path) -> dict[str, tuple[list[str], list[str]]]:
    """Per file, the lines a patch adds and the lines it removes (their text, without the +/-)."""
    out: dict[str, tuple[list[str], list[str]]] = {}
    current = ""
    in_hunk = False
    for line in patch.read_text(errors="replace").splitlines():
        if line.startswith("+++ "):
            current = line[4:].split("\t")[0].strip().removeprefix("b/")
            out.setdefault(current, ([], []))
            in_hunk = False
        elif line.startswith("@@ ") and current:
            in_hunk = True
        elif in_hunk and line.startswith("+"):
            out[current][0].append(line[1:])
        elif in_hunk and line.startswith("-") and not line.startswith("--- "):
            out[current][1].append(line[1:])
        elif in_hunk and not line.startswith((" ", "\\")) and line:
            in_hunk = False  # the text after a hunk (never inside one in a unified diff)
    return out


def added_lines(patches: list[Path]) -> dict[str, int]:
    """Lines the series adds to each upstream file (the size of what a llama.cpp bump must carry)."""
    added: dict[str, int] = {}
    for p in patches:
        for f, (plus, _) in _changes(p).items():
            added[f] = added.get(f, 0) + len(plus)
    return added


def rewrites(patches: list[Path]) -> list[str]:
    """`later patch: file: line` for each line a patch removes that an earlier patch of the series added: a stack of
    patches that rewrite each other must be merged by hand at every bump, hooks that only add do not."""
    found, earlier = [], {}
    for p in patches:
        changes = _changes(p)
        for f, (_, minus) in changes.items():
            ours = set(earlier.get(f, ())) & set(minus)
            found += [f"{p.name}: {f}: {line.strip()}" for line in sorted(ours) if line.strip()]
        for f, (plus, _) in changes.items():
            earlier.setdefault(f, []).extend(plus)
    return found


def touched_files(patches: list[Path]) -> list[str]:
    return sorted({h.file for p in patches for h in hunks_of(p)})


def apply_one(tree: Path, patch: Path, partial: bool = False) -> PatchResult:
    """Applies one patch to tree (in place) and reads patch's report of each hunk."""
    hunks = hunks_of(patch)
    run = subprocess.run(["patch", "-d", str(tree), "-p1", "--forward", "--batch", "--verbose",
                          "--no-backup-if-mismatch", "--reject-file=-"],
                         stdin=patch.open("rb"), capture_output=True, text=True, errors="replace")
    by_key = {(h.file, h.number): h for h in hunks}
    current = ""
    for line in (run.stdout + run.stderr).splitlines():
        if m := _FILE.match(line):
            current = m.group(1)
        elif _MISSING.match(line):
            current = ""
        elif (m := _HUNK.match(line)) and current:
            h = by_key.get((current, int(m.group(1))))
            if h is None:
                continue
            h.at, h.fuzz, h.offset = int(m.group(3)), int(m.group(4) or 0), int(m.group(5) or 0)
            if m.group(2) != "succeeded":
                h.status = m.group(2)
            elif h.fuzz:
                h.status = "fuzz"
            elif h.offset:
                h.status = "offset"
    for h in hunks:
        if not (tree / h.file).is_file() and h.at is None:
            h.status = "unmeasured" if partial else "missing"
    if run.returncode != 0 and not partial and all(h.status in ("clean", "offset", "fuzz") for h in hunks):
        # patch failed without naming a hunk (a malformed patch): say so rather than report it as applying
        for h in hunks:
            h.status = "FAILED"
    return PatchResult(patch.name, hunks)


def apply_series(tree: Path, patches: list[Path], partial: bool = False) -> list[PatchResult]:
    return [apply_one(tree, p, partial) for p in patches]


def check(src: Path, patches: list[Path], partial: bool = False) -> list[PatchResult]:
    """The series applied to a copy of the files it touches (src is left as it is)."""
    with tempfile.TemporaryDirectory(prefix="zipmoe-drift-") as tmp:
        for f in touched_files(patches):
            if (src / f).is_file():
                (Path(tmp) / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src / f, Path(tmp) / f)
        return apply_series(Path(tmp), patches, partial)


def report(results: list[PatchResult]) -> str:
    lines = []
    for r in results:
        lines.append(f"{r.name}: {r.verdict}")
        lines += [f"    {h.describe()}" for h in r.hunks if h.status not in ("clean", "unmeasured")]
    measured = [r for r in results if r.verdict != "not measured"]
    lines.append(f"{sum(r.applies for r in measured)} of {len(measured)} patches apply"
                 f" ({sum(r.verdict == 'clean' for r in measured)} clean)"
                 + (f"; {len(results) - len(measured)} not measured" if len(measured) < len(results) else ""))
    return "\n".join(lines) + "\n"


def size_line(patches: list[Path]) -> str:
    """What the series carries into upstream files: its added lines, the most in one file, and any line of one patch
    that another rewrites (docs/llama-integration.md holds it to limits)."""
    added = added_lines(patches)
    top = max(added, key=lambda f: added[f], default="")
    again = rewrites(patches)
    return (f"the series adds {sum(added.values())} lines to {len(added)} upstream files"
            + (f" (the most, {added[top]}, to {top})" if top else "")
            + (f"; {len(again)} lines of a patch rewritten by a later one" if again else "") + "\n")


def write_results(out_dir: Path, label: str | None, table: str, notes: list[str]) -> Path:
    """The dated result file, named and headed as the benchmarks' are (tools/bench/results.py)."""
    sys.path.insert(0, str(REPO / "tools" / "bench"))
    import results  # noqa: PLC0415 - tools/bench is not a package

    day = datetime.date.today()
    base = results.file_name("patch-drift", label, day)
    path, n = out_dir / base, 1
    while path.exists():
        n += 1
        path = out_dir / base.replace(".md", f"-{n}.md")
    argv = [a if not (i and sys.argv[i - 1] == "--note") else "..." for i, a in enumerate(sys.argv)]
    text = [f"# patch drift{' (' + label + ')' if label else ''}, {day.isoformat()}", "",
            f"- command: `{results.command_line(argv)}` (each --note is a line below)",
            f"- code: {results.commit()}",
            *[f"- {note}" for note in notes],
            "", "```text", table.rstrip("\n"), "```", ""]
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(text))
    print(f"wrote {path}", file=sys.stderr)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="a llama.cpp source tree (its root: src/, common/, tools/)")
    parser.add_argument("--apply", action="store_true", help="apply the series to SRC itself")
    parser.add_argument("--partial", action="store_true",
                        help="SRC holds only some of the files the patches touch: leave the others unmeasured")
    parser.add_argument("--patches", type=Path, default=PATCHES, metavar="DIR", help="default: patches/")
    parser.add_argument("--results", type=Path, metavar="DIR", help="also write DIR/YYYY-MM-DD-patch-drift[-LABEL].md")
    parser.add_argument("--label", metavar="WORD", help="a word for the result file's name")
    parser.add_argument("--note", action="append", default=[], metavar="TEXT",
                        help="a line for the result file (where SRC came from); repeatable")
    args = parser.parse_args(argv)
    patches = sorted(args.patches.glob("*.patch"))
    if not args.src.is_dir() or not patches:
        print(f"patch_drift.py: error: {args.src} is not a directory or {args.patches} has no patches",
              file=sys.stderr)
        return 2
    results = apply_series(args.src, patches, args.partial) if args.apply else check(args.src, patches, args.partial)
    table = report(results) + size_line(patches)
    sys.stdout.write(table)
    if args.results:
        write_results(args.results, args.label, table, args.note)
    return 0 if all(r.applies or r.verdict == "not measured" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
