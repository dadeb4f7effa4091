"""How a training container is started on a node: one definition for the launcher's jobs and
for netcheck's probes, so netcheck checks exactly the environment jobs get."""

from __future__ import annotations

from cluster.inventory import Host


def training_container_options(host: Host, memlock: str, label: str) -> list[str]:
    """`docker run` options up to (not including) the image.

    Host networking so NCCL and gloo see the real NICs and the compute IP the rendezvous is
    bound to; the host's IPC namespace so /dev/shm is as large as the machine's (DataLoader
    workers and NCCL's shared-memory transport need more than Docker's 64 MB); memlock as the
    inventory says ('unlimited' for RDMA registration); GPUs only where the node has them.
    `--pull never`: a missing image is an error to report, not a download to start.
    """
    limit = "-1:-1" if memlock == "unlimited" else f"{memlock}:{memlock}"
    options = [
        "docker", "run", "--rm", "--init", "--pull", "never", "--label", label,
        "--network", "host", "--ipc", "host",
        "--ulimit", f"memlock={limit}", "--ulimit", "stack=67108864",
    ]  # fmt: skip
    if host.gpus > 0:
        options += ["--gpus", "all"]
    return options
