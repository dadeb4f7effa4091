"""The one inventory's data model: Host and Inventory, each field resolved and checked, with
the defaults an inventory may leave out. An inventory is an Ansible YAML file that
provisioning, netcheck and the launcher all read (inventory.example.yml):

    all:
      vars:                       # cluster-wide
        compute_subnet: 192.168.1.0/24
        rendezvous_port: 29500
      children:
        nodes:
          hosts:                  # in rank order: the first host is the master (rank 0)
            pc1:
              ansible_host: 192.168.1.10    # where SSH reaches the node
              compute_ip: 192.168.1.10      # the address training traffic uses
              compute_interface: enp3s0     # or auto: the interface that holds compute_ip
              gpus: 1                       # or auto: nvidia-smi's count on the node

compute_ip may be left out where ansible_host is an address inside compute_subnet: it is then
that address. `auto` values are found on the node (cluster/autodetect.py) by the commands that
reach the nodes (provision, netcheck, the launcher); the checks leave them None.
Variables merge the way Ansible merges them: all.vars, then nodes.vars, then the host's own.

The inventory flows one way, read -> check -> model: cluster/inventory_read.py reads a file
into a document (YAML, or ansible-core where only Ansible resolves it) and is where an
inventory is loaded (load, parse); cluster/inventory_validate.py checks that document whole, in
one pass, and assembles the Inventory (every problem one `Error:` line naming the host and the
field, raised together: InventoryErrors where there were several; a name within a typo of one
the project reads is a `Warning:` line); cluster/inventory_checks.py holds the field
vocabulary, each value's check and the gathering of problems. This module imports none of
them: whatever only needs a Host or an Inventory imports this one alone.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, replace
from pathlib import Path

from torch_multinode.cluster import trust
from torch_multinode.cluster.errors import UserError

# The group whose hosts are the nodes unless --group names another.
NODES_GROUP = "nodes"
# Node-local directories a job keeps, the same on every node and mounted at the same path in
# its container (ansible/roles/job_storage makes them; a test keeps its defaults equal).
DEFAULT_CHECKPOINT_ROOT = "/var/lib/torch-multinode/checkpoints"
DEFAULT_DATA_ROOT = "/var/lib/torch-multinode/data"
DEFAULT_WORKDIR_ROOT = "/var/lib/torch-multinode/work"
DEFAULT_RENDEZVOUS_PORT = 29500
DEFAULT_TRAINING_IMAGE = "torch-multinode/train:latest"
# The controller's image registry (ansible/roles/image_registry, provision/ship.py).
DEFAULT_IMAGE_REGISTRY_PORT = 5000
# The torchft lighthouse of an FT=1 job, on the controller (launch.lighthouse).
DEFAULT_LIGHTHOUSE_PORT = 29510
LAUNCH_MODES = ("container", "host")
# How jobs reach the nodes: the launcher over SSH, or Slurm from the distribution's packages.
SCHEDULERS = ("ssh", "slurm")


@dataclass(frozen=True)
class Mount:
    """A node directory mounted into every job's container at the same path."""

    path: str
    read_only: bool = False


@dataclass(frozen=True)
class Host:
    """One node, with every field the project uses resolved and checked."""

    name: str
    ssh_address: str
    ssh_port: int
    ssh_user: str | None
    ssh_key: Path | None
    compute_ip: ipaddress.IPv4Address
    compute_interface: str | None
    """The NIC that holds compute_ip; None where the inventory says auto, until
    cluster.autodetect.resolve has found it on the node."""
    gpus: int | None
    """None where the inventory says auto, until cluster.autodetect.resolve has asked the node."""
    python: str = "python3"
    """The interpreter on the node that has torch (host mode; jobs in a container use its own)."""
    visible_gpus: tuple[int, ...] | None = None
    """This node's own GPU selection (host var cuda_visible_devices), over the job's GPUS."""
    nccl_ib_hca: str | None = None
    """The RDMA devices NCCL may use for training (NCCL_IB_HCA's form); None: all of them."""
    auto: frozenset[str] = frozenset()
    """The fields the inventory leaves to the node (`auto`, of AUTO_FIELDS): None until found
    there, then the values found, still named here for the outputs that say so."""
    compute_ip_default: bool = False
    """compute_ip is the host's ansible_host: the inventory gives none, and that address is in
    compute_subnet."""

    @property
    def gpu_count(self) -> int:
        """gpus, once known: what counts a node's GPUs (a job, netcheck's later stages) runs
        after cluster.autodetect has found those the inventory leaves to the node."""
        assert self.gpus is not None, f"host '{self.name}': gpus read before it was found"
        return self.gpus


