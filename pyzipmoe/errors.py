"""Errors that zipmoe reports to people, and the exit statuses of the `zipmoe` command: each error carries a
one-line message that says what to do, and the status the command exits with (EXIT_STATUSES, the one table)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_DIFFERENT = 1
EXIT_BAD_INPUT = 2
EXIT_OUT_OF_MEMORY = 3
EXIT_INTERRUPTED = 130

# The exit statuses of every subcommand: what `zipmoe --help`, each subcommand's --help and the README say.
EXIT_STATUSES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "success"),
    (EXIT_DIFFERENT, "verify found a difference: the file does not restore its source"),
    (EXIT_BAD_INPUT, "bad usage or input: an option, or a file or model that is missing, damaged or cannot be used "
                     "(one line on stderr says which)"),
    (EXIT_OUT_OF_MEMORY, "out of memory: the model's minimum no longer fitted in the memory available while it ran"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl+C)"),
)
PROGRAM_STATUS = ("run, serve and bench exit with the status of the llama.cpp program they run when it fails "
                  "(128 + N when a signal N killed it)")


def exit_status_text(width: int = 100) -> str:
    """The table of EXIT_STATUSES as the help texts print it, wrapped at `width` columns."""
    import textwrap

    code_width = max(len(str(code)) for code, _ in EXIT_STATUSES)
    rows = [textwrap.fill(meaning, width, initial_indent=f"  {code:>{code_width}}  ",
                          subsequent_indent=" " * (code_width + 4)) for code, meaning in EXIT_STATUSES]
    note = textwrap.fill(PROGRAM_STATUS + ".", width, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(["exit status:", *rows, note])


class ZipmoeError(Exception):
    """Base of every expected error; the CLI prints its message on one line and exits with `exit_code`."""

    exit_code = EXIT_BAD_INPUT


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

    exit_code = EXIT_OUT_OF_MEMORY
