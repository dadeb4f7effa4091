"""Run a script written for `python -m torch.distributed.launch` unchanged under torchrun.

Such scripts parse `--local_rank` (or `--local-rank`) from their arguments and read nothing
from the environment. torchrun passes LOCAL_RANK only in the environment, and the deprecated
launcher only ever passes the dashed spelling, which an argparse that declared `--local_rank`
rejects. This shim passes the spelling the script declared:

    python -m training.legacy --flag=--local_rank path/to/script.py [script args...]
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m training.legacy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--flag", choices=("--local_rank", "--local-rank"), default="--local_rank")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        parser.error("LOCAL_RANK is not set: run this under torchrun")
    # torch.distributed.launch put the flag first, before the script's own arguments.
    sys.argv = [options.script, f"{options.flag}={local_rank}", *options.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(options.script)))
    runpy.run_path(options.script, run_name="__main__")


if __name__ == "__main__":
    main()
