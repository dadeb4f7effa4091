"""`cluster`: check an inventory, and build, ship and bootstrap what its nodes need.

A thin edge: parse arguments, call the plain functions in cluster.inventory and its neighbours,
print, and turn a UserError into one `Error: ...` line with a non-zero exit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torch_multinode.cluster import autodetect, engine, inventory_read
from torch_multinode.cluster.errors import ArgumentParser, UserError, at_the_edge, shown
from torch_multinode.cluster.inventory import DEFAULT_TRAINING_IMAGE, NODES_GROUP
from torch_multinode.cluster.inventory_checks import GROUP_HELP, is_word

INVENTORY_HELP = (
    "the Ansible inventory: a YAML or INI file (group_vars/ and host_vars/ beside it count) or "
    "a directory of them"
)


def _nodes_options(command: argparse.ArgumentParser) -> None:
    """-i, --group and -n: which inventory, which of its groups, its first N nodes."""
    command.add_argument("-i", "--inventory", help=INVENTORY_HELP)
    command.add_argument("--group", default=NODES_GROUP, help=GROUP_HELP)
    command.add_argument("-n", "--nnodes", help="the first N nodes (default: all)")


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="cluster",
        description="Inventory checks, the training image, data, bootstrap and Slurm's queue.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = commands.add_parser(
        "check",
        help="validate an inventory (and NNODES) and list its hosts",
        description="Validate an inventory before anything acts on it. Exit 0 when it is "
        "valid; otherwise one 'Error:' line naming the host and the field, and exit 2.",
    )
    check.add_argument("-i", "--inventory", help=INVENTORY_HELP)
    check.add_argument("--group", default=NODES_GROUP, help=GROUP_HELP)
    check.add_argument("-n", "--nnodes", help="how many nodes the job will use (default: all)")

    image = commands.add_parser(
        "image",
        help="build the training image (CUDA where nvidia-smi works, else the CPU twin)",
        description="Build the training image from docker/Dockerfile and print what it holds.",
    )
    image.add_argument(
        "--kind",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cuda: the pinned torch wheels with CUDA, cuDNN, NCCL and triton; cpu: the CPU twin "
        "(the simulated cluster); auto: CUDA when this machine has a working nvidia-smi, else "
        "CPU (default)",
    )
    image.add_argument(
        "--base-image",
        default=None,
        help="build on this image's own torch instead of the pinned wheels (e.g. NVIDIA's "
        "nvcr.io/nvidia/pytorch:YY.MM-py3); refused when its torch is older than the project's "
        "minimum",
    )
    image.add_argument("--tag", default=DEFAULT_TRAINING_IMAGE, help="default: %(default)s")
    image.add_argument(
        "-i",
        "--inventory",
        default=None,
        help="build what this inventory's jobs need: its training_image, CUDA if any node has "
        "GPUs; nothing when launch_mode is host",
    )
    image.add_argument("--group", default=NODES_GROUP, help=GROUP_HELP)

    data = commands.add_parser(
        "data",
        help="copy a dataset directory into every node's data_root",
        description="Mirror a dataset directory into DATA_ROOT/NAME on every node (NAME: the "
        "directory's own name), all nodes at once; only what changed travels, so a second run "
        "with nothing changed sends no file. On each node the changed files are put in place "
        "only once all have arrived (they need their size free beside the copy), so a copy "
        "stopped part way leaves the node's previous copy as it was. Jobs then use --data-dir "
        "NAME (relative paths resolve under data_root, on the nodes and in the containers).",
    )
    _nodes_options(data)
    data.add_argument("source", nargs="?", help="the dataset directory (make data SRC=dir)")
    ship = commands.add_parser(
        "ship",
        help="bring the training image to every node that lacks the controller's image ID",
        description="Ship the inventory's training image to its nodes: through the controller's "
        "registry (set up by make provision; each node fetches only the layers it lacks, all "
        "nodes at once), or, when no registry answers, streamed (docker save | ssh | "
        "docker load), which is said with the reason. A line per node every few seconds tells "
        "how far it has come; at the end every node holds the controller's image ID.",
    )
    _nodes_options(ship)
    ship.add_argument("--image", help="ship this image instead of the inventory's training_image")
    ship.add_argument(
        "--via",
        choices=("auto", "registry", "stream"),
        default="auto",
        help="auto (default): the registry when it answers, else the stream",
    )

    lock = commands.add_parser(
        "lock",
        help="record each node's versions in the version lock beside the inventory",
        description="Probe every node at once and record its kernel, NVIDIA driver, Docker, "
        "training image and torch (with CUDA and NCCL) in versions.lock.json beside the "
        "inventory, as netcheck does once it passes; make provision runs it last, and it says "
        "what the nodes' auto values (compute_interface, gpus) are found to be. make train "
        "then refuses a node that changed since (ALLOW_DRIFT=1 runs anyway).",
    )
    _nodes_options(lock)

    hostfile = commands.add_parser(
        "hostfile",
        help="print the inventory as a DeepSpeed/Horovod/MPI hostfile ('name slots=N')",
        description="One 'NAME slots=N' line per node in rank order, N being its GPUs (its "
        "cuda_visible_devices selection where set; 1 on a node without GPUs; asked of the node "
        "over SSH where the inventory says gpus: auto). The names are "
        "the inventory's, which provisioning makes every node resolve to its compute address. "
        "For launchers typed by hand: deepspeed --hostfile, horovodrun -hostfile, mpirun "
        "--hostfile.",
    )
    _nodes_options(hostfile)

    ready = commands.add_parser(
        "ready",
        help="whether make provision can use the nodes: host keys known, key login, sudo",
        description="What 'make provision' runs before its playbook: each node is reached the "
        "way Ansible reaches it (SSH in batch mode, the host key checked against the "
        "inventory's known_hosts, the inventory's key and user), then 'sudo -n true'. Exit 0 "
        "when every node is ready; otherwise one line per node naming what it lacks, with "
        "make bootstrap as the remedy, and exit 1.",
    )
    ready.add_argument("-i", "--inventory", help=INVENTORY_HELP)
    ready.add_argument("--group", default=NODES_GROUP, help=GROUP_HELP)
    ready.add_argument(
        "--ask-become-pass",
        action="store_true",
        help="the playbook asks for sudo's password (ansible-playbook -K): sudo need not be "
        "passwordless",
    )

    boot = commands.add_parser(
        "bootstrap",
        help="first contact with freshly installed nodes: key login, host keys, sudo",
        description="Once, before 'make provision', on machines that have only a user with a "
        "password: makes the controller's ed25519 key pair if there is none, confirms each "
        "node's SSH host key by its fingerprint and adds it to the inventory's known_hosts "
        "file, logs in once with the password to install the key and a passwordless-sudo "
        "drop-in (checked by visudo -c), then proves key login and sudo. The password is "
        "asked once (again only for a node that refuses it) and never stored, shown or put on "
        "a command line. A second run asks nothing and changes nothing. Exit 0 when every node "
        "is ready for provisioning; otherwise one line per failed node and exit 1.",
    )
    boot.add_argument("-i", "--inventory", help=INVENTORY_HELP)
    boot.add_argument("--group", default=NODES_GROUP, help=GROUP_HELP)
    boot.add_argument(
        "--fingerprints",
        default=None,
        metavar="FILE",
        help="expected host-key fingerprints, one 'NODE SHA256:...' line per node (NODE: the "
        "inventory name or address), for unattended runs; without it each key is confirmed at "
        "a prompt",
    )
    boot.add_argument(
        "--disable-password-login",
        action="store_true",
        help="once key login and sudo are proven on a node, turn SSH password login off there "
        "(a drop-in checked by sshd -t)",
    )
    boot.add_argument(
        "--password-stdin",
        action="store_true",
        help="read the login password from the first line of standard input instead of asking",
    )

    queue = commands.add_parser(
        "queue",
        help="Slurm's queue (scheduler: slurm): the jobs, their state and nodes",
        description="squeue on Slurm's controller (the inventory's first node), over SSH.",
    )
    queue.add_argument("-i", "--inventory", help=INVENTORY_HELP)
    queue.add_argument("--group", default=NODES_GROUP, help=GROUP_HELP)
    cancel = commands.add_parser(
        "cancel",
        help="cancel a Slurm job (scheduler: slurm)",
        description="scancel on Slurm's controller (the inventory's first node), over SSH.",
    )
    cancel.add_argument("-i", "--inventory", help=INVENTORY_HELP)
    cancel.add_argument("--group", default=NODES_GROUP, help=GROUP_HELP)
    cancel.add_argument("job", nargs="?", help="the job's ID, as make queue shows it")

    return parser


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    if args.command == "check":
        inventory = inventory_read.load(args.inventory, args.group)
        hosts = inventory.first(args.nnodes).hosts
        print(
            f"inventory {inventory.path}: valid, {len(inventory.hosts)} host(s), "
            f"compute subnet {inventory.compute_subnet}, rendezvous port "
            f"{inventory.rendezvous_port}"
        )
        for rank, host in enumerate(hosts):
            role = "master" if rank == 0 else "worker"
            interface, gpus = autodetect.shown(host)
            print(
                f"  node_rank {rank}  {host.name:<16} ssh {host.ssh_address:<16} compute "
                f"{host.compute_ip} ({interface})  gpus {gpus}  {role}"
            )
        for line in _defaults_said(hosts, inventory.compute_subnet):
            print(line)
        return 0

    if args.command == "image":
        from torch_multinode.provision import images

        kind, tag = args.kind, args.tag
        if not is_word(tag):  # the inventory's training_image is held to the same rule
            raise UserError(f"--tag {shown(tag)} is not an image name")
        if args.base_image is not None and not is_word(args.base_image):
            raise UserError(f"--base-image {shown(args.base_image)} is not an image name")
        if args.inventory:
            inventory = inventory_read.load(args.inventory, args.group)
            if inventory.launch_mode != "container":
                print(
                    f"inventory {inventory.path}: launch_mode {inventory.launch_mode}, no "
                    "training image needed."
                )
                return 0
            tag = inventory.training_image
            engine.require_engine()  # the build's first need, checked before the nodes are asked
            inventory, platform = _nodes_platform(inventory, found=kind == "auto")
            if kind == "auto":
                kind = "cuda" if any(h.gpus > 0 for h in inventory.hosts) else "cpu"
        else:
            platform = None  # this machine's own, as its engine builds by default
        built = images.build(
            kind, tag, progress=_progress, base_image=args.base_image or None, platform=platform
        )
        done = "Up to date:" if built.up_to_date else f"Built in {built.seconds:.0f} s:"
        pinned = f", {platform}" if platform else ""
        print(f"{built.tag} ({built.kind}{pinned}, {built.image_id[:19]}). {done}")
        for name, version in images.versions(built.tag, gpus=images.gpu_present()).items():
            print(f"  {name}: {version}")
        return 0

    if args.command == "data":
        return _data(args)
    if args.command == "ship":
        return _ship(args)
    if args.command == "lock":
        return _lock(args)
    if args.command == "bootstrap":
        return _bootstrap(args)
    if args.command == "ready":
        return _ready(args)
    if args.command in ("queue", "cancel"):
        return _slurm(args)
    if args.command == "hostfile":
        inventory = inventory_read.load(args.inventory, args.group).first(args.nnodes)
        hosts = _found_on_nodes(inventory).hosts  # slots: the GPUs of a `gpus: auto` node
        for host in hosts:
            print(f"{host.name} slots={slots(host)}")
        return 0

    raise AssertionError(f"unhandled command {args.command!r}")  # argparse allows no other


def _nodes_platform(inventory, found: bool = False):
    """The Docker platform the inventory's nodes share, asked over SSH (provision.platforms),
    and, with `found`, the inventory with its auto values found on the nodes first (said)."""
    from torch_multinode.cluster.execution import SshNodes
    from torch_multinode.provision import platforms

    nodes = SshNodes(inventory)
    try:
        if found:
            inventory = _found_on_nodes(inventory, nodes)
        platform = platforms.nodes_platform(inventory.hosts, nodes)
    finally:
        nodes.close()
    _progress(f"The {len(inventory.hosts)} node(s) run {platform}: the image is built for it.")
    return inventory, platform


def _found_on_nodes(inventory, nodes=None):
    """The inventory with its auto values found on the nodes (cluster.autodetect), each said on
    standard error; the same inventory where it has none, without a word or a connection."""
    if not inventory.unresolved:
        return inventory
    from torch_multinode.cluster.execution import SshNodes

    own = nodes is None
    nodes = SshNodes(inventory) if own else nodes
    try:
        resolved = autodetect.resolve(inventory, nodes)
    finally:
        if own:
            nodes.close()
    for line in resolved.lines():
        _progress(line)
    return resolved.inventory


def _defaults_said(hosts, subnet) -> list[str]:
    """What make check-inventory says below the hosts of the values not given as they are."""
    lines = []
    defaulted = [h.name for h in hosts if h.compute_ip_default]
    if defaulted:
        lines.append(
            f"compute_ip of {', '.join(defaulted)}: the host's ansible_host (no compute_ip "
            f"given, and that address is in compute_subnet {subnet})"
        )
    for field, what in (
        ("compute_interface", "the interface that holds compute_ip"),
        ("gpus", "nvidia-smi's count"),
    ):
        named = [h.name for h in hosts if field in h.auto]
        if named:
            lines.append(
                f"{field} of {', '.join(named)}: auto, {what}, {autodetect.FOUND_AT_PROVISION} "
                "on the node (and by netcheck and each job)"
            )
    return lines


def slots(host) -> int:
    """Processes a hand-typed launcher should start on `host`: one per GPU it may use."""
    if host.visible_gpus is not None:
        return len(host.visible_gpus)
    return host.gpus or 1


def _slurm(args: argparse.Namespace) -> int:
    from torch_multinode.cluster import slurm
    from torch_multinode.cluster.execution import SshNodes

    if args.command == "cancel" and not args.job:
        raise UserError("no job given", hint="make cancel JOB=<an ID from make queue>")
    inventory = inventory_read.load(args.inventory, args.group)
    slurm.require(inventory)
    nodes = SshNodes(inventory)
    try:
        if args.command == "queue":
            print("\n".join(slurm.queue(inventory, nodes)))
        else:
            print(slurm.cancel(inventory, nodes, args.job))
    finally:
        nodes.close()
    return 0


def _ready(args: argparse.Namespace) -> int:
    from torch_multinode.provision import bootstrap

    inventory = inventory_read.load(args.inventory, args.group)
    missing = bootstrap.not_ready(inventory, sudo_without_password=not args.ask_become_pass)
    group = f" GROUP={args.group}" if args.group != NODES_GROUP else ""
    for host in inventory.hosts:
        if host.name in missing:
            print(
                f"Error: host '{host.name}' ({host.ssh_address}) is not ready for provisioning: "
                f"{missing[host.name]} (try make bootstrap INVENTORY={inventory.path}{group})",
                file=sys.stderr,
            )
    if missing:
        return 1
    sudo = "" if args.ask_become_pass else " and passwordless sudo"
    print(f"{len(inventory.hosts)} node(s) ready for provisioning: key login{sudo}.", flush=True)
    return 0


def _bootstrap(args: argparse.Namespace) -> int:
    from torch_multinode.provision import bootstrap, keys

    inventory = inventory_read.load(args.inventory, args.group)
    fingerprints = Path(args.fingerprints) if args.fingerprints else None
    prompter = keys.Prompter(password_stdin=args.password_stdin)
    print(f"Bootstrap of {len(inventory.hosts)} node(s) of {inventory.path}:", flush=True)
    outcome = bootstrap.bootstrap(
        inventory,
        prompter,
        lambda line: print(line, flush=True),
        fingerprints,
        args.disable_password_login,
    )
    print("Summary:")
    for node in outcome.nodes:
        if not node.ok:
            state = "FAILED"
        elif node.already:
            state = "already bootstrapped, nothing changed"
        else:
            state = "; ".join(node.done) or "ready, nothing changed"
        print(f"  {node.host.name:<12} {state}")
    failed = [node for node in outcome.nodes if not node.ok]
    for node in failed:
        print(
            f"Error: host '{node.host.name}' ({node.host.ssh_address}): {node.failed}",
            file=sys.stderr,
        )
    if failed:
        print(
            f"{len(failed)} of {len(outcome.nodes)} node(s) not bootstrapped; the others are "
            "ready. Fix what is named above and run make bootstrap again."
        )
        return 1
    print(
        f"All {len(outcome.nodes)} node(s) take key login and passwordless sudo. Next: "
        f"make provision INVENTORY={inventory.path}"
    )
    return 0


def _ship(args: argparse.Namespace) -> int:
    from torch_multinode.provision import ship, ship_progress

    inventory = inventory_read.load(args.inventory, args.group).first(args.nnodes)
    if inventory.launch_mode != "container" and args.image is None:
        print(f"Jobs of {inventory.path} run on the hosts (launch_mode: host): no image to ship.")
        return 0
    if args.image is not None and not is_word(args.image):
        raise UserError(f"--image {shown(args.image)} is not an image name")
    shipment = ship.ship(inventory, args.image, args.via, lambda line: print(line, flush=True))
    print(ship_progress.summary(shipment))
    return 0


def _lock(args: argparse.Namespace) -> int:
    from torch_multinode.cluster import version_lock
    from torch_multinode.cluster.execution import SshNodes

    inventory = inventory_read.load(args.inventory, args.group).first(args.nnodes)
    nodes = SshNodes(inventory)
    try:
        # make provision's last step: what its auto values are, now that the nodes are ready
        _found_on_nodes(inventory, nodes)
        path = version_lock.lock_nodes(inventory, nodes)
    finally:
        nodes.close()
    print(f"Each node's versions locked in {path} (make train checks them)")
    return 0


def _data(args: argparse.Namespace) -> int:
    from torch_multinode.cluster import datasets, sync

    if not args.source:
        raise UserError("no dataset directory given", hint="make data SRC=path/to/dataset")
    inventory = inventory_read.load(args.inventory, args.group)
    hosts = inventory.first(args.nnodes).hosts
    tree = sync.data_tree(Path(args.source))
    destination = f"{inventory.data_root}/{sync.safe_name(tree.root.name)}"
    print(
        f"Copying {tree.root} ({len(tree.files)} files, {sync.human(tree.size)}) to "
        f"{destination} on {len(hosts)} node(s)...",
        flush=True,
    )
    sent = datasets.push_dataset(
        inventory, hosts, tree, destination, lambda line: print(line, flush=True)
    )
    for name, done in sent.items():
        print(
            f"  {name:<12} {done.files} file(s) sent, {sync.human(done.bytes_sent)} over the "
            f"wire, in {done.seconds:.1f} s"
        )
    total = sum(done.bytes_sent for done in sent.values())
    changed = sum(done.files for done in sent.values())
    print(
        f"Done: {changed} file(s), {sync.human(total)} sent in all"
        + ("" if changed else " (every node already had it)")
        + "."
    )
    print(
        f"Use it in a job as --data-dir {destination.rsplit('/', 1)[1]} ({destination} on every node)."
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return at_the_edge(run, args)


if __name__ == "__main__":
    sys.exit(main())
