"""An FT=1 job over SSH (Replicated, launch.way's Way): each node is one replica group
(training.distributed.replicas), run by its own torchrun; torchft's Manager replicates across
them, reporting to one lighthouse that the launcher runs on this machine (launch.lighthouse),
where no node's loss takes it down.

What changes against a job of one world (launch.over_ssh): every node claims its own rendezvous
port (its torchrun's); the nodes' links to a master are not watched (there is none); and one
node's end is not the job's (launch.groups): a group that dies or stops answering is reported
with the step it had reached, and the others go on at their next step as long as at least the
minimum of groups (MIN_NODES) is left. With RESTARTS, a lost group starts again within the job:
on a spare at once where the job has one, else on its own node once that answers; either way it
heals from a live peer. The job ends when every group still in it has ended, and succeeds when
those ended well. The lighthouse is stopped, and each node's port freed, whatever happens.
"""

from __future__ import annotations

import functools
import shlex
import threading
import time
from contextlib import ExitStack
from dataclasses import replace
from typing import TYPE_CHECKING

from torch_multinode.cluster import routes, sync
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.execution import Session, close_quietly
from torch_multinode.cluster.inventory import Host
from torch_multinode.cluster.jobenv import (
    LIGHTHOUSE_VARIABLE,
    REPLICA_ADDRESS_VARIABLE,
    REPLICA_GROUP_VARIABLE,
    REPLICA_GROUPS_VARIABLE,
    REPLICA_MIN_GROUPS_VARIABLE,
    REPLICA_START_WAIT_VARIABLE,
)
from torch_multinode.launch import lighthouse, stop, watch
from torch_multinode.launch.environment import node_settings
from torch_multinode.launch.groups import Groups
from torch_multinode.launch.over_ssh import OverSsh
from torch_multinode.launch.prepare import claim_port, prepare_nodes, release_port
from torch_multinode.launch.running import RunningJob
from torch_multinode.launch.spec import RESTART_POLL, RUN_LABEL

if TYPE_CHECKING:
    from torch_multinode.launch.job import Launcher

# How long the groups started together wait for each other before the first step: the ones in
# by then train it, a later one heals from them (training.distributed.replicas' gather).
START_WAIT = 120.0
# A node's Docker engine answers (a restarted node's starts a few seconds after its sshd).
ENGINE_ANSWERS = "docker version --format '{{.Server.Version}}' >/dev/null 2>&1"


def _remove_containers(run_id: str) -> str:
    label = shlex.quote(f"label={RUN_LABEL}={run_id}")
    return f"docker ps -aq --filter {label} | xargs -r docker rm -f >/dev/null 2>&1; true"


