"""llama-cpp-python on zipmoe's libllama: the import (pointed at the build's library), which libllama it opened
and whether that one is zipmoe's, llama.cpp's log (its errors kept for the exceptions' messages), and the errors a
load or a decode raises.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any

from ..errors import NativeLibraryError, ZipmoeError
from ..paths import ZIPMOE_LIB_NAME, bin_dir, llama_lib_dir
from .config import use_zipmoe_llama


class ZipmoeLoadError(ZipmoeError, ValueError):
    """A model could not be loaded (llama-cpp-python raises ValueError there, so this is one too)."""


class ZipmoeDecodeError(ZipmoeError, RuntimeError):
    """llama_decode failed on a zipmoe model, typically a damaged expert (llama-cpp-python raises RuntimeError)."""


def _import_llama_cpp() -> Any:
    use_zipmoe_llama()
    try:
        import llama_cpp
    except ModuleNotFoundError as e:
        if e.name != "llama_cpp":
            raise
        raise NativeLibraryError("llama-cpp-python is not installed; `bash tools/setup.sh` installs it "
                                 "(its Python part, which runs zipmoe's libllama)") from None
    except (FileNotFoundError, OSError, RuntimeError) as e:  # libllama missing or not loadable
        where = os.environ.get("LLAMA_CPP_LIB_PATH") or "llama_cpp/lib"
        raise NativeLibraryError(f"llama-cpp-python cannot load libllama from {where} ({e}); build zipmoe's "
                                 f"llama.cpp with `bash tools/setup.sh` (it goes to {bin_dir()}) or "
                                 "point LLAMA_CPP_LIB_PATH at it") from None
    return llama_cpp


llama_cpp = _import_llama_cpp()


# ------------------------------------------------------------------------------------------ the library


def loaded_library() -> Path:
    """The libllama that llama-cpp-python opened in this process."""
    return Path(llama_cpp.llama_cpp._lib._name).resolve()


def _elf_needed(path: Path) -> list[str]:
    """DT_NEEDED entries of a 64-bit little-endian ELF shared library ([] if it is something else)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed = []
    for _name, sh_type, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if sh_type != 6 or not entsize:  # SHT_DYNAMIC
            continue
        strtab = sections[link][4]
        for pos in range(offset, offset + size, entsize):
            tag, val = struct.unpack_from("<qQ", data, pos)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strtab + val)
                needed.append(data[strtab + val:end].decode())
    return needed


def library_supports_zipmoe(path: Path | None = None) -> bool:
    """Whether a libllama (default: the loaded one) is zipmoe's build: it links libggml-zipmoe, or it is the
    library of this checkout's build."""
    path = Path(path).resolve() if path is not None else loaded_library()
    ours = llama_lib_dir()
    if ours is not None and path.parent == ours.resolve():
        return True
    try:
        return ZIPMOE_LIB_NAME in _elf_needed(path)
    except (OSError, ValueError, struct.error, IndexError):
        return False



# -------------------------------------------------------------------------------- llama.cpp's error log


class _ErrorLog:
    """llama.cpp's log callback: prints as llama-cpp-python means to, and remembers recent error messages.

    llama-cpp-python 0.3.36's own callback maps an older ggml enum, so with verbose=False it prints llama.cpp's
    warnings and hides its errors; this one maps this llama.cpp's levels (ggml.h: NONE 0, DEBUG 1, INFO 2, WARN 3,
    ERROR 4, CONT 5), still honouring llama-cpp-python's verbose switch (its logger's level). Errors are also
    kept, so that exceptions can say what llama.cpp said. `quiet` stops all printing (the zipmoe command, whose
    errors are one line).
    """

    GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT = 4, 5
    LEVELS = (logging.CRITICAL, logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR)  # by ggml level

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lines: deque[tuple[int, str]] = deque(maxlen=64)  # (serial number, text)
        self.serial = 0
        self.last_level = 0
        self.quiet = False
        self.logger = logging.getLogger("llama-cpp-python")  # set_verbose() sets its level
        self.callback = llama_cpp.llama_log_callback(self._log)  # kept alive by self
        llama_cpp.llama_log_set(self.callback, ctypes.c_void_p(0))

    def _log(self, level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        if level != self.GGML_LOG_LEVEL_CONT:
            self.last_level = level
        msg = text.decode("utf-8", "replace")
        if self.last_level == self.GGML_LOG_LEVEL_ERROR:
            with self.lock:
                self.serial += 1
                self.lines.append((self.serial, msg))
        if not self.quiet and self.logger.level <= (self.LEVELS[self.last_level] if 0 <= self.last_level < 5
                                                            else logging.DEBUG):
            print(msg, end="", flush=True, file=sys.stderr)

    def mark(self) -> int:
        with self.lock:
            return self.serial

    def since(self, mark: int) -> str:
        """The error text logged after mark(), on one line."""
        with self.lock:
            text = "".join(t for serial, t in self.lines if serial > mark)
        return " ".join(text.split())


error_log = _ErrorLog()


def quiet_llama_log(quiet: bool = True) -> None:
    """Stop (or resume) printing llama.cpp's log; errors still reach the exceptions' messages."""
    error_log.quiet = quiet
