"""How a training container is started on a node: one definition for the launcher's jobs and
for netcheck's probes, so netcheck checks exactly the environment jobs get."""

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
    if host.gpus > 0:
        options += ["--gpus", "all"]
    return options
