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
