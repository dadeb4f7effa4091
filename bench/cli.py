"""`make bench`: what the link delivers and what training gets from it, on a simulated cluster
of fresh nodes this run starts (and removes): two one-core nodes behind a 1 Gbit/s link, plus
two more for netcheck's 4-node figure. The flight and detector sections need no cluster: they
run torchrun on this machine, over loopback."""

from __future__ import annotations

import argparse
import datetime
import signal
import sys
import time
from pathlib import Path

from torch_multinode.bench import (
    detector,
    flight,
    ft,
    hang,
    jobs,
    latency,
    lock,
    measure,
    network,
    nodeloss,
    rebuild,
    report,
    shipping,
)
from torch_multinode.cluster import engine
from torch_multinode.cluster.errors import ArgumentParser, UserError, at_the_edge
from torch_multinode.cluster.inventory_read import load
from torch_multinode.sim import nodes as sim

SECTIONS = (
    "provision",
    "netcheck",
    "bandwidth",
    "scaling",
    "accuracy",
    "launcher",
    "editloop",
    "slurm",
    "fsdp",
    "image",
    "rebuild",
    "hang",
    "flight",
    "lock",
    "nodeloss",
    "dependencies",
    "detector",
    "ft",
    "stragglers",
)
# Sections that start nodes of their own (rebuild) or need none (flight, detector): the others
# share one simulated cluster, brought up only when one of them runs.
OWN_NODES = ("rebuild", "flight", "detector")
NO_CLUSTER = {"flight", "detector"}
# The workloads, full size and --quick (a smoke run of every code path in a few minutes).
SCALING = ["--image-size", "64", "--batch", "64", "--accumulate", "2"]
SCALING_QUICK = ["--image-size", "16", "--batch", "4", "--accumulate", "2", "--measure", "1"]
ACCURACY = ["--steps", "40", "--log-every", "40", "--seed", "1"]
ACCURACY_QUICK = ["--steps", "6", "--log-every", "6", "--model", "tiny"]
FIRST_STEP = ["--steps", "2", "--log-every", "1"]
FSDP_STEPS, FSDP_STEPS_QUICK = 30, 4
NAME = "tmnbench"
REBUILD_NAME = "tmnbenchr"  # the rebuild section's fresh nodes, on the next subnets


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  make bench\n  bench --only bandwidth,scaling --reps 5\n"
        "  bench --quick --out /tmp/bench        # every path, tiny workloads",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help="where bench.md, bench.json and the plots go (default: bench-results)",
    )
    p.add_argument("--reps", type=int, default=3, help="repetitions of each figure (default: 3)")
    p.add_argument("--link", default="1gbit", help="the shaped link's rate (default: 1gbit)")
    p.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma list of sections (default: all): {', '.join(SECTIONS)}",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny workloads: checks every path in minutes; figures not meaningful",
    )
    p.add_argument(
        "--training-image",
        default=None,
        help="the image of the sections with jobs in containers (editloop, image; default: "
        "the inventory's training_image, built if missing)",
    )
    p.add_argument(
        "--image-reps",
        type=int,
        default=1,
        help="repetitions of the image section's first shipments, about 4 GB each (default: 1)",
    )
    p.add_argument(
        "--subnet-octet",
        type=int,
        default=61,
        help="third octet of the bench cluster's subnets (default: 61)",
    )
    return p


def run(args: argparse.Namespace, progress=print) -> list[Path]:
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        raise UserError(
            f"--only {','.join(unknown)}: not a section",
            hint=f"one or more of {','.join(SECTIONS)}",
        )
    if not 1 <= args.reps <= 20:
        raise UserError(f"--reps {args.reps} is not between 1 and 20", hint="--reps 3")
    if not 1 <= args.image_reps <= 20:
        raise UserError(
            f"--image-reps {args.image_reps} is not between 1 and 20", hint="--image-reps 1"
        )
    if not 1 <= args.subnet_octet <= 254:
        raise UserError(f"--subnet-octet {args.subnet_octet} is not between 1 and 254")
    if not set(only) <= NO_CLUSTER:
        engine.require_engine()
    octet = args.subnet_octet
    config = sim.SimConfig(
        NAME, f"172.29.{octet}.0/24", sim.default_state_dir(NAME), f"172.30.{octet}.0/24"
    )
    nnodes = (
        4
        if {"netcheck", "hang", "lock"} & set(only)
        else 3
        if {"nodeloss", "ft"} & set(only)
        else 2
    )
    started = time.monotonic()
    data: dict = {
        "command": "make bench" + (" (--quick)" if args.quick else ""),
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "reps": args.reps,
    }
    data["cluster"] = f"2 Debian containers on this machine's 2 cores, link {args.link}"
    if set(only) - set(OWN_NODES):
        _on_the_bench_cluster(args, only, config, nnodes, data, progress)
    elif "rebuild" not in only:
        data["cluster"] = None  # flight and detector alone: this machine, no containers
    if "rebuild" in only:
        # Fresh nodes of its own, after the others are gone: its first run ships the whole image.
        near = octet + 1 if octet < 254 else octet - 1
        rebuild_config = sim.SimConfig(
            REBUILD_NAME,
            f"172.29.{near}.0/24",
            sim.default_state_dir(REBUILD_NAME),
            f"172.30.{near}.0/24",
        )
        progress(f"bench: fresh 2-node simulated cluster '{REBUILD_NAME}' for the rebuild...")
        data["rebuild"] = rebuild.measure_rebuild(rebuild_config, args.link, args.reps, progress)
    if "flight" in only:
        # Last, when the bench's containers are gone: torchrun on this machine, loopback only.
        progress("bench: the Flight Recorder's cost, torchrun on this machine (no cluster)...")
        data["flight"] = flight.measure_flight(args.reps, progress, quick=args.quick)
    if "detector" in only:
        progress("bench: the straggler detector's cost, torchrun on this machine (no cluster)...")
        data["detector"] = detector.measure_detector(args.reps, progress, quick=args.quick)
    data["minutes"] = (time.monotonic() - started) / 60
    written = report.write(data, args.out)
    progress("")
    progress(written[0].read_text().split("\n## ")[0].rstrip())  # bench.md up to its sections
    progress("")
    progress(f"bench: {data['minutes']:.1f} min; report in {', '.join(map(str, written))}")
    return written


