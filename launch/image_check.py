"""The job's image on every node checked against this machine's before anything starts: the
image's ID here (`local_image_id`), the command that asks a node for its copy's ID and torch
(`image_check_command`), and what a node's answer means (`image_mismatch`). Which image a job
runs in is launch/staging.py's (`job_image`); launch/prepare.py runs the check on each node."""

from __future__ import annotations

import shlex
import subprocess

from torch_multinode.cluster.errors import UserError, printable
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.cluster.versions import TORCH_LABEL, minimum_shown, torch_meets_minimum


def local_image_id(image: str) -> str:
    try:
        found = subprocess.run(
            ["docker", "image", "inspect", "--format", "{{.Id}}", image],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except FileNotFoundError:
        found = None
    if found is None or found.returncode != 0:
        raise UserError(
            f"the training image {image} is not on this machine, so the nodes' copies cannot be "
            "checked against it",
            hint="make provision INVENTORY=... (it builds the image here and ships it)",
            exit_code=1,
        )
    return found.stdout.strip()


ENGINE_WAIT = 30  # seconds: a node that just booted answers over SSH before its Docker engine


def image_check_command(image: str) -> str:
    """The image's ID and the torch it carries (its TORCH_LABEL, set by `make image` from the
    image's own report), once the node's Docker engine answers (waiting up to ENGINE_WAIT)."""
    # `with`: an image with no labels at all has none to index (docker import makes such).
    template = (
        f'{{{{.Id}}}} torch={{{{with .Config.Labels}}}}{{{{index . "{TORCH_LABEL}"}}}}{{{{end}}}}'
    )
    return (
        f"for _ in $(seq {ENGINE_WAIT}); do docker info >/dev/null 2>&1 && break; sleep 1; done; "
        f"docker image inspect --format {shlex.quote(template)} {shlex.quote(image)} 2>&1"
    )


def image_mismatch(
    host: Host, inventory: Inventory, wanted: str, answer: str, image: str | None = None
) -> str | None:
    """Why this node cannot run the job's image (`image`: the project's dependency layer, else
    the training image) (not the controller's, missing, no engine, or a torch older than the
    project's minimum), or None."""
    found = answer.strip()
    image = image or inventory.training_image
    fix = f"make ship INVENTORY={inventory.path}"
    named = f"the training image {image}"
    if image != inventory.training_image:  # the project's layer: the launch ships it first
        fix = f"make train again: it ships {image} to the nodes before the job"
        named = f"the project's image {image}"
    identity, _, torch = found.partition(" torch=")
    if identity == wanted:
        if torch in ("", "<no value>"):
            return (
                f"on {host.name}: {named} does not say which torch it carries "
                f"(built by hand, or before torch-multinode recorded it) (try make image, then "
                f"{fix})"
            )
        if not torch_meets_minimum(torch):
            return (
                f"on {host.name}: {named} carries torch {torch}, older than "
                f"the {minimum_shown()} this project needs (try make image, which installs the "
                f"pinned torch, then {fix})"
            )
        return None
    if identity.startswith("sha256:"):
        return (
            f"on {host.name}: {named} is "
            f"{identity[7:19]}, not this machine's {wanted[7:19]} (try {fix})"
        )
    if "No such" in found or "no such" in found:
        return f"on {host.name}: {named} is missing (try {fix})"
    if "Cannot connect to the Docker daemon" in found:
        return (
            f"on {host.name}: its Docker engine did not answer within {ENGINE_WAIT} s (try "
            f"'sudo systemctl start docker' there, or make provision INVENTORY={inventory.path})"
        )
    return (
        f"on {host.name}: cannot ask Docker about {named}: "
        f"{printable(found.splitlines()[-1] if found else 'no answer')} (try {fix})"
    )
