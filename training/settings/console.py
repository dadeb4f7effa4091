"""The edge of every workload: printing on the right rank, and errors as one `Error:` line.

Torch-free: the argument checks the launcher runs on the controller use it (training.settings.arguments).
It imports nothing of training.distributed (only its types): a workload's run to its end, the
process group left either way, is training.distributed.parallel's (run, call).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from torch_multinode.cluster.errors import UserError, usage_error

if TYPE_CHECKING:
    from torch_multinode.training.distributed import parallel

BENCH_PREFIX = "BENCH "  # a `--bench` row of fsdp and fixtures.bench_scaling: this, then JSON


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are the project's one-line error, not usage-and-exit; an unknown
    option names the one it is within a typo of (`unknown option --stesp (did you mean
    --steps?)`)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(**kwargs)

    def error(self, message: str):
        raise usage_error(self, message, hint="--help", knobs=False)


def require_positive(args, *names: str) -> None:
    """Bad numbers as the project's error, before they become a ZeroDivisionError somewhere."""
    for name in names:
        value = getattr(args, name)
        if value <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {value}")


def emit(text: str, stream=None) -> None:
    """Write whole lines in one call: ranks share the terminal, and split writes interleave."""
    stream = stream or sys.stdout
    stream.write(text if text.endswith("\n") else text + "\n")
    stream.flush()


def say(env: parallel.DistEnv, *lines: str) -> None:
    """Print on rank 0 only: the lines every rank would print identically."""
    if env.is_main:
        emit("\n".join(lines))


def say_every_rank(env: parallel.DistEnv, line: str) -> None:
    emit((f"[rank {env.rank}] " if env.launched else "") + line)
