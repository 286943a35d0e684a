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


def llama_lib_dir() -> Path | None:
    """The directory holding zipmoe's libllama.so (and its llama.cpp programs), or None if it was not built."""
    d = bin_dir()
    return d if (d / LLAMA_LIB_NAME).is_file() else None