class Replicated(OverSsh):
    """The FT=1 way: the lighthouse on this machine, each node's own torchrun (its group), the
    nodes' liveness watched; at the end the lighthouse stopped, each node's port freed and a
    lost group's leftovers stopped where its node answers."""

    def __init__(self, launcher: Launcher):
        super().__init__(launcher)
        self._held = ExitStack()  # the lighthouse, while the job runs
        self._urls: dict[str, str] = {}  # the lighthouse as each node reaches it
        self._envs: dict[str, dict[str, str]] = {}  # each node's environment, as prepared

    def prepare(self, envs: dict[str, dict[str, str]]) -> dict[str, str]:
        run = self.launcher
        try:
            self._stage_all()
            try:
                self._urls = self._lighthouse(self._groups.min_groups)
            except BaseException:  # a refusal, or Ctrl-C while it starts: the ports are free
                self._held.close()
                self._release(list(run.hosts))
                raise
        except BaseException:
            run.close()
            raise
        self._envs = envs
        return {host.name: self._command(host, START_WAIT) for host in run.hosts}

    def _command(self, host: Host, start_wait: float) -> str:
        """Node `host`'s torchrun, alone in its world, with its replica group's environment."""
        run = self.launcher
        env = {
            **self._envs[host.name],
            LIGHTHOUSE_VARIABLE: self._urls[host.name],
            REPLICA_GROUP_VARIABLE: str(self._groups.names.index(host.name)),
            REPLICA_GROUPS_VARIABLE: str(len(self._groups.names)),
            REPLICA_MIN_GROUPS_VARIABLE: str(self._groups.min_groups),
            REPLICA_ADDRESS_VARIABLE: str(host.compute_ip),
            REPLICA_START_WAIT_VARIABLE: f"{start_wait:g}",
        }
        return run.command(host, host, 1, env)

    @property
    def _groups(self) -> Groups:
        groups = self.launcher.job.groups
        assert groups is not None  # the Launcher of an FT=1 job made them
        return groups

    def _stage_all(self) -> None:
        """SSH to every node, every node's rendezvous port (each runs its own torchrun), the
        project on every node, checked."""
        run = self.launcher
        run.parallel(run.connect)
        claimed: list[Host] = []
        try:
            for host in run.hosts:
                claim_port(
                    run.remotes[host.name],
                    host,
                    run.spec.run_id,
                    run.inventory.rendezvous_port,
                    run.emit,
                )
                claimed.append(host)
            run.send_project()
        except BaseException:
            self._release(claimed)
            raise

    def _lighthouse(self, min_groups: int) -> dict[str, str]:
        """The lighthouse started on this machine: the URL each node reaches it at."""
        run = self.launcher
        port = run.inventory.lighthouse_port
        every = (*run.hosts, *run.spares)  # a spare may take a group's place
        addresses = {host.name: routes.address_towards(host) for host in every}
        # one address where every node reaches this machine on the same one, else all of them
        bind = next(iter(set(addresses.values()))) if len(set(addresses.values())) == 1 else ""
        log_dir = run.spec.log_dir
        if log_dir is None:
            raise UserError("an FT=1 job needs its log directory (the lighthouse's log)")
        run.make_log_dir()
        self._held.enter_context(
            lighthouse.running(bind or "0.0.0.0", port, min_groups, log_dir / "lighthouse.log")
        )
        where = bind or "every address of this machine"
        run.emit(
            f"[launcher] torchft lighthouse on {where}:{port} (this machine, for the job's "
            f"length; its log: {log_dir}/lighthouse.log)"
        )
        return {name: f"http://{address}:{port}" for name, address in addresses.items()}

    def watchers(self) -> list[threading.Thread]:
        # no master whose link matters: each group's own ranks are on one node
        job = self.launcher.job
        watchers = [threading.Thread(target=watch.liveness, args=(job,), daemon=True)]
        if job.spec.group_restarts:
            watchers.append(threading.Thread(target=self._restarts, daemon=True))
        return watchers

    def _restarts(self) -> None:
        """Each group lost, started again while restarts are left: on a spare at once where
        the job has one (an inventory host beyond NNODES), else on its own node once it
        answers."""
        job, done, restarts = self.launcher.job, 0, self.launcher.job.spec.group_restarts
        spares = list(self.launcher.spares)
        returning: set[str] = set()
        while not job.done.wait(1.0):
            for name in list(self._groups.lost):
                if name in returning or done >= restarts:
                    continue
                done += 1
                returning.add(name)
                host = next(h for h in self.launcher.hosts if h.name == name)
                if spares:  # the lost node stays lost: never taken again
                    work = functools.partial(self._bring_in, host, spares.pop(0), done, restarts)
                else:
                    work = functools.partial(self._bring_back, host, done, restarts, returning)
                threading.Thread(target=work, daemon=True).start()

    def _bring_in(self, lost: Host, spare: Host, restart: int, restarts: int) -> None:
        """Spare `spare` takes lost node `lost`'s group (restart `restart` of `restarts`): the
        project sent to it and the node readied as the others were before the job, then its
        group started; it heals from a live peer."""
        run, job = self.launcher, self.launcher.job
        run.emit(
            f"[launcher] {lost.name}'s group goes to spare {spare.name} (restart {restart} of "
            f"{restarts})"
        )
        if not self._wait_for(spare):
            return
        remote = run.remote_for(spare)
        try:
            remote.connect()
            if job.container:
                remote.run(_remove_containers(run.spec.run_id), timeout=60)
            claim_port(remote, spare, run.spec.run_id, run.inventory.rendezvous_port, run.emit)
            self._ready(spare, remote)
        except UserError as exc:
            close_quietly(remote)
            run.emit(f"[launcher] spare {spare.name} cannot take {lost.name}'s group: {exc}")
            return
        if not job.take_over(lost.name, spare.name, restart, restarts):
            close_quietly(remote)
            return  # the job ended meanwhile
        run.remotes[spare.name] = remote
        run.start_runner(spare, self._command(spare, 0.0))

    def _ready(self, spare: Host, remote: Session) -> None:
        """A spare made ready as the job's nodes were (launch.job's send_project): the project
        on it, its copy, image and directories checked, its environment decided."""
        run = self.launcher
        project = run.project
        assert project is not None  # planned before the job started
        for tree, destination in project.trees:
            sent = sync.push(run.inventory, (spare,), tree, destination, run.emit)
            run.emit("[launcher] " + sync.summary_line(tree, destination, sent))
        versions, drift = prepare_nodes(
            {spare.name: remote},
            run.inventory,
            run.spec,
            project,
            run.backend,
            run.emit,
            lambda work: work(spare),
        )
        run.versions.update(versions)
        run.drift.update(drift)
        envs, _ = node_settings(
            replace(run.inventory, hosts=(spare,)), run.spec.env_file, run.backend
        )
        self._envs.update(envs)

    def _wait_for(self, host: Host) -> bool:
        """Until `host` answers (True), or --restart-wait has passed or the job ended (False,
        said where the wait ran out)."""
        run, job = self.launcher, self.launcher.job
        wait = job.spec.restart_wait
        deadline = time.monotonic() + wait
        while not self._answers(host):
            if job.done.wait(RESTART_POLL):
                return False
            if time.monotonic() > deadline:
                run.emit(
                    f"[launcher] {host.name} still silent after --restart-wait {wait:g} s: the "
                    "group stays out"
                )
                return False
        return True

    def _bring_back(self, host: Host, restart: int, restarts: int, returning: set[str]) -> None:
        """Node `host`'s group started again (restart `restart` of `restarts`) once the node
        answers, what the lost group left there stopped first; it heals from a live peer.
        Given up when the job ends first, or the node is still silent after --restart-wait."""
        run, job = self.launcher, self.launcher.job
        wait = job.spec.restart_wait
        run.emit(
            f"[launcher] {host.name}: waiting up to {wait:g} s for it to answer, to start its "
            f"group again (restart {restart} of {restarts})"
        )
        if not self._wait_for(host):
            return
        self._stop_lost([host])
        remote = run.remote_for(host)
        try:
            remote.connect()
            if job.container:  # one left stopped by the node's end would hold the name
                remote.run(_remove_containers(run.spec.run_id), timeout=60)
            port = run.inventory.rendezvous_port
            claim_port(remote, host, run.spec.run_id, port, run.emit)
        except UserError as exc:
            close_quietly(remote)
            run.emit(f"[launcher] {host.name}: its group cannot start again: {exc}")
            return
        if not job.rejoin(host.name, restart, restarts):
            close_quietly(remote)
            return  # the job ended meanwhile
        old = run.remotes.get(host.name)
        run.remotes[host.name] = remote
        if old is not None:
            close_quietly(old)
        returning.discard(host.name)
        run.start_runner(host, self._command(host, 0.0))

    def _answers(self, host: Host) -> bool:
        """Node `host` answers over SSH, and its Docker engine too where jobs run in one."""
        run = self.launcher
        if not run.nodes.answers(host, 2):
            return False
        try:
            with run.remote_for(host) as remote:
                remote.connect()
                check = ENGINE_ANSWERS if run.job.container else "true"
                return remote.run(check, timeout=15).ok
        except UserError:
            return False

    def conclude(self, interrupted: bool) -> None:
        run = self.launcher
        try:
            if interrupted or run.job.first_failure is not None:
                run.stop_everywhere(run.inventory.master)
                self._release([h for h in run.hosts if h.name not in run.job.silent])
            else:
                groups = run.job.groups
                assert groups is not None
                self._stop_lost([h for h in run.hosts if h.name in groups.lost])
                self._release([h for h in run.hosts if h.name not in groups.lost])
        finally:
            self._held.close()

    def _stop_lost(self, hosts: list[Host]) -> None:
        """What a lost group left on its node, stopped and its port freed where the node
        answers (a node that died has nothing left)."""
        run = self.launcher
        for host in hosts:
            left = RunningJob(
                run.spec,
                (host,),
                run.nodes,
                run.emit,
                run.inventory.rendezvous_port,
                run.job.container,
            )
            left.outcomes[host.name].unreachable = True  # probed before SSH is tried
            stop.everywhere(left, host)

    def _release(self, hosts: list[Host]) -> None:
        run = self.launcher
        for host in hosts:
            release_port(run.remote_for, host, run.spec.run_id, run.inventory.rendezvous_port)

    def broke(self) -> bool:
        return True  # concluded as any other run: the lighthouse stopped there
