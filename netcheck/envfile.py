"""The environment netcheck hands to the launcher: per node, the variables that pin NCCL and gloo
to the compute interface.

    {"nodes": {"node1": {"NCCL_SOCKET_IFNAME": "=eth1", "GLOO_SOCKET_IFNAME": "eth1",
                         "NCCL_IB_DISABLE": "1"}, ...},
     "written_at": "2025-01-01T12:00:00+00:00"}

"=eth1" is NCCL's exact-match form: a bare "eth1" would also match eth10, eth11, ...
NCCL_IB_DISABLE is present only on nodes without InfiniBand devices; where a job's nodes are
mixed, on all of them (one_network).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from torch_multinode.cluster import files
from torch_multinode.cluster.errors import UserError

FILENAME = "netcheck-env.json"


def default_path(inventory_path: str | os.PathLike) -> Path:
    """Next to the inventory file (inside an inventory directory): the launcher finds it from
    the same INVENTORY."""
    return files.beside_inventory(inventory_path, FILENAME)


def write(path: str | os.PathLike, nodes: dict[str, dict[str, str]]) -> Path:
    """Replace the file atomically, so a launcher never reads half of it."""
    return files.write_nodes(
        path, nodes, "netcheck env file", hint="--env-file with a writable path"
    )


def _text(value: object, empty: bool = False) -> bool:
    """A string that can go into an environment variable and a command line as it is: no NUL,
    newline or other control character."""
    return isinstance(value, str) and (empty or value != "") and value.isprintable()


def load(path: str | os.PathLike) -> dict[str, dict[str, str]]:
    """Node name -> environment variables, as netcheck last wrote them."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(
            f"the netcheck env file {path} does not exist",
            hint="'make netcheck' first: it writes the file next to the inventory",
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(
            f"the netcheck env file {path} cannot be read: {exc}",
            hint="'make netcheck' again to rewrite it",
        ) from None
    except (ValueError, RecursionError) as exc:
        # Not JSONDecodeError: an int of over 4300 digits, or arrays nested beyond the stack.
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).split(";")[0]
        raise UserError(
            f"the netcheck env file {path} cannot be read: {reason}",
            hint="'make netcheck' again to rewrite it",
        ) from None
    nodes = data.get("nodes") if isinstance(data, dict) else None
    if not isinstance(nodes, dict) or not all(
        _text(name)
        and isinstance(env, dict)
        and all(_text(k) and "=" not in k and _text(v, empty=True) for k, v in env.items())
        for name, env in nodes.items()
    ):
        raise UserError(
            f"the netcheck env file {path} has no valid 'nodes' mapping of name -> variables",
            hint="'make netcheck' again to rewrite it",
        )
    return {name: dict(env) for name, env in nodes.items()}


def one_network(nodes: dict[str, dict[str, str]]) -> tuple[dict[str, dict[str, str]], list[str]]:
    """The settings with one NCCL network for all of `nodes` (a job's, or netcheck's): where some
    nodes have no RDMA device (NCCL_IB_DISABLE=1) and others have one, NCCL would take
    InfiniBand/RoCE on these and TCP sockets on those, and the ranks would wait for each other
    in NCCL's set-up for ever (NVIDIA/nccl#234; NCCL checks no agreement between ranks). Then
    every node gets NCCL_IB_DISABLE=1. Also the nodes without one, when that changed anything."""
    without = sorted(name for name, env in nodes.items() if env.get("NCCL_IB_DISABLE") == "1")
    if not without or len(without) == len(nodes):
        return nodes, []
    return {name: {**env, "NCCL_IB_DISABLE": "1"} for name, env in nodes.items()}, without


def one_network_note(nodes: dict[str, dict[str, str]], without: list[str]) -> str:
    """What one_network decided, in one line."""
    have = sorted(set(nodes) - set(without))
    return (
        f"NCCL uses TCP sockets on every node: {', '.join(without)} "
        f"{'has' if len(without) == 1 else 'have'} no RDMA device, and one job's nodes must "
        f"share one network (InfiniBand/RoCE stays unused on {', '.join(have)})"
    )
