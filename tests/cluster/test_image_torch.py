"""An image whose torch is older than the project's minimum is refused on the node, before
launch, naming the node and both versions: the node-side command run against a real engine."""

from __future__ import annotations

import subprocess
import uuid

import pytest

from tests import helpers
from torch_multinode.cluster import engine
from torch_multinode.cluster.versions import TORCH_LABEL
from torch_multinode.launch import image_check
from torch_multinode.sim import nodes as sim


def _labelled(label: str | None) -> str:
    """An image made here (nothing pulled), with or without a torch label; "no labels": one
    with no labels at all, as `docker import` makes."""
    tag = f"tmn-torch-label:{uuid.uuid4().hex[:8]}"
    if label == "no labels":
        subprocess.run(
            f"tar cf - --files-from /dev/null | docker import - {tag}",
            shell=True,
            check=True,
            capture_output=True,
        )
        return tag
    options = ["--label", f"{TORCH_LABEL}={label}"] if label is not None else []
    context = "FROM scratch\nLABEL purpose=test\n"
    subprocess.run(
        ["docker", "build", "-q", *options, "-t", tag, "-"],
        input=context,
        text=True,
        capture_output=True,
        check=True,
    )
    return tag


def _answer(tag: str) -> str:
    """What the launcher's check prints on a node, run against this machine's engine."""
    command = image_check.image_check_command(tag)
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True).stdout


@pytest.mark.parametrize(
    "label, problem",
    [
        ("2.14.1+cu130", None),
        ("2.15.0", None),
        (
            "2.10.0a0+b558c986e8.nv25.12",
            "carries torch 2.10.0a0+b558c986e8.nv25.12, older than the 2.14 this project needs",
        ),
        (None, "does not say which torch it carries"),
        ("no labels", "does not say which torch it carries"),
    ],
)
def test_the_node_check_reads_the_images_torch_and_refuses_an_old_one(label, problem):
    engine.require_engine()
    tag = _labelled(label)
    try:
        inventory = helpers.inventory(
            {"n1": helpers.node(1)}, launch_mode="container", training_image=tag
        )
        wanted = sim.docker("image", "inspect", "--format", "{{.Id}}", tag).stdout.strip()
        found = image_check.image_mismatch(inventory.hosts[0], inventory, wanted, _answer(tag))
        if problem is None:
            assert found is None
        else:
            assert found.startswith(f"on n1: the training image {tag} "), found
            assert problem in found and "(try make image" in found
    finally:
        sim.docker("rmi", tag, check=False)
