"""Every container command line, in one file: the `docker run` of the launcher's jobs and of
netcheck's probes, built from one set of options, so netcheck checks exactly the environment
jobs get. launch.commands and cluster.execution only call it: no option of a job's or a
probe's container is written anywhere else.

- `job_container_command`: a job's container on one node (its whole lifetime), with the job's
  mounts, working directory, variables, ptrace and name (`container_name`).
- `probe_container_command`: netcheck's probe container, with its own label and, where
  netcheck's code was sent, that code mounted and on the import path.
- `training_container_options`: the options both start with (network, IPC, ulimits, GPUs,
  NCCL's configuration, label); `container_command`: the line from options, image, command,
  with the node's RDMA options (`rdma_options`) between them.
- `NCCL_CONF_GUARD`: the shell test both lines are prefixed with.

Callers pass plain values (run ID, node name, label), never a launch.spec.JobSpec: cluster/
imports nothing of launch/."""

from __future__ import annotations

import shlex

from torch_multinode.cluster.inventory import Host

# NCCL's own configuration, written by provisioning (role nccl_config) and mounted read-only
# into every training container: a launcher typed by hand in one (torchrun, deepspeed,
# accelerate) picks the compute interface too.
NCCL_CONF = "/etc/nccl.conf"
# Docker would make a missing bind-mount source a directory: the file is checked for first.
NCCL_CONF_GUARD = (
    f"test -f {NCCL_CONF} || {{ echo 'Error: {NCCL_CONF} is missing on this node (try make "
    f"provision, whose nccl_config role writes it)' >&2; exit 125; }}"
)

# InfiniBand and RoCE through verbs: the node's device files, the right to pin memory.
RDMA_DEVICE_DIR = "/dev/infiniband"
RDMA_DEVICES = ("uverbs*", "rdma_cm", "umad*")
RDMA_OPTIONS = ("--cap-add", "IPC_LOCK")


def rdma_options(device_dir: str = RDMA_DEVICE_DIR) -> str:
    """Shell text, one unquoted command substitution, that the node's shell expands to the
    `docker run` options verbs needs where the node has RDMA devices, and to nothing elsewhere:
    `--device` for each of its uverbs*, rdma_cm and umad* entries and `--cap-add IPC_LOCK`
    (NCCL pins its buffers and registers them with the NIC). Decided on the node when the
    container starts, by what /dev/infiniband holds there: no flag, no probe to keep in step.

    memlock stays the inventory's container_memlock, unlimited unless it says otherwise, which
    is what verbs needs: forcing it here would stop the container from starting at all where
    Docker cannot raise the limit ("error setting rlimit type 8: operation not permitted",
    measured on this project's development machine), which that setting exists for."""
    patterns = " ".join(f"{device_dir}/{p}" for p in RDMA_DEVICES)
    # In sh of its own: a login shell that fails a glob without matches (zsh's default) would
    # drop every device of a node that has some but no umad*, and NCCL would use sockets.
    script = (
        f'o=; for d in {patterns}; do [ -e "$d" ] && o="$o --device $d"; done; '
        f'[ -z "$o" ] || echo "$o {" ".join(RDMA_OPTIONS)}"'
    )
    return f"$(sh -c {shlex.quote(script)})"


def container_command(options: list[str], image: str, command: list[str]) -> str:
    """The `docker run` line for the node's shell: `options` (training_container_options' and
    the caller's own), the RDMA options the node turns out to need (rdma_options), then the
    image and what runs in it. Every word quoted but the RDMA substitution."""
    return f"{shlex.join(options)} {rdma_options()} {shlex.join([image, *command])}"


def training_container_options(host: Host, memlock: str, label: str) -> list[str]:
    """`docker run` options up to (not including) the image.

    Host networking so NCCL and gloo see the real NICs and the compute IP the rendezvous is
    bound to; the host's IPC namespace so /dev/shm is as large as the machine's (DataLoader
    workers and NCCL's shared-memory transport need more than Docker's 64 MB); memlock as the
    inventory says ('unlimited' for RDMA registration); GPUs only where the node has them;
    NCCL's configuration file, read-only (run NCCL_CONF_GUARD first). The RDMA devices are not
    here: they depend on the node, and container_command adds them there when it runs.
    `--pull never`: a missing image is an error to report, not a download to start.
    """
    limit = "-1:-1" if memlock == "unlimited" else f"{memlock}:{memlock}"
    options = [
        "docker",
        "run",
        "--rm",
        "--init",
        "--pull",
        "never",
        "--label",
        label,
        "--network",
        "host",
        "--ipc",
        "host",
        "--ulimit",
        f"memlock={limit}",
        "--ulimit",
        "stack=67108864",
        "-v",
        f"{NCCL_CONF}:{NCCL_CONF}:ro",
    ]
    if host.gpu_count > 0:
        options += ["--gpus", "all"]
    return options


def job_container_command(
    host: Host,
    run_id: str,
    label: str,
    image: str,
    env: dict[str, str],
    workdir: str,
    command: list[str],
    memlock: str = "unlimited",
    mounts: list[tuple[str, bool]] | None = None,
) -> str:
    """The training container for one node, as shell text: NCCL_CONF_GUARD, then the shell
    gives way (exec) to a `docker run` that lasts the job's whole lifetime, removed when it
    ends. Labelled `label` (the launcher's run label, which its stop filters on), named
    container_name(run_id, host.name). Every node directory the job reads or writes, `mounts`
    (path, read-only), is mounted at the same path, each path once (its first entry decides);
    the job runs in `workdir` with `env`. The node's RDMA devices are passed where it has them
    (container_command)."""
    options = training_container_options(host, memlock, label)
    # py-spy reads the ranks' stacks when the job hangs (launch/hang.py): ptrace within the
    # container's own PID namespace, where Yama (Ubuntu's default) asks for the capability.
    options += ["--cap-add", "SYS_PTRACE", "--name", container_name(run_id, host.name)]
    seen: set[str] = set()
    for path, read_only in mounts or []:
        if path not in seen:
            seen.add(path)
            options += ["-v", f"{path}:{path}" + (":ro" if read_only else "")]
    options += ["-w", workdir]
    for key, value in env.items():
        options += ["-e", f"{key}={value}"]
    return f"{NCCL_CONF_GUARD} && exec {container_command(options, image, command)}"


def container_name(run_id: str, node: str) -> str:
    """The job's container on `node`."""
    return f"{run_id}-{node}"


def probe_container_command(
    host: Host,
    image: str,
    memlock: str,
    label: str,
    command: str,
    code_dir: str | None = None,
    python_path: str | None = None,
) -> str:
    """netcheck's probe container on one node, as shell text: NCCL_CONF_GUARD, then a `docker
    run` of the job's own options (training_container_options, the node's RDMA options) that
    runs `command` with sh, labelled `label` (what netcheck's cleanup filters on). The image
    holds no project code: where netcheck's code was sent to `code_dir`, it is mounted
    read-only at the same path and `python_path` (its import path) is the PYTHONPATH."""
    options = training_container_options(host, memlock, label)
    if code_dir:
        options += ["-v", f"{code_dir}:{code_dir}:ro", "-e", f"PYTHONPATH={python_path}"]
    return f"{NCCL_CONF_GUARD} && " + container_command(options, image, ["sh", "-c", command])
