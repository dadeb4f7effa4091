"""torchrun for a job on this machine alone, ending the way a job on the nodes ends: when a
worker fails, no ChildFailedError traceback and report of torchrun's own, but one line naming
the rank that failed first and its exit code, and that exit code as this process's. The
launcher then prints the same summary as for a job on the nodes (launch.local).

    python -m training.local_launch --standalone --nproc-per-node=2 -m training.ddp ...

Takes exactly torchrun's arguments (torch.distributed.run's own parser).
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

# What a worker killed by a signal (exit code -N) makes of the whole job: the shell's 128 + N.
SIGNAL_BASE = 128


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        code = failure.exitcode if failure.exitcode >= 0 else SIGNAL_BASE - failure.exitcode
        how = f"exit {failure.exitcode}" if failure.exitcode >= 0 else failure.signal_name()
        print(f"[torchrun] rank {rank} failed first ({how})", file=sys.stderr, flush=True)
        return code or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
