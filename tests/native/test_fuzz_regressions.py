"""The fuzz harnesses (ggml_zipmoe/fuzz) replayed without libFuzzer, in whatever build runs the tests.

* tests/fuzz_regressions/{chunk,index}: inputs that once crashed a fuzz target, or hand-made hostile inputs
  (stream sizes past the chunk, absurd sizes, overlapping regions, incomplete code tables, zstd frames that
  claim more than the chunk): each must run to completion.
* the seed corpus, generated from the test models (tools/dev/make_corpus.py), and seeded random
  mutations of it (bytes flipped, changed, cut): a small, deterministic fuzz run that needs no clang.

Run against the sanitizer build (ZIPMOE_BUILD_DIR=build-asan, see .ci/run and SECURITY.md) any out-of-bounds
access or undefined behaviour is fatal; in the plain build a crash still fails the test.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, unavailable

import pyzipmoe

REGRESSIONS = REPO / "tests" / "fuzz_regressions"
TARGETS = ("chunk", "index")
N_MUTANTS = int(os.environ.get("ZIPMOE_FUZZ_MUTANTS", "1500"))  # per target


def _replay_binary(target: str) -> Path:
    path = pyzipmoe.build_dir() / "bin" / f"zipmoe-fuzz-{target}"
    if not path.is_file():
        unavailable(f"{path} was not built (cmake --build build)")
    return path


def _replay(target: str, *inputs: Path) -> str:
    done = subprocess.run([str(_replay_binary(target)), *map(str, inputs)], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=1",
                                                UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"))
    assert done.returncode == 0, f"zipmoe-fuzz-{target} failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    subprocess.run([sys.executable, str(REPO / "tools" / "dev" / "make_corpus.py"), str(out)], check=True,
                   capture_output=True, timeout=300)
    return out


@pytest.mark.parametrize("target", TARGETS)
def test_regression_inputs(target: str) -> None:
    inputs = sorted((REGRESSIONS / target).iterdir())
    assert inputs
    assert f"{len(inputs)} inputs ran" in _replay(target, REGRESSIONS / target)


@pytest.mark.parametrize("target", TARGETS)
def test_seed_corpus(target: str, corpus: Path) -> None:
    n = len(list((corpus / target).iterdir()))
    assert n >= 20
    assert f"{n} inputs ran" in _replay(target, corpus / target)


@pytest.mark.parametrize("target", TARGETS)
def test_mutated_seeds(target: str, corpus: Path, tmp_path: Path) -> None:
    seeds = sorted((corpus / target).iterdir())
    rng = random.Random(20 + TARGETS.index(target))
    for i in range(N_MUTANTS):
        data = bytearray(rng.choice(seeds).read_bytes())
        for _ in range(rng.randrange(1, 6)):
            roll = rng.random()
            at = rng.randrange(len(data))
            if roll < 0.5:
                data[at] ^= 1 << rng.randrange(8)
            elif roll < 0.8:
                data[at] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))
            elif roll < 0.9:
                del data[at:]
                if not data:
                    data = bytearray(b"\x00")
            else:  # a header field (sizes, counts) set to an extreme
                at = rng.randrange(min(len(data), 200) // 8) * 8 if target == "index" else rng.randrange(1, 4)
                data[at:at + 8] = rng.choice((b"\xff" * 8, b"\x00" * 8, (1 << 62).to_bytes(8, "little")))
        (tmp_path / f"m{i:05d}").write_bytes(bytes(data))
    assert f"{N_MUTANTS} inputs ran" in _replay(target, tmp_path)
