"""The one exception type the project's CLIs turn into a single `Error: ...` line."""

import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class ClusterError(Exception):
    """A problem the user can fix. The message names what is wrong and, where known, the fix.

    `exit_code` lets a caller distinguish bad input (2) from a failed operation (1).
    """

    def __init__(self, message: str, *, hint: str | None = None, exit_code: int = 2):
        super().__init__(message)
        self.hint = hint
        self.exit_code = exit_code

    def line(self) -> str:
        text = f"Error: {self}"
        if self.hint:
            text += f" (try {self.hint})"
        return text


def at_the_edge(run: Callable[[T], int], args: T) -> int:
    """A CLI's outermost call: a ClusterError becomes its one `Error: ...` line and exit code,
    Ctrl-C exits 130 with one line; anything else is a bug and keeps its traceback."""
    try:
        return run(args)
    except ClusterError as exc:
        print(exc.line(), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("Interrupted.", file=sys.stderr)
        return 130
