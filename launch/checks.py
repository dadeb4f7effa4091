"""What `train` checks on the controller before anything starts anywhere: the workload's own
arguments, and that a local job's module exists."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from torch_multinode.cluster.errors import UserError, command
from torch_multinode.launch.spec import DEFAULT_MODULE, runnable_module
from torch_multinode.training.settings import arguments


def workload_arguments(
    module: str,
    argv: list[str],
    world_size: int | None = None,
    workdir: Path | None = None,
) -> str | None:
    """A workload of this project checks its own arguments here, before any process starts
    anywhere: bad input is one error line and exit 2, not the same error from every rank
    followed by torchrun's report. (Its --help is printed here too.) The checks are the
    workloads' own, from training.settings.arguments, which imports no torch. A module it does not list
    (the user's, or one of training/ without checks there) checks its own on the nodes.

    With the job's `world_size` (every node's processes together), its batch is checked
    against it too: what the job's header says where a default batch was rounded to it, or
    None. A project (`workdir`) with its own module of that name checks its own."""
    if runnable_module(module, workdir) == module:  # not one of ours
        return None
    try:
        return arguments.check(module, _without_files_elsewhere(argv), world_size)
    except UserError as error:
        if error.hint == "--help":  # the workload's own --help, as the launcher prints it
            error.hint = f"{command('train')} --module {module} -- --help"
        raise


# Where a project's entry point usually is: the script a directory given as SCRIPT= means.
ENTRY_POINTS = ("train.py", "main.py")


def script_file(path: Path) -> None:
    """A SCRIPT= must be a file. A directory is said to be one, with the script inside it where
    there is an obvious one (train.py, main.py, or its only .py file)."""
    if path.is_dir():
        inside = _entry_point(path)
        raise UserError(
            f"script {path} is a directory",
            hint=f"SCRIPT={inside}" if inside is not None else "a .py file inside it",
        )
    if not path.is_file():
        raise UserError(f"script {path} does not exist", hint="a path to a .py file")


def _entry_point(directory: Path) -> Path | None:
    for name in ENTRY_POINTS:
        if (directory / name).is_file():
            return directory / name
    try:
        found = [f for f in directory.glob("*.py") if f.name != "__init__.py" and f.is_file()]
    except OSError:
        return None
    return found[0] if len(found) == 1 else None


def script_compiles(path: Path) -> None:
    """A SCRIPT= must be Python that compiles, before anything starts: otherwise every rank
    of every node prints the same SyntaxError and torchrun adds its report. Said as Python
    says it (`SyntaxError at line 3: expected ':'`); a file that is not a .py is also told
    what SCRIPT= wants."""
    not_python = None if path.suffix == ".py" else "SCRIPT=path/to/train.py, a Python file"
    try:
        source = path.read_bytes()
    except OSError as error:
        raise UserError(f"script {path} cannot be read: {error.strerror}") from None
    try:
        compile(source, str(path), "exec", dont_inherit=True)
    except SyntaxError as error:
        where = f" at line {error.lineno}" if error.lineno else ""
        raise UserError(
            f"script {path}: {type(error).__name__}{where}: {error.msg}", hint=not_python
        ) from None
    except ValueError as error:  # NUL bytes: a binary file
        raise UserError(
            f"script {path} is not Python: {error}", hint="SCRIPT=path/to/train.py, a Python file"
        ) from None


def _without_files_elsewhere(argv: list[str]) -> list[str]:
    """argv without a --config file that is not on this machine: it may be a path on the
    nodes (/shared/...), which the ranks read and check themselves."""
    kept: list[str] = []
    words = iter(argv)
    for word in words:
        if word == "--config":
            path = next(words, None)
            if path is not None and Path(path).is_file():
                kept += [word, path]
        elif word.startswith("--config="):
            if Path(word.split("=", 1)[1]).is_file():
                kept.append(word)
        else:
            kept.append(word)
    return kept


def importable_here(
    module: str, directory: Path | None = None, shown_as: str | None = None
) -> None:
    """A local job's module must exist before any process starts: otherwise every rank prints
    'No module named' and torchrun adds its own traceback. Finds it the way `python -m` in
    `directory` (the job's project root; default: this directory) would, importing its parent
    packages only."""
    sys.path.insert(0, str(directory) if directory is not None else os.getcwd())
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    finally:
        sys.path.pop(0)
    if found is None:
        raise UserError(
            f"--module {shown_as or module}: no module of that name here",
            hint=f"MODULE={DEFAULT_MODULE}, one of the workloads listed in "
            "training/__init__.py, or SCRIPT=path/to/train.py",
        )
