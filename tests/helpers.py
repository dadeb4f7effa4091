"""What several test modules share: the inventory builder, the launcher's test scripts, and
looks at what a job left on the simulated nodes. Test modules import from here (and from
tests/fakes.py and the conftest files), never from each other."""

from __future__ import annotations

from pathlib import Path

import yaml

from cluster.inventory import Inventory, parse
from cluster.remote import Remote, on_all

SCRIPTS = Path(__file__).parent / "training" / "launcher_scripts"
"""Training scripts the launcher's tests run (tutorial DDP, an endless all-reduce...)."""

MANAGEMENT_NET, COMPUTE_NET = "10.1.0", "10.7.0"
"""The addresses of built inventories: documentation only, nothing is ever sent to them."""


def node(index: int, **fields) -> dict:
    """One host's fields: SSH on 10.1.0.INDEX, compute on 10.7.0.INDEX over eth1, no GPU;
    `fields` add to or replace them."""
    return {
        "ansible_host": f"{MANAGEMENT_NET}.{index}",
        "compute_ip": f"{COMPUTE_NET}.{index}",
        "compute_interface": "eth1",
        "gpus": 0,
        **fields,
    }


def inventory_text(hosts: dict[str, dict], **cluster_vars) -> str:
    """An inventory in the project's layout: `cluster_vars` in all.vars (compute_subnet
    defaults to 10.7.0.0/24), `hosts` (name -> node(...)) in the nodes group, in rank order."""
    variables = {"compute_subnet": f"{COMPUTE_NET}.0/24", **cluster_vars}
    document = {"all": {"vars": variables, "children": {"nodes": {"hosts": hosts}}}}
    return yaml.safe_dump(document, sort_keys=False)


def inventory(
    hosts: dict[str, dict], path: str = "/nonexistent/inv.yml", **cluster_vars
) -> Inventory:
    """inventory_text(...) parsed and validated, as if read from `path`."""
    return parse(inventory_text(hosts, **cluster_vars), path)


def run_id_in(stdout: str) -> str:
    """The job's run ID, from the launcher's '[launcher] job ID: ...' line."""
    return stdout.split("[launcher] job ", 1)[1].split(":", 1)[0]


def leftovers(inventory: Inventory, run_id: str, hosts=None) -> dict[str, str]:
    """Per node: processes still carrying the run's marker, and listeners on the rendezvous port."""
    probe = (
        f"grep -lsaF TMN_RUN_ID={run_id} /proc/[0-9]*/environ | grep -v self; "
        f"ss -ltnH 'sport = :{inventory.rendezvous_port}'"
    )

    def look(host):
        with Remote.for_inventory(inventory, host) as remote:
            return remote.run(probe).stdout.strip()

    return on_all(hosts or inventory.hosts, look)
