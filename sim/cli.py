"""`python -m torch_multinode.sim.cli`: start, stop or list the simulated cluster.

A thin edge like cluster/cli.py: parse arguments, call sim.nodes, print, and turn a UserError
into one `Error: ...` line with a non-zero exit. `make sim-up` and `make sim-down` run it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torch_multinode.cluster import trust
from torch_multinode.cluster.errors import ArgumentParser, UserError, at_the_edge
from torch_multinode.sim import nodes as sim


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m torch_multinode.sim.cli",
        description="The simulated cluster: node containers reached over SSH.",
    )
    sim_commands = parser.add_subparsers(dest="sim_command", required=True, metavar="ACTION")
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
            "--mgmt-subnet",
            default=sim.DEFAULT_MGMT_SUBNET,
            help="management (SSH) subnet (default: %(default)s)",
        )
        sub.add_argument(
            "--state-dir",
            default=None,
            help="where the inventory, SSH key and known_hosts go (default: .sim for the "
            "default cluster, .sim/NAME for others)",
        )
        if name == "up":
            sub.add_argument("-n", "--nodes", type=int, default=2, help="1 to 4 (default: 2)")
            sub.add_argument(
                "--link",
                default=None,
                help="shape every node's link, e.g. 1gbit (default: unshaped)",
            )
            sub.add_argument(
                "--fresh",
                action="store_true",
                help=f"nodes as a fresh install leaves them: user {sim.FRESH_USER} with a "
                "password (asked now, or the first line of standard input), sudo asking for it, "
                "SSH password login, no key; then make bootstrap",
            )
    return parser


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    state_dir = Path(args.state_dir) if args.state_dir else sim.default_state_dir(args.name)
    config = sim.SimConfig(args.name, args.subnet, state_dir, args.mgmt_subnet)
    if args.sim_command == "up":
        # Nodes already running keep the password they have: asked only for new ones.
        ask = args.fresh and not sim.status(config)
        password = _new_password(sim.FRESH_USER) if ask else None
        cluster = sim.up(
            args.nodes,
            args.link,
            config,
            progress=_progress,
            fresh=args.fresh,
            fresh_password=password,
        )
        inventory = cluster.config.inventory_path
        shaped = f", every link shaped to {cluster.link}" if cluster.link else ""
        print(
            f"Simulated cluster '{config.name}': {len(cluster.nodes)} node(s) up over SSH in "
            f"{cluster.seconds:.1f} s{shaped}."
        )
        for index, name in enumerate(cluster.nodes, start=1):
            print(
                f"  {name}  ssh {config.mgmt_ip(index)}  compute {config.node_ip(index)} "
                f"({sim.COMPUTE_INTERFACE})  container {config.container(index)}"
            )
        print(f"Inventory: {inventory}")
        print("Use it:")
        if args.fresh:
            print(
                f"  make bootstrap INVENTORY={inventory}   (first: {sim.FRESH_USER}'s password, "
                "each node's host key)"
            )
        print(f"  make provision INVENTORY={inventory}")
        print(f"  make netcheck  INVENTORY={inventory}")
        print(f"  make train     INVENTORY={inventory} NNODES={len(cluster.nodes)}")
        user = sim.FRESH_USER if args.fresh else "root"
        target = f"{user}@{config.mgmt_ip(1)}"
        print(f"  {trust.login_line(config.known_hosts_path, config.key_path, target)}")
        return 0
    if args.sim_command == "down":
        removed = sim.down(config, progress=_progress)
        print(
            f"Simulated cluster '{config.name}' removed: {removed.containers} container(s), "
            f"{removed.networks} network(s), {removed.volumes} volume(s)."
        )
        return 0
    nodes = sim.status(config)
    if not nodes:
        print(f"Simulated cluster '{config.name}' is not running (start it with 'make sim-up').")
    for container, ip, running in nodes:
        print(f"{container}  ssh {ip}  {'running' if running else 'stopped'}")
    return 0


def _new_password(user: str) -> str:
    """The fresh nodes' password: typed twice at a terminal, or the first line of stdin."""
    import getpass

    if not sys.stdin.isatty():
        return sys.stdin.readline().rstrip("\n")
    first = getpass.getpass(f"Password for {user} on the fresh nodes (as the installer asks): ")
    if getpass.getpass("The same password again: ") != first:
        raise UserError("the two passwords differ", hint="make sim-up FRESH=1 again")
    return first


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return at_the_edge(run, args)


if __name__ == "__main__":
    sys.exit(main())
