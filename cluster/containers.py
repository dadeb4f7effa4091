"""How a training container is started on a node: one definition for the launcher's jobs and
for netcheck's probes, so netcheck checks exactly the environment jobs get."""

from __future__ import annotations

from cluster.inventory import Host

# NCCL's own configuration, written by provisioning (role nccl_config) and mounted read-only
# into every training container: a launcher typed by hand in one (torchrun, deepspeed,
# accelerate) picks the compute interface too.
NCCL_CONF = "/etc/nccl.conf"
# Docker would make a missing bind-mount source a directory: the file is checked for first.
NCCL_CONF_GUARD = (
    f"test -f {NCCL_CONF} || {{ echo 'Error: {NCCL_CONF} is missing on this node (try make "
    f"provision, whose nccl_config role writes it)' >&2; exit 125; }}"
)


def training_container_options(host: Host, memlock: str, label: str) -> list[str]:
    """`docker run` options up to (not including) the image.

    Host networking so NCCL and gloo see the real NICs and the compute IP the rendezvous is
    bound to; the host's IPC namespace so /dev/shm is as large as the machine's (DataLoader
    workers and NCCL's shared-memory transport need more than Docker's 64 MB); memlock as the
    inventory says ('unlimited' for RDMA registration); GPUs only where the node has them;
    NCCL's configuration file, read-only (run NCCL_CONF_GUARD first).
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
