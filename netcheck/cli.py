"""`netcheck`: the pre-flight check before a multi-node training run.

A thin edge: parse arguments, call netcheck.preflight, write the env file for the launcher,
print the table (or --json) and exit 0 only when nothing FAILs. A UserError (no inventory,
bad NNODES, unwritable env file) becomes one `Error: ...` line.
"""

from __future__ import annotations

import argparse
import json
import sys

from torch_multinode.cluster import inventory_read
from torch_multinode.cluster import version_lock as lock
from torch_multinode.cluster.errors import ArgumentParser, at_the_edge, positive_number
from torch_multinode.cluster.execution import SshNodes
from torch_multinode.cluster.inventory import NODES_GROUP
from torch_multinode.cluster.inventory_checks import GROUP_HELP
from torch_multinode.netcheck import envfile
from torch_multinode.netcheck.attempts import DEFAULT_SWEEP_TIMEOUT, DEFAULT_TIMEOUT, Options
from torch_multinode.netcheck.preflight import preflight
from torch_multinode.netcheck.report import render

DESCRIPTION = """\
Check that the nodes of an inventory can train together, before a job finds out the hard way:
SSH, ping between every pair of nodes, name resolution, the rendezvous port and random high
ports (really listened on and connected to), the compute interfaces (up, routes, MTU), the
Python/torch/CUDA/NCCL versions, and a real all_reduce, all_gather and broadcast across all
nodes (gloo on CPU, NCCL on GPU). Every check runs on all nodes in parallel; a node that does
not answer is reported, not waited for.

Writes the per-node NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME / NCCL_IB_DISABLE the launcher
uses to --env-file (default: netcheck-env.json next to the inventory). When nothing FAILs, also
locks each checked node's versions (kernel, NVIDIA driver, Docker, the training image or the
interpreter's torch, CUDA and NCCL) in versions.lock.json next to the inventory: `make train` refuses
a node that changed since, unless ALLOW_DRIFT=1.
"""

EPILOG = """\
exit status: 0 when nothing FAILs (WARNs allowed), 1 when a check FAILs, 2 on bad input.

examples:
  netcheck -i .sim/inventory.yml
  netcheck -i inventory.yml --nnodes 2 --json
  netcheck -i inventory.yml --sweep          # bandwidth: sizes to 64 MiB, busbw vs raw TCP
  netcheck -i inventory.yml --pairwise       # raw TCP between every pair: finds a slow link
"""


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="netcheck",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "-i",
        "--inventory",
        metavar="INVENTORY",
        help="the cluster's Ansible inventory, YAML or INI, or a directory (required)",
    )
    p.add_argument("--group", default=NODES_GROUP, help=GROUP_HELP)
    p.add_argument(
        "-n",
        "--nnodes",
        metavar="N",
        help="check the first N hosts of the inventory (default: all)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON for machines")
    p.add_argument(
        "--sweep",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="measure bandwidth: message sizes from 1 KiB to 64 MiB, algbw and busbw "
        "beside raw TCP between the same nodes (default: off, two small sizes)",
    )
    p.add_argument("--bandwidth", dest="sweep", action="store_true", help="same as --sweep")
    p.add_argument(
        "--pairwise",
        action="store_true",
        help="raw TCP between every pair of nodes, one pair at a time, to find the slow link",
    )
    p.add_argument(
        "--ft",
        action="store_true",
        help="also check what FT=1 jobs need: every node reaches this machine on the "
        "inventory's lighthouse_port, where their torchft lighthouse runs",
    )
    p.add_argument(
        "--env-file",
        metavar="PATH",
        help=f"where to write the launcher's environment (default: "
        f"{envfile.FILENAME} next to the inventory)",
    )
    p.add_argument(
        "--timeout",
        metavar="S",
        type=positive_number("number of seconds"),
        help=f"wall-clock seconds for each torch stage on a node (default: "
        f"{DEFAULT_TIMEOUT:g}, with --sweep {DEFAULT_SWEEP_TIMEOUT:g}); SSH "
        f"connections give up after 5 s",
    )
    return p


def run(args: argparse.Namespace) -> int:
    inventory = inventory_read.load(args.inventory, args.group)
    nnodes = None
    if args.nnodes not in (None, ""):
        nnodes = len(inventory.first(args.nnodes).hosts)  # validates: one Error line, exit 2
    options = Options(
        nnodes=nnodes, sweep=args.sweep, pairwise=args.pairwise, timeout=args.timeout, ft=args.ft
    )
    nodes = SshNodes(inventory)
    try:
        report = preflight(inventory, options, nodes)
        if report.ok:
            report.lock_file = str(lock.lock_nodes(inventory.first(nnodes), nodes))
    finally:
        nodes.close()
    if report.env:
        path = args.env_file or envfile.default_path(inventory.path)
        report.env_file = str(envfile.write(path, report.env))
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(render(report))
    return report.exit_code


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return at_the_edge(run, args)


if __name__ == "__main__":
    sys.exit(main())
