"""What a benchmark's main() prints for a failure that is the user's to fix: one line, not a traceback.

bench_budget and bench_e2e run their measurements inside `one_line_errors`; it sits beside them, as results.py does.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def one_line_errors(prog: str, *expected: type[BaseException]) -> Iterator[None]:
    """Turns an `expected` error, or one of pyzipmoe's own (ZipmoeError and friends), into `PROG: error: ...` on
    stderr and exit status 1 (SystemExit); any other error is a bug and keeps its traceback."""
    try:
        yield
    except Exception as e:
        if not isinstance(e, expected) and not type(e).__module__.startswith("pyzipmoe"):
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
