"""`make data`: a dataset mirrored into DATA_ROOT/NAME on every node, each node's copy replaced
all at once (cluster.sync's rsync with `all_at_once`), and what a stopped copy leaves said."""

from __future__ import annotations

from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.cluster.sync import Emit, Sent, Tree, push_each, raise_first_failure

PARTIAL_DIR = ".~tmp~"  # rsync's holding directory under --delay-updates


def push_dataset(
    inventory: Inventory,
    hosts: tuple[Host, ...] | list[Host],
    tree: Tree,
    destination: str,
    emit: Emit = print,
) -> dict[str, Sent]:
    """`tree` mirrored to `destination` on every host, all at once on each (see
    cluster.sync.rsync_command). A node whose copy fails keeps the copy it had, said with the
    nodes that got the new one; Ctrl-C says which copy each node may hold before it ends the
    command."""
    try:
        done = push_each(inventory, hosts, tree, destination, emit, "data", all_at_once=True)
    except KeyboardInterrupt:
        emit(
            f"[data] stopped: each node's {destination} is the new copy where its transfer had "
            "ended, else the one it had before (the new files are put in place only once all "
            f"have arrived; those that did wait in {destination}/{PARTIAL_DIR}): run the same "
            "command again before a job reads it"
        )
        raise
    failed = [name for name, outcome in done.items() if isinstance(outcome, str)]
    if failed:
        new = [name for name in done if name not in failed]
        after = f". {', '.join(failed)} kept the copy {'it' if len(failed) == 1 else 'they'} had"
        after += f" (the new files wait in {destination}/{PARTIAL_DIR}, put in place only once"
        after += " all have arrived)"
        if new:
            after += f"; {', '.join(new)} got the new one: the nodes differ until it succeeds"
        raise_first_failure(done, tree, destination, after)
    return done  # type: ignore[return-value]
