"""`import llama_cpp` without importing pyzipmoe first (pyzipmoe/llama_import.py): in the venv tools/setup.sh made,
it opens zipmoe's libllama from build/bin; where none is built, one line says what to do. Each case runs in a fresh
interpreter, as a user's script would."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from helpers import unavailable

from pyzipmoe import llama_import
from pyzipmoe.paths import bin_dir

CHECK = """
import os, sys
lazy = "pyzipmoe" not in sys.modules and "LLAMA_CPP_LIB_PATH" not in os.environ
{site}
import llama_cpp
print(lazy, llama_cpp.llama_cpp._lib._name)
"""


def python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("LLAMA_CPP_LIB_PATH", "ZIPMOE_BUILD_DIR")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120, cwd="/")


def test_the_pth_file_points_llama_cpp_at_zipmoe_s_library_when_it_is_first_imported(llama_lib_dir: Path,
                                                                                    tmp_path: Path) -> None:
    llama_import.write_pth(tmp_path)
    done = python(CHECK.format(site=f"import site; site.addsitedir({str(tmp_path)!r})"))
    assert done.returncode == 0, done.stderr
    lazy, lib = done.stdout.split()
    assert lazy == "True"  # nothing happens at start: neither pyzipmoe imported nor the variable set
    assert Path(lib).resolve() == (bin_dir() / "libllama.so").resolve()


def test_without_a_built_library_one_line_says_what_to_do(tmp_path: Path) -> None:
    llama_import.write_pth(tmp_path)
    done = python(f"import site; site.addsitedir({str(tmp_path)!r})\nimport llama_cpp",
                  ZIPMOE_BUILD_DIR=str(tmp_path / "nowhere"))
    if "No module named 'llama_cpp'" in done.stderr:
        unavailable("llama-cpp-python is not installed (`bash tools/setup.sh` installs it)")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: zipmoe: ") and "tools/setup.sh" in last and str(tmp_path / "nowhere") in last
    assert "FileNotFoundError" not in done.stderr
    done = python(f"import site; site.addsitedir({str(tmp_path)!r})\nimport llama_cpp",
                  LLAMA_CPP_LIB_PATH=str(tmp_path))
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and "LLAMA_CPP_LIB_PATH" in last and "holds no libllama.so" in last, done.stderr


def test_the_venv_that_setup_made_imports_llama_cpp_on_its_own(llama_lib_dir: Path) -> None:
    """The old venv: `import llama_cpp` ended in FileNotFoundError (no libllama found) unless pyzipmoe came first."""
    if sys.prefix == sys.base_prefix:
        unavailable("not running in a venv (tools/setup.sh makes .venv)")
    pth = Path(sysconfig.get_paths()["purelib"]) / llama_import.PTH_NAME
    if not pth.is_file():
        unavailable(f"{pth} is missing: this venv predates it (`bash tools/setup.sh` writes it)")
    assert pth.read_text() == llama_import.pth_line()
    done = python(CHECK.format(site=""))
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.split()[1]).resolve() == (bin_dir() / "libllama.so").resolve()
