"""Where zipmoe's native build is: the CMake build directory, its programs and libraries.

``$ZIPMOE_BUILD_DIR``, else ``build/`` of the repository (tools/setup.sh builds there); the native library and
zipmoe's libllama are both in its ``bin/``.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
LLAMA_LIB_NAME = "libllama.so"
ZIPMOE_LIB_NAME = "libggml-zipmoe.so"  # the native library (pyzipmoe._native), which libllama links too


def build_dir() -> Path:
    """The CMake build directory: ``$ZIPMOE_BUILD_DIR``, else ``build/`` of the repository."""
    return Path(os.environ.get("ZIPMOE_BUILD_DIR", REPO_ROOT / "build"))


def bin_dir() -> Path:
    """Where the build puts zipmoe's llama.cpp programs and shared libraries."""
    return build_dir() / "bin"


def stock_bin_dir() -> Path:
    """Stock llama.cpp's programs and libraries, for comparisons: the same sdist built without zipmoe's patches
    (tools/dev/build_stock.sh); ``$ZIPMOE_STOCK_LLAMA_BIN``, else ``llama-stock/bin`` of the build directory."""
    return Path(os.environ.get("ZIPMOE_STOCK_LLAMA_BIN", build_dir() / "llama-stock" / "bin"))


def llama_lib_dir() -> Path | None:
    """The directory holding zipmoe's libllama.so (and its llama.cpp programs), or None if it was not built."""
    d = bin_dir()
    return d if (d / LLAMA_LIB_NAME).is_file() else None
