"""The training image's layers, for the tests of its rebuilds (tests/docker/test_image.py,
tests/test_image_shipping.py): a copy of the repository to build from, edited there (never in
the checkout, which other tests read at the same time), and which layers a build made anew."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch_multinode.bench.rebuild import edit_line, scratch_checkout
from torch_multinode.cluster.engine import docker
from torch_multinode.provision import images

# How the install step appears in `docker history`: its command holds the pip install of torch
# (py-spy's layer above it holds a pip install too).
INSTALL_STEP = "pip install --no-cache-dir --no-index"
INSTALL_WHAT = '"torch=='


@dataclass(frozen=True)
class Step:
    image_id: str  # the image this step made ("<missing>" for a base's own history)
    created_by: str
    size: int


def history(tag: str) -> list[Step]:
    """The image's steps, oldest first."""
    out = docker(
        "history",
        "--no-trunc",
        "--human=false",
        "--format",
        "{{.ID}}\t{{.Size}}\t{{.CreatedBy}}",
        tag,
    ).stdout
    steps = []
    for line in out.splitlines():
        image_id, size, created_by = line.split("\t", 2)
        steps.append(Step(image_id, created_by, int(size)))
    return steps[::-1]


def install_step(tag: str) -> tuple[Step, list[Step]]:
    """The step that installed torch, and the steps above it (oldest first)."""
    steps = history(tag)
    found = [
        index
        for index, step in enumerate(steps)
        if INSTALL_STEP in step.created_by and INSTALL_WHAT in step.created_by
    ]
    assert len(found) == 1, [step.created_by[:80] for step in steps]
    return steps[found[0]], steps[found[0] + 1 :]


def build_with_an_edited_entrypoint(root: Path, tag: str) -> images.BuiltImage:
    """The CPU twin built by the project's own build function from a copy of the repository
    whose docker/entrypoint.sh has one more line, under `tag`."""
    copy = scratch_checkout(root)
    edit_line(copy / "docker" / "entrypoint.sh", f"# rebuilt as {tag}")
    return images.build("cpu", tag, progress=lambda _: None, context=copy)
