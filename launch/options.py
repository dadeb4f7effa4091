"""`train`'s command line: the argument parser, each option's type, default and help (the
restart options are launch.restarts'); launch.cli parses with it and runs the job."""

from __future__ import annotations

import argparse
from pathlib import Path

from torch_multinode.cluster import sync
from torch_multinode.cluster.errors import ArgumentParser, positive_number, whole_number
from torch_multinode.cluster.inventory import NODES_GROUP
from torch_multinode.cluster.inventory_checks import GROUP_HELP
from torch_multinode.launch import ft, restarts
from torch_multinode.launch.spec import (
    DEBUG_LEVELS,
    DEFAULT_MODULE,
    DEFAULT_NETWORK_TIMEOUT,
    ON_HANG,
)


def parser() -> argparse.ArgumentParser:
    """`train`'s parser: every option, with its type, default and help."""
    parser = ArgumentParser(
        prog="train",
        description="Launch a torchrun job on every node of the inventory over SSH, streaming "
        "each node's output; if any node fails or Ctrl-C is pressed, the job is stopped on every "
        "node. Without an inventory the job runs on this machine (torchrun --standalone).",
        epilog="Arguments after '--' go to the script or module. Exit: 0 success, 1 the job "
        "failed (the summary names the node), 2 bad input, 130 interrupted (Ctrl-C), 143 "
        "terminated (SIGTERM: stopped on every node, as for Ctrl-C).",
    )
    parser.add_argument(
        "-i",
        "--inventory",
        help="the Ansible inventory, YAML or INI, or a directory (default: run locally)",
    )
    parser.add_argument("-n", "--nnodes", default=None, help="use the first N hosts (default: all)")
    parser.add_argument("--group", default=NODES_GROUP, help=GROUP_HELP)
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--script",
        type=Path,
        help="your torchrun-compatible script; its project (the git work tree it is in, else its "
        "directory, or --workdir) is mirrored to every node and the job runs in it",
    )
    what.add_argument(
        "--module",
        default=DEFAULT_MODULE,
        help="a module importable on the nodes (default: %(default)s)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="the project directory that travels to every node (default: see --script; for a "
        "--module, this project's own packages); what git ignores, .git, virtual environments "
        "and caches stay behind",
    )
    parser.add_argument(
        "--requirements",
        default=None,
        metavar="PATH",
        help="the project's Python dependencies: a requirements file, or a pyproject.toml's "
        "[project] dependencies (default: requirements.txt at the project's root, else its "
        "pyproject.toml); 'none': none. In containers they become a layer on the training "
        "image, built once and shipped by layers; for a local job, a directory beside this "
        "environment; torch, torchvision and the CUDA libraries stay the environment's",
    )
    parser.add_argument(
        "--env-file",
        default=None,
        metavar="PATH",
        help="netcheck's interface settings for each node, as netcheck --env-file wrote them "
        "(default: netcheck-env.json next to the inventory, where netcheck writes it; without "
        "one, each node's compute_interface)",
    )
    parser.add_argument(
        "--workdir-limit",
        type=positive_number("number of MB"),
        default=sync.DEFAULT_WORKDIR_LIMIT / 1e6,
        help="MB a workdir may hold; datasets go through 'make data' (default: %(default)g)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="an environment variable for every rank (repeatable; several per flag, space "
        "separated); a bare NAME passes this machine's value. Values never appear in output, "
        "logs, docker inspect or any command line",
    )
    parser.add_argument(
        "--nproc-per-node",
        type=whole_number(1),
        default=None,
        help="processes per node (default: the node's GPU count, or 1 on a CPU node; 2 locally)",
    )
    parser.add_argument(
        "--rendezvous-timeout",
        type=whole_number(1),
        default=60,
        help="seconds to wait for every node to join (default: %(default)s)",
    )
    parser.add_argument(
        "--network-timeout",
        type=positive_number("number of seconds"),
        default=DEFAULT_NETWORK_TIMEOUT,
        help="seconds a node may be unable to reach the master over the compute network before "
        "it is declared lost and the job stopped (default: %(default)g)",
    )
    parser.add_argument(
        "--stall",
        type=positive_number("number of seconds", zero=True),
        default=None,
        help="seconds without progress (step lines, '[tmn] heartbeat' lines, or any output for a "
        "script that prints neither), counted from its first, after which the job is a hang: "
        "every rank's stacks are read and the rank that holds the others up is named; 0: never "
        "(default: the larger of 120 s and 5 times the median time between step lines or "
        "heartbeats, once one was seen; none for a job that prints neither)",
    )
    parser.add_argument(
        "--on-hang",
        choices=ON_HANG,
        default="stop",
        help="after a hang's report: stop the job, or wait, leaving it running for a person to "
        "look (Ctrl-C stops it) (default: %(default)s)",
    )
    parser.add_argument(
        "--allow-drift",
        action="store_true",
        help="run even on nodes whose kernel, NVIDIA driver, Docker, training image or torch "
        "changed since netcheck locked them (versions.lock.json next to the inventory); the "
        "changes are said and kept in the run's record",
    )
    restarts.add_options(parser)
    ft.add_option(parser)
    parser.add_argument(
        "--max-restarts",
        type=whole_number(0),
        default=0,
        help="torchrun's own restarts of the worker processes while every node stays up "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--gpus",
        default=None,
        help="GPU indices every node uses, e.g. 0,2: one process per GPU, CUDA_VISIBLE_DEVICES "
        "set for the job (a host's cuda_visible_devices in the inventory wins for that host)",
    )
    parser.add_argument(
        "--debug",
        nargs="?",
        const="info",
        default=None,
        choices=DEBUG_LEVELS,
        help="NCCL_DEBUG=INFO, TORCH_DISTRIBUTED_DEBUG=INFO and the C++ backend logs, on every "
        "node, for this run only; '--debug detail' for TORCH_DISTRIBUTED_DEBUG=DETAIL (it "
        "crashed DDP over gloo with torch 2.14.1)",
    )
    parser.add_argument(
        "--local-rank-arg",
        choices=("auto", "none", "--local_rank", "--local-rank"),
        default="auto",
        help="scripts written for torch.distributed.launch get their local rank as this flag; "
        "auto: if the script declares one (default)",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="where each node's output is saved as NODE.log (default: .runs/JOB-ID)",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser
