"""The one exception type the project's CLIs turn into a single `Error: ...` line, and
argparse's usage errors made into it: an argument named the way the user typed it (make's knob
and its flag, KNOBS), an unknown option with the one it is within a typo of, a hint that names
a command that runs here."""

import argparse
import difflib
import math
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
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


# The Makefile's knobs, by the flag each becomes (`make train NPROC=0` runs `train
# --nproc-per-node 0`): an error about one of these flags names the knob too, the way a user of
# make typed it, then the flag, the way a user of the CLI did (`NPROC=0 (--nproc-per-node): 0 is
# below 1`). The one place the two meet: tests/launch/test_knob_errors.py holds the Makefile to
# it, both ways.
KNOBS = {
    "--inventory": "INVENTORY",
    "--group": "GROUP",
    "--nnodes": "NNODES",
    "--nodes": "NNODES",  # make sim-up
    "--link": "LINK",
    "--fresh": "FRESH",
    "--fingerprints": "FINGERPRINTS",
    "--disable-password-login": "NO_PASSWORD_LOGIN",
    "--ask-become-pass": "ANSIBLE_ARGS",  # ANSIBLE_ARGS=-K
    "--via": "VIA",
    "--gpus": "GPUS",
    "--nproc-per-node": "NPROC",
    "--restarts": "RESTARTS",
    "--min-nodes": "MIN_NODES",
    "--stall": "STALL",
    "--on-hang": "ON_HANG",
    "--allow-drift": "ALLOW_DRIFT",
    "--ft": "FT",  # make train and make netcheck
    "--debug": "DEBUG",
    "--script": "SCRIPT",
    "--module": "MODULE",
    "--workdir": "WORKDIR",
    "--requirements": "REQUIREMENTS",
    "--env": "ENV",
    "--run": "RUN",
    "--rerun": "RUN",
    "--json": "JSON",
    "--same-outputs": "SAME_OUTPUTS",
    "--tag": "IMAGE",  # make image
    "--kind": "KIND",
    "--base-image": "BASE_IMAGE",
}
# How close an unknown option must be to one of the parser's to be offered in its place
# (difflib's ratio, without the dashes): 'stesp' for 'steps' 0.8, 'bogus' for 'gpus' 0.67.
OPTION_CUTOFF = 0.75


def command(prog: str) -> str:
    """`prog` (an argparse prog: 'train', 'cluster check', 'python -m torch_multinode.sim.cli')
    as a command that runs here: the project's console scripts and its Python are in the
    virtual environment's bin directory, which need not be on PATH (`.venv/bin/train`, relative
    to this directory where it is below it). A prog that is neither is run with `python -m`,
    as this process was."""
    first, _, rest = prog.partition(" ")
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / first).is_file():
        module = getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None)
        if module is None:
            return prog
        first, rest = "python", " ".join(filter(None, ["-m", module.removesuffix(".__main__")]))
    path = str(bin_dir / first)
    relative = os.path.relpath(path)
    shown_path = relative if not relative.startswith("..") else path
    return f"{shown_path} {rest}".rstrip()


def _named(
    action: argparse.Action | None, fallback: str, value: str | None = None, knobs: bool = True
) -> str:
    """An argument as an error names it: `NPROC=0 (--nproc-per-node)` for a knob's flag (its
    value where known), `argument --rendezvous-timeout` for one make does not set."""
    options = list(getattr(action, "option_strings", None) or [])
    flag = next((o for o in options if o.startswith("--")), options[0] if options else fallback)
    knob = next((KNOBS[o] for o in options if o in KNOBS), None) if knobs else None
    if knob is None:
        return f"argument {flag}"
    return f"{knob}={value} ({flag})" if value is not None else f"{knob} ({flag})"


def _known_options(parser: argparse.ArgumentParser) -> list[str]:
    """Every long option a user may type to `parser` and its subcommands (test hooks, hidden
    from --help, are not offered)."""
    found: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += [o for o in _known_options(sub) if o not in found]
        elif action.help != argparse.SUPPRESS:
            found += [o for o in action.option_strings if o.startswith("--") and o not in found]
    return found


def did_you_mean(option: str, known: list[str]) -> str | None:
    """The option of `known` that `option` is within a typo of, or None."""
    names = {o.lstrip("-"): o for o in known}
    close = difflib.get_close_matches(option.lstrip("-"), names, n=1, cutoff=OPTION_CUTOFF)
    return names[close[0]] if close else None


def usage_error(
    parser: argparse.ArgumentParser,
    message: str,
    hint: str | None,
    refused: tuple[argparse.Action, list[str]] | None = None,
    knobs: bool = True,
) -> UserError:
    """argparse's `message` as the project's one line: an argument named as the user typed it
    (with `knobs`, a flag make sets by its knob and the flag), an unknown option with the
    option it is within a typo of (`unknown option --stesp (did you mean --steps?)`, which is
    then the fix), else `hint`. `refused`: the action whose value was refused and the words it
    was given. A workload's parser (training.settings.console) has no knobs: its options come
    from ARGS=, as typed."""
    unknown = re.fullmatch(r"unrecognized arguments: (.*)", message, re.S)
    if unknown:
        words = unknown.group(1).split(" ")
        options = [w.split("=", 1)[0] for w in words if w.startswith("-") and w.strip("-")]
        if options:
            known = _known_options(parser)
            said, suggested = [], False
            for option in options:
                close = did_you_mean(option, known)
                suggested = suggested or close is not None
                said.append(
                    f"unknown option {option}" + (f" (did you mean {close}?)" if close else "")
                )
            return UserError(printable("; ".join(said)), hint=None if suggested else hint)
    argument = re.match(r"argument (\S+): (.*)", message, re.S)
    if argument:
        flag, detail = argument.groups()
        actions = {o: a for a in parser._actions for o in a.option_strings}
        action = next((actions[o] for o in flag.split("/") if o in actions), None)
        value = None
        if refused is not None and action is not None and refused[0] is action:
            value = " ".join(refused[1]) if refused[1] else None
        detail = re.sub(
            r"argument (\S+)",
            lambda other: _named(
                next((actions[o] for o in other.group(1).split("/") if o in actions), None),
                other.group(1),
                knobs=knobs,
            ),
            detail,
        )
        message = f"{_named(action, flag, value, knobs)}: {detail}"
    return UserError(printable(message), hint=hint)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are the one `Error: ... (try .venv/bin/PROG --help)` line,
    exit 2, instead of the usage text and a second line; an argument is named the way the user
    typed it (usage_error)."""

    _refused: tuple[argparse.Action, list[str]] | None = None

    def _get_values(self, action, arg_strings):
        try:
            return super()._get_values(action, arg_strings)
        except argparse.ArgumentError:
            self._refused = (action, list(arg_strings))
            raise

    def error(self, message: str):
        hint = f"{command(self.prog)} --help"
        self.exit(2, usage_error(self, message, hint, self._refused).line() + "\n")


def whole_number(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least `minimum`. Every CLI checks its numbers
    this one way, so a bad one is one line: 'argument --x: 0 is below 1' (a knob's flag named
    as make has it: 'NPROC=0 (--nproc-per-node): 0 is below 1')."""

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
