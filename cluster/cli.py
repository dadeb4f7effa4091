"""`cluster`: check an inventory, and start or stop the simulated cluster.

A thin edge: parse arguments, call the plain functions in cluster.inventory and cluster.sim,
print, and turn a ClusterError into one `Error: ...` line with a non-zero exit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster import inventory as inventory_module
from cluster import sim
from cluster.errors import ArgumentParser, ClusterError, at_the_edge, shown
from cluster.inventory import DEFAULT_TRAINING_IMAGE, is_word


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="cluster",
        description="Inventory checks and the local simulated cluster.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = commands.add_parser(
        "check",
        help="validate an inventory (and NNODES) and list its hosts",
        description="Validate an inventory before anything acts on it. Exit 0 when it is "
        "valid; otherwise one 'Error:' line naming the host and the field, and exit 2.",
    )
    check.add_argument("-i", "--inventory", help="path of the Ansible YAML inventory")
    check.add_argument("-n", "--nnodes", help="how many nodes the job will use (default: all)")

    image = commands.add_parser(
        "image",
        help="build the training image (CUDA where nvidia-smi works, else the CPU twin)",
        description="Build the training image from docker/Dockerfile and print what it holds.",
    )
    image.add_argument(
        "--kind", choices=("auto", "cpu", "cuda"), default="auto",
        help="auto: CUDA when this machine has a working nvidia-smi, else CPU (default)",
    )  # fmt: skip
    image.add_argument("--tag", default=DEFAULT_TRAINING_IMAGE, help="default: %(default)s")
    image.add_argument(
        "-i", "--inventory", default=None,
        help="build what this inventory's jobs need: its training_image, CUDA if any node has "
        "GPUs; nothing when launch_mode is host",
    )  # fmt: skip

    simulated = commands.add_parser(
        "sim", help="the simulated cluster (node containers reached over SSH)"
    )
    sim_commands = simulated.add_subparsers(dest="sim_command", required=True, metavar="ACTION")
    for name, text in (
        ("up", "start N nodes (or reuse them) and write their inventory"),
        ("down", "remove every container, network and volume the simulator made"),
        ("status", "list the nodes and whether they run"),
    ):
        sub = sim_commands.add_parser(name, help=text, description=text)
        sub.add_argument(
            "--name", default=sim.DEFAULT_NAME, help="cluster name (default: %(default)s)"
        )
        sub.add_argument(
            "--subnet", default=sim.DEFAULT_SUBNET, help="compute subnet (default: %(default)s)"
        )
        sub.add_argument(
            "--mgmt-subnet", default=sim.DEFAULT_MGMT_SUBNET,
            help="management (SSH) subnet (default: %(default)s)",
        )  # fmt: skip
        sub.add_argument(
            "--state-dir", default=None,
            help="where the inventory, SSH key and known_hosts go (default: .sim for the "
            "default cluster, .sim/NAME for others)",
        )  # fmt: skip
        if name == "up":
            sub.add_argument("-n", "--nodes", type=int, default=2, help="1 to 4 (default: 2)")
            sub.add_argument(
                "--link",
                default=None,
                help="shape every node's link, e.g. 1gbit (default: unshaped)",
            )
    return parser


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    if args.command == "check":
        inventory = inventory_module.load(args.inventory)
        hosts = inventory.select(args.nnodes) if args.nnodes not in (None, "") else inventory.hosts
        print(f"inventory {inventory.path}: valid, {len(inventory.hosts)} host(s), "
              f"compute subnet {inventory.compute_subnet}, rendezvous port "
              f"{inventory.rendezvous_port}")  # fmt: skip
        for rank, host in enumerate(hosts):
            role = "master" if rank == 0 else "worker"
            print(f"  node_rank {rank}  {host.name:<16} ssh {host.ssh_address:<16} compute "
                  f"{host.compute_ip} ({host.compute_interface})  gpus {host.gpus}  {role}")  # fmt: skip
        return 0

    if args.command == "image":
        from cluster import images

        kind, tag = args.kind, args.tag
        if not is_word(tag):  # the inventory's training_image is held to the same rule
            raise ClusterError(f"--tag {shown(tag)} is not an image name")
        if args.inventory:
            inventory = inventory_module.load(args.inventory)
            if inventory.launch_mode != "container":
                print(f"inventory {inventory.path}: launch_mode {inventory.launch_mode}, no "
                      "training image needed.")  # fmt: skip
                return 0
            tag = inventory.training_image
            if kind == "auto":
                kind = "cuda" if any(h.gpus > 0 for h in inventory.hosts) else "cpu"
        built = images.build(kind, tag, progress=_progress)
        print(f"Built {built.tag} ({built.kind}, {built.image_id[:19]}) in {built.seconds:.0f} s:")
        for name, version in images.versions(built.tag).items():
            print(f"  {name}: {version}")
        return 0

    state_dir = Path(args.state_dir) if args.state_dir else sim.default_state_dir(args.name)
    config = sim.SimConfig(args.name, args.subnet, state_dir, args.mgmt_subnet)
    if args.sim_command == "up":
        cluster = sim.up(args.nodes, args.link, config, progress=_progress)
        inventory = cluster.config.inventory_path
        shaped = f", every link shaped to {cluster.link}" if cluster.link else ""
        print(f"Simulated cluster '{config.name}': {len(cluster.nodes)} node(s) up over SSH in "
              f"{cluster.seconds:.1f} s{shaped}.")  # fmt: skip
        for index, name in enumerate(cluster.nodes, start=1):
            print(f"  {name}  ssh {config.mgmt_ip(index)}  compute {config.node_ip(index)} "
                  f"({sim.COMPUTE_INTERFACE})  container {config.container(index)}")  # fmt: skip
        print(f"Inventory: {inventory}")
        print("Use it:")
        print(f"  make provision INVENTORY={inventory}")
        print(f"  make netcheck  INVENTORY={inventory}")
        print(f"  make train     INVENTORY={inventory} NNODES={len(cluster.nodes)}")
        print(f"  ssh -i {config.key_path} -o UserKnownHostsFile={config.known_hosts_path} "
              f"root@{config.mgmt_ip(1)}")  # fmt: skip
        return 0
    if args.sim_command == "down":
        removed = sim.down(config, progress=_progress)
        print(f"Simulated cluster '{config.name}' removed: {removed.containers} container(s), "
              f"{removed.networks} network(s), {removed.volumes} volume(s).")  # fmt: skip
        return 0
    nodes = sim.status(config)
    if not nodes:
        print(f"Simulated cluster '{config.name}' is not running (start it with 'make sim-up').")
    for container, ip, running in nodes:
        print(f"{container}  ssh {ip}  {'running' if running else 'stopped'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return at_the_edge(run, args)


if __name__ == "__main__":
    sys.exit(main())