def _on_the_bench_cluster(
    args: argparse.Namespace,
    only: list[str],
    config: sim.SimConfig,
    nnodes: int,
    data: dict,
    progress,
) -> None:
    """Every section but the rebuild, on one fresh cluster of `nnodes`, removed at the end."""
    progress(f"bench: fresh {nnodes}-node simulated cluster '{NAME}', link {args.link}...")
    sim.down(config)
    try:
        cluster = sim.up(nnodes, args.link, config)
        measure.pin_cores(config, nnodes)
        inventory = cluster.config.inventory_path
        data["cluster"] = (
            f"{nnodes} Debian containers on this machine's 2 cores (nodes 1 "
            "and 2, which run the bandwidth and scaling figures, on a core each), "
            f"compute link shaped to {args.link} with tbf"
        )
        if {"provision", "netcheck", "bandwidth"} & set(only):
            # netcheck passes only on provisioned nodes (names, firewall); timed anyway.
            data["provision"] = network.measure_provision(inventory, args.reps, progress)
            if "provision" not in only:
                data.pop("provision")
        if "netcheck" in only:
            data["netcheck"] = network.measure_netcheck(inventory, config, args.reps, progress)
        if "bandwidth" in only:
            data["bandwidth"] = network.measure_bandwidth(
                inventory, config, args.link, args.reps, progress
            )
        if "scaling" in only:
            workload = SCALING_QUICK if args.quick else SCALING
            data["scaling"] = jobs.measure_scaling(inventory, workload, args.reps, progress)
        if "accuracy" in only:
            accuracy = ACCURACY_QUICK if args.quick else ACCURACY
            data["powersgd_accuracy"] = jobs.measure_powersgd_accuracy(
                inventory, accuracy, progress
            )
        if "launcher" in only:
            data["launcher"] = jobs.measure_launcher(inventory, FIRST_STEP, args.reps, progress)
        containers = None  # 2 nodes provisioned for jobs in containers, once for both
        if {"editloop", "image", "dependencies", "stragglers"} & set(only):
            containers = measure.provision_containers(inventory, args.training_image, progress)
        if "editloop" in only:
            assert containers is not None  # provisioned above for this section
            data["edit_loop"] = jobs.measure_edit_loop(containers, args.reps, progress)
        if "dependencies" in only:
            assert containers is not None  # provisioned above for this section
            data["dependencies"] = jobs.measure_dependencies(containers, args.reps, progress)
        if "stragglers" in only:
            assert containers is not None  # provisioned above for this section
            train = Path(sys.executable).parent / "train"
            data["stragglers"] = latency.measure_latency(
                containers,
                config,
                args.link,
                args.reps,
                progress,
                train,
                args.out / "stragglers",
                args.quick,
            )
        if "slurm" in only:
            data["slurm"] = jobs.measure_slurm(inventory, FIRST_STEP, args.reps, progress)
        if "fsdp" in only:
            steps = FSDP_STEPS_QUICK if args.quick else FSDP_STEPS
            data["fsdp"] = jobs.measure_fsdp(inventory, steps, args.reps, progress)
        if "image" in only:
            assert containers is not None  # provisioned above for this section
            image = load(containers).training_image
            data["image"] = shipping.measure_image(containers, image, args.image_reps, progress)
        if "ft" in only:  # before the hang's fourth node, a spare that would take node3's place
            three = measure.provision_containers(inventory, args.training_image, progress, nodes=3)
            train = Path(sys.executable).parent / "train"
            data["ft"] = ft.measure_ft(three, config, nnodes, args.link, args.reps, progress, train)
        four = None  # 4 nodes provisioned for jobs in containers
        if "hang" in only:
            four = measure.provision_containers(inventory, args.training_image, progress, nodes=4)
            data["hang"] = hang.measure_hang(four, args.reps, progress)
        if "lock" in only:  # on the 4 nodes as they are: the probe reads what it finds
            data["lock"] = lock.measure_lock(inventory, args.reps, progress)
        if "nodeloss" in only:  # last: it kills node3 (and brings it back)
            # In the training image, as jobs run on real clusters: the hang section's 4 nodes
            # when it ran (the fourth a spare), else the 3 provisioned here.
            nodes = four or measure.provision_containers(
                inventory, args.training_image, progress, nodes=3
            )
            train = Path(sys.executable).parent / "train"
            data["replication"] = nodeloss.measure_replication(nodes, args.reps, progress, train)
            data["nodeloss"] = nodeloss.measure_node_loss(
                nodes, config, nnodes, args.link, args.reps, progress, train
            )
    finally:
        sim.down(config)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # Started in the background by a shell without job control (`bench ... &` in a
        # script, nohup): SIGINT ignored, and every launcher it starts would ignore the Ctrl-C
        # section 19 stops its jobs with (they ran on, and the next job was refused: the port
        # still theirs). A handler of our own is reset to the default in each child.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return at_the_edge(_run, args)


def _run(args: argparse.Namespace) -> int:
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
