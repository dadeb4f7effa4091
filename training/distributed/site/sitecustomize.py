"""Started by Python in every process of a job the launcher runs with a project (this directory is
last on the job's PYTHONPATH), before the script: where the process is a rank (RANK and
TMN_RUN_DIR set), the moment its script's init_process_group returns, in the same thread, it
starts what every workload of ours starts itself: the Flight Recorder trace served on request
(training.distributed.flight, a hang's report) and the measure of its waits in collectives
(training.distributed.waits, the straggler watch). Nothing of the script changes, nothing here
can stop it, and a sitecustomize of the interpreter's own (Debian's) still runs after this one.

torch.distributed's init_process_group is wrapped as the module is first imported (a finder on
sys.meta_path, removed once used), so that `dist.init_process_group` and `from torch.distributed
import init_process_group` both reach the wrapper."""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import os
import sys


def _after_init() -> None:
    try:
        from torch_multinode.training.distributed import flight, waits

        flight.start()
        waits.start()
    except Exception:  # a help for the launcher, never a reason for the script to fail
        pass


def _wrapped(module) -> None:
    original = module.init_process_group

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        result = original(*args, **kwargs)
        _after_init()
        return result

    module.init_process_group = init_process_group
    c10d = getattr(module, "distributed_c10d", None)
    if c10d is not None and getattr(c10d, "init_process_group", None) is original:
        c10d.init_process_group = init_process_group


class _Finder:
    """Finds nothing itself: wraps the loader of torch.distributed so that the module, once
    executed, gets the wrapper."""

    name = "torch.distributed"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module) -> None:
            execute(module)
            try:
                _wrapped(module)
            except Exception:
                pass

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _chain() -> None:
    """The next sitecustomize on the path, as Python would have run it without this one."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if os.environ.get("RANK") is not None and os.environ.get("TMN_RUN_DIR"):
    if "torch.distributed" in sys.modules:
        _wrapped(sys.modules["torch.distributed"])
    else:
        sys.meta_path.insert(0, _Finder())
_chain()