@dataclass(frozen=True)
class Inventory:
    path: Path
    hosts: tuple[Host, ...]
    compute_subnet: ipaddress.IPv4Network
    rendezvous_port: int
    known_hosts: Path | None
    launch_mode: str = "container"
    """'container': jobs run in training_image on each node; 'host': with each node's Python."""
    training_image: str = DEFAULT_TRAINING_IMAGE
    container_memlock: str = "unlimited"
    """Locked-memory limit for the training container: 'unlimited' (what RDMA wants) or bytes."""
    checkpoint_root: str = DEFAULT_CHECKPOINT_ROOT
    """Node-local directory for checkpoints; a relative --checkpoint-dir lands under it."""
    data_root: str = DEFAULT_DATA_ROOT
    """Node-local directory for datasets; a relative --data-dir lands under it."""
    workdir_root: str = DEFAULT_WORKDIR_ROOT
    """Where the project's code is synced on each node."""
    container_mounts: tuple[Mount, ...] = ()
    """More node directories for the job's container (inventory: "PATH" or "PATH:ro")."""
    group: str = NODES_GROUP
    """The Ansible group whose hosts are the nodes (--group, make GROUP=)."""
    scheduler: str = "ssh"
    """'ssh': the launcher starts jobs over SSH; 'slurm': provisioning also sets Slurm up."""
    image_registry: bool = True
    """Whether the training image travels through the controller's registry (by layers)."""
    image_registry_port: int = DEFAULT_IMAGE_REGISTRY_PORT
    image_base_from_nodes: bool = False
    """Each node pulls the image's base (e.g. NVIDIA's, from nvcr.io) itself; the controller
    sends only the layers above it."""
    lighthouse_port: int = DEFAULT_LIGHTHOUSE_PORT
    """The controller's port for an FT=1 job's torchft lighthouse, which every node reaches."""

    @property
    def known_hosts_file(self) -> Path:
        """The file every SSH client of ours checks the nodes' host keys against (paramiko,
        OpenSSH for rsync, bootstrap): ssh_known_hosts_file, else ~/.ssh/known_hosts."""
        return trust.known_hosts_file(self.known_hosts)

    @property
    def unresolved(self) -> tuple[Host, ...]:
        """The hosts with an `auto` value not yet found on the node (cluster.autodetect)."""
        return tuple(h for h in self.hosts if h.compute_interface is None or h.gpus is None)

    @property
    def master(self) -> Host:
        """Rank 0's node: the first host, where the rendezvous store runs."""
        return self.hosts[0]

    def first(self, nnodes: object) -> Inventory:
        """The same inventory narrowed to its first `nnodes` hosts, in rank order (None or '':
        all of them), checked once here; a job, netcheck or a copy then takes it whole."""
        if nnodes is None or nnodes == "":
            return self
        return replace(self, hosts=self.hosts[: check_nnodes(nnodes, len(self.hosts), self.path)])


def check_nnodes(nnodes: object, available: int, path: Path | str) -> int:
    if isinstance(nnodes, str):
        try:
            nnodes = int(nnodes)
        except ValueError:
            raise UserError(f"NNODES={nnodes!r} is not a whole number") from None
    if not isinstance(nnodes, int) or isinstance(nnodes, bool):
        raise UserError(f"NNODES={nnodes!r} is not a whole number")
    if nnodes < 1:
        raise UserError(f"NNODES={nnodes} is below 1", hint="NNODES=1 or more")
    if nnodes > available:
        raise UserError(
            f"NNODES={nnodes} but inventory {path} lists {available} host(s)",
            hint=f"NNODES={available} or add hosts to the inventory",
        )
    return nnodes
