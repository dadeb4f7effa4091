"""`sim3`: one cluster of three simulated nodes for the `node_loss` group (tests/conftest.py),
whose jobs run in the CPU twin (TEST_IMAGE): under `make test-all`, Slurm set up from the
inventory on them first (tests/ansible/test_slurm.py, collected first, an extended test), then
the node-loss and FT=1 tests (tests/training/test_node_loss.py, test_ft_nodes.py), which kill
its nodes and start them again. One cluster for all of them: Slurm's packages are installed by
its role once, not again on nodes of their own (docs/ci-time.md). A pytest plugin
(tests/conftest.py names it), so that the modules share one instance: session-scoped, removed
when the worker ends. `jobs_cluster` makes such a cluster of any size (the `fsdp` group's pair,
tests/training/test_fsdp_cluster.py)."""

from __future__ import annotations

import warnings

import pytest


def jobs_cluster(sim_factory, tmp_path_factory, nnodes: int, tmpfs=()):
    """`nnodes` nodes whose jobs run in the CPU twin (TEST_IMAGE), readied by the roles jobs
    need, not by the whole playbook (the `image` group's cluster proves that). Their engines
    start with the twin already in their store, as hard links to this machine's copy
    (tests/shared_layers.py); a node whose engine then does not hold it gets it streamed
    (provision/ship.py). `tmpfs`: SimConfig.tmpfs. (cluster, its inventory with launch_mode:
    container, /shared mounted into the jobs)."""
    # Imported here: these modules import tests.conftest, which names this plugin.
    from tests.ansible.conftest import ansible_playbook, read_inventory, write_inventory
    from tests.conftest import TEST_IMAGE, build_training_image
    from tests.helpers import on_node
    from tests.shared_layers import link_image
    from torch_multinode.cluster.inventory_read import load
    from torch_multinode.provision import ship

    cluster = sim_factory.up(nnodes, tmpfs=tmpfs)
    indexes = range(1, nnodes + 1)
    document = read_inventory(cluster.config.inventory_path)
    document["all"]["vars"].update(
        launch_mode="container", training_image=TEST_IMAGE, container_mounts=["/shared"]
    )
    inventory = write_inventory(document, tmp_path_factory.mktemp("jobs") / "inventory.yml")
    image = build_training_image(tmp_path_factory)  # waits while another worker builds it
    why = link_image(image.tag, [cluster.config.volume(index) for index in indexes])
    if why is not None:
        warnings.warn(f"the twin's layers not linked ({why}): loaded instead", stacklevel=1)
    # What jobs in containers need of `make provision`: the engine, NCCL's configuration
    # file, the checkpoint and data directories.
    run = ansible_playbook(inventory, "--tags", "docker,nccl_config,job_storage")
    assert run.returncode == 0, run.describe()
    nodes = load(inventory)
    lacking = [
        host
        for index, host in zip(indexes, nodes.hosts, strict=True)
        if on_node(
            cluster, index, f"docker image inspect --format '{{{{.Id}}}}' {image.tag}", False
        ).strip()
        != image.image_id
    ]
    if lacking:  # streamed as `make ship` does when no registry answers
        ship.stream(nodes, lacking, image.tag, emit=lambda _: None)
    return cluster, inventory


@pytest.fixture(scope="session")
def sim3(sim_factory, tmp_path_factory):
    """3 nodes whose jobs run in the CPU twin (jobs_cluster)."""
    cluster, inventory = jobs_cluster(sim_factory, tmp_path_factory, 3)
    yield cluster, inventory
    sim_factory.down(cluster)
