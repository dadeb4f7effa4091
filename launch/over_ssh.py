"""A job's run over SSH (OverSsh, launch.way's Way unless another is given): every node's SSH
session, the master's port claimed and the project sent before anything starts; torchrun on each
node, followed by the liveness and link watchers; the port released at the end.

Over SSH, one SSH session per node runs torchrun (c10d rendezvous on the master's compute IP).
Every process the job starts carries TMN_RUN_ID in its environment, so stopping a node means
killing exactly the processes with that marker, even ones torchrun started in new sessions. The
job is stopped everywhere as soon as one node fails, stops answering, or the user presses
Ctrl-C.

A network partition leaves every node answering over SSH while the ranks wait on each other:
every other node pings the master's compute IP every few seconds, and a node that cannot reach
it for --network-timeout seconds is declared lost and the job stopped. When the job fails for
any reason while a node's compute link is down, that node is the one named (launch.blame).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from torch_multinode.cluster.inventory import Host
from torch_multinode.launch import watch
from torch_multinode.launch.prepare import claim_port, release_port

if TYPE_CHECKING:
    from torch_multinode.launch.job import Launcher


class OverSsh:
    """The SSH way (Way): every node's session, the master's port claimed and the project sent
    before anything starts; torchrun on each node, followed by the liveness and link watchers;
    the port released at the end (unless the master is silent: its lock is then stale)."""

    queues = False  # nothing runs on the nodes before their commands
    announce = True

    def __init__(self, launcher: Launcher):
        self.launcher = launcher

    def prepare(self, envs: dict[str, dict[str, str]]) -> dict[str, str]:
        run = self.launcher
        master, nnodes = run.inventory.master, len(run.hosts)
        try:
            self._stage(master)
        except BaseException:
            run.close()
            raise
        return {h.name: run.command(h, master, nnodes, envs[h.name]) for h in run.hosts}

    def _stage(self, master: Host) -> None:
        """Everything before the first process starts: SSH to every node, the master's port,
        the project on every node, checked, and each node's image and directories."""
        run = self.launcher
        run.parallel(run.connect)
        # before the sync: a running job's code is never changed
        claim_port(
            run.remotes[master.name],
            master,
            run.spec.run_id,
            run.inventory.rendezvous_port,
            run.emit,
        )
        try:
            run.send_project()
        except BaseException:  # a refusal, or Ctrl-C while the project is sent: the port is free
            release_port(run.remote_for, master, run.spec.run_id, run.inventory.rendezvous_port)
            raise

    def watchers(self) -> list[threading.Thread]:
        run = self.launcher
        master = run.inventory.master
        watchers = [threading.Thread(target=watch.liveness, args=(run.job,), daemon=True)]
        watchers += [
            threading.Thread(target=watch.link, args=(run.job, h, master), daemon=True)
            for h in run.hosts[1:]
        ]
        return watchers

    def stopping(self) -> str:
        return "stopping the job on every node"

    def name_lost(self) -> None:
        return None  # the runners and the watchers have named them already

    def conclude(self, interrupted: bool) -> None:
        run = self.launcher
        master, port = run.inventory.master, run.inventory.rendezvous_port
        if interrupted or run.job.first_failure is not None:
            stopped = run.stop_everywhere(master)
            # a silent master: the next launch finds its lock stale
            silent = run.job.silent
            if not isinstance(stopped[master.name], float) and master.name not in silent:
                release_port(run.remote_for, master, run.spec.run_id, port)
        else:
            release_port(run.remote_for, master, run.spec.run_id, port)

    def broke(self) -> bool:
        return True  # the run concludes as any other: the port released, the job stopped first
