"""The one exception type the project's CLIs turn into a single `Error: ...` line."""

import argparse
import math
import signal
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
# What an error line shows of a bad value: enough to recognise it, never a screenful.
SHOWN_CHARS = 80


class UserError(Exception):
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

    def lines(self) -> list[str]:
        """Every problem this error stands for, one `Error: ...` line each (one, unless a check
        that goes on after a problem gathered several)."""
        return [self.line()]


INTERRUPTED_EXIT = 128 + signal.SIGINT  # 130, Ctrl-C
TERMINATED_EXIT = 128 + signal.SIGTERM  # 143


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, a scheduler's stop), raised where Ctrl-C would be: the same clean stop."""


def _terminated(signum, frame):
    raise Terminated()


def stop_on_sigterm() -> None:
    """From here on SIGTERM stops this process the way Ctrl-C does, instead of at once (which
    would leave whatever it started on other machines running)."""
    signal.signal(signal.SIGTERM, _terminated)


def at_the_edge(run: Callable[[T], int], args: T) -> int:
    """A CLI's outermost call: a UserError becomes its one `Error: ...` line and exit code,
    Ctrl-C exits 130 with one line (SIGTERM, where stop_on_sigterm is on: 143); anything else is
    a bug and keeps its traceback."""
    try:
        return run(args)
    except UserError as exc:
        # printable: a newline in a path or name from the command line must not split the line
        for line in exc.lines():
            print(printable(line), file=sys.stderr)
        return exc.exit_code
    except Terminated:
        print("Terminated.", file=sys.stderr)
        return TERMINATED_EXIT
    except KeyboardInterrupt:
        print("Interrupted.", file=sys.stderr)
        return INTERRUPTED_EXIT


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are the one `Error: ... (try PROG --help)` line, exit 2,
    instead of the usage text and a second line."""

    def error(self, message: str):
        self.exit(2, UserError(printable(message), hint=f"{self.prog} --help").line() + "\n")


def whole_number(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least `minimum`. Every CLI checks its numbers
    this one way, so a bad one is argparse's one line: 'argument --x: 0 is below 1'."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown(text)} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value

    return parse


def positive_number(what: str = "number", zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number above 0 (float() alone takes 'nan' and 'inf', a
    limit that never comes), or 0 itself with `zero` (an "off"); `what` names it in the error
    ("number of seconds")."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{shown(text)} is not a {what}")
        if value == 0 and zero:
            return 0.0
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{shown(text)} must be above 0")
        return value

    return parse


def shown(value: object) -> str:
    """A value as an error line shows it: its repr, cut to SHOWN_CHARS."""
    try:
        text = repr(value)
    except ValueError:  # an int of more digits than Python converts to decimal
        return f"<{type(value).__name__} too long to show>"
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def printable(text: str) -> str:
    """Text from the user as an error line shows it: control characters (a newline) escaped,
    so the line stays one."""
    return text if text.isprintable() else repr(text)[1:-1]
