"""Errors that zipmoe reports to people: each carries a one-line message that says what to do."""

from __future__ import annotations


class ZipmoeError(Exception):
    """Base of every expected error; the CLI prints its message on one line and exits with `exit_code`."""

    exit_code = 2


class FormatError(ZipmoeError):
    """A file is not what it claims to be: not a GGUF, truncated, inconsistent zipmoe metadata."""


class ChecksumError(FormatError):
    """Stored bytes do not match their recorded checksum: the file is corrupted."""


class UnsupportedError(ZipmoeError):
    """A valid input that zipmoe does not handle (yet), such as non-BF16 expert tensors."""


class NativeLibraryError(ZipmoeError):
    """The native library could not be found or loaded."""


class OutOfMemoryError(ZipmoeError):
    """The memory available fell below the model's minimum while it ran: the run stops cleanly, with this one line
    and exit status 3, instead of being killed by the kernel's OOM killer (pyzipmoe.runtime.controller)."""

    exit_code = 3
