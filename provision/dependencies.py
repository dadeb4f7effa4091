"""A project's Python dependencies: a layer on the training image for its jobs on the nodes,
and the same packages in a directory of this checkout for its jobs on this machine. The front
door: `begin_for_inventory` (jobs in containers) and `for_this_machine` (a local job), each made
ready as a `Dependencies`, which the run's record keeps.

Which requirements a project has is launch.requirements' decision (requirements.txt, else
pyproject.toml's [project] dependencies, else REQUIREMENTS=path; REQUIREMENTS=none: none).
Here they become packages, on the controller alone: only it reaches the package index.

- **What is held.** torch, torchvision, triton and the CUDA libraries the image carries stay at
  the image's versions, and a requirement that would replace one is refused in one line naming
  it: provision.held_packages (what an environment holds, its `constraints`, the `refusal`).
- **How it resolves.** pip's own resolver, for the image's own Python and platforms, against
  stand-ins of what it holds: provision.resolution. Cached per digest in
  .cache/torch-multinode/deps/ of this checkout (git-ignored, held_packages.CACHE).
- **The layer.** One RUN on the training image's ID (one layer): `pip install --no-index
  --no-deps` of exactly the resolved packages, from wheels served to the build on a loopback
  address as the training image's are (provision.images.serve_wheels): nodes need no package
  index, and no wheel enters the build context or a layer. Its tag is the digest of the
  requirements, the training image's ID and the constraints (`layer_digest`): built once; a
  later run with the same three builds nothing and says so, and a changed requirement is a new
  tag, one layer on the same base, which provision.ship sends by layers (only that layer
  travels; a node that holds it gets nothing). Its labels record the digest and the resolved
  packages (pip freeze's form), which the run's record keeps.
- **This machine.** A local job resolves the same requirements the same way against this
  machine's environment (the .venv `train` runs in, which holds the same pinned torch), and the
  packages go into .cache/torch-multinode/deps/DIGEST/site with `pip install --target`, which
  launch.environment puts on the job's import path: .venv itself is never changed.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torch_multinode.cluster.engine import docker
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.provision import held_packages, images, resolution, ship, ship_progress
from torch_multinode.provision.build_watch import duration
from torch_multinode.provision.resolution import Emit

REPOSITORY = "torch-multinode/deps"
DIGEST_LABEL = "io.torch-multinode.dependencies"
RESOLVED_LABEL = "io.torch-multinode.dependencies.resolved"
# In the layer: what it installed, one `name==version` a line.
LIST_PATH = "/usr/local/lib/torch-multinode/dependencies.txt"
SITE = "site"  # a local job's packages, in its digest's directory
# What the digests are made of, and how: a change here makes every layer anew.
FORMAT = "torch-multinode dependencies 1"


def layer_digest(requirements: Sequence[str], base: str, held_text: str) -> str:
    """The digest of the requirements, the base they go on (the training image's ID) and the
    constraints: the layer's tag, and the name of its resolution's cache."""
    digest = hashlib.sha256()
    for part in (FORMAT, base, held_text, *requirements):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


def layer_tag(digest: str) -> str:
    return f"{REPOSITORY}:{digest[:20]}"


def dockerfile(base_id: str, packages: Sequence[str]) -> str:
    """The layer's Dockerfile: one RUN on the base's ID (one layer), for the legacy builder as
    for BuildKit (no BuildKit syntax). pip installs exactly `packages` from the wheels served to
    the build (images.WHEELS_URL) and resolves nothing itself; the list stays in the image."""
    listed = " ".join(shlex.quote(package) for package in packages)
    return (
        "# A project's dependencies on the training image (torch-multinode, "
        "provision/dependencies.py):\n"
        "# the packages resolved on the controller, installed from wheels served to this build.\n"
        f"FROM {base_id}\n"
        f"RUN mkdir -p {posix_dirname(LIST_PATH)} \\\n"
        f"    && printf '%s\\n' {listed} > {LIST_PATH} \\\n"
        "    && python3 -m pip install --no-cache-dir --no-index --no-deps "
        "--disable-pip-version-check \\\n"
        f"        --trusted-host {images.WHEELS_HOST} --find-links {images.WHEELS_URL} "
        f"-r {LIST_PATH}\n"
    )


def posix_dirname(path: str) -> str:
    return path.rsplit("/", 1)[0]


# -- the result, for the job and its record -------------------------------------------------


@dataclass(frozen=True)
class Dependencies:
    """A project's dependencies, made ready for one job."""

    source: str  # "requirements.txt", "pyproject.toml", a path given
    requirements: tuple[str, ...]
    digest: str
    packages: tuple[str, ...]  # what they add, `Name==version`
    image: str | None = None  # the layer's tag, for jobs in containers (None: none needed)
    image_id: str | None = None
    base: str | None = None  # the training image the layer is on, and its ID
    base_id: str | None = None
    directory: Path | None = None  # a local job's packages, for its import path
    built: bool = False  # made by this call (False: found ready)

    def record(self) -> dict[str, Any]:
        """What the run's record keeps (launch.record): the requirements, what they resolved
        to, and where: the layer (tag, ID, base) or this machine's directory."""
        return {
            "source": self.source,
            "requirements": list(self.requirements),
            "digest": self.digest,
            "resolved": list(self.packages),
            "image": None
            if self.image is None
            else {
                "tag": self.image,
                "id": self.image_id,
                "base": self.base,
                "base_id": self.base_id,
            },
            "directory": None if self.directory is None else str(self.directory),
        }

    @classmethod
    def recorded(cls, recorded: dict[str, Any], **where: Any) -> Dependencies:
        """What a run's record kept (`record`'s dict), with `where` it is ready now: the
        layer's fields or a local job's directory."""
        return cls(
            str(recorded.get("source")),
            tuple(recorded.get("requirements") or ()),
            str(recorded.get("digest")),
            tuple(recorded.get("resolved") or ()),
            **where,
        )


def _image_id(image: str) -> str:
    return docker("image", "inspect", "--format", "{{.Id}}", image, check=False).stdout.strip()


# An image's ID and labels in one `docker image inspect`: a later run's layer is found with
# one call of the engine, not four (its time to the first step is measured, bench section 16).
_ID_AND_LABELS = '{{.Id}}{{"\\t"}}{{json .Config.Labels}}'


def _id_and_labels(image: str) -> tuple[str, dict[str, str]] | None:
    """The image's ID and its labels, or None where this machine has no such image."""
    answer = docker("image", "inspect", "--format", _ID_AND_LABELS, image, check=False)
    identity, _, labels = answer.stdout.strip().partition("\t")
    if answer.returncode != 0 or not identity:
        return None
    return identity, json.loads(labels or "null") or {}


def _recorded_layer(recorded: dict[str, Any] | None, emit: Emit) -> Dependencies | None:
    """The layer a recorded run ran in (`make rerun`), where this machine still has it, under
    its tag again; None where it has not (then it is made again from the same requirements)."""
    if recorded is None:
        return None
    image = recorded.get("image") or {}
    tag, wanted = image.get("tag"), image.get("id")
    if not tag or not wanted:
        return None
    if _image_id(wanted) != wanted:
        emit(
            f"dependencies: the layer the run ran in ({tag}, {wanted[7:19]}) is no longer on "
            "this machine: making it again from the same requirements"
        )
        return None
    if _image_id(tag) != wanted:
        docker("tag", wanted, tag)
    emit(f"dependencies: the run's own layer {tag} ({wanted[7:19]}): nothing to build")
    return Dependencies.recorded(
        recorded, image=tag, image_id=wanted, base=image.get("base"), base_id=image.get("base_id")
    )


def prepare_layer(
    base: str,
    requirements: Sequence[str],
    source: str,
    emit: Emit,
    recorded: dict[str, Any] | None = None,
) -> Dependencies:
    """The layer of `requirements` on the training image `base`, built here unless it is up to
    date (said), after the refusal of a requirement that would change a held package. Without
    anything to add, no layer: the jobs run in `base`. `recorded`: a recorded run's
    dependencies (`make rerun`), whose own layer is taken where this machine still has it."""
    reused = _recorded_layer(recorded, emit)
    if reused is not None:
        return reused
    base_id = _image_id(base)
    if not base_id:
        raise UserError(
            f"the training image {base} is not on this machine, so {source} cannot be put on it",
            hint="make provision INVENTORY=... (it builds the image here and ships it)",
            exit_code=1,
        )
    environment = held_packages.probe_image(base, base_id)
    refused = held_packages.refusal(requirements, source, environment)
    if refused is not None:
        raise refused
    digest = layer_digest(requirements, base_id, held_packages.constraints(environment))
    tag = layer_tag(digest)
    common = (source, tuple(requirements), digest)
    found = _id_and_labels(tag)
    if found is not None and found[1].get(DIGEST_LABEL) == digest:
        packages = tuple(found[1].get(RESOLVED_LABEL, "").split())
        emit(
            f"dependencies: {tag} holds {source}'s {len(packages)} package(s) on {base} "
            "already: nothing to build"
        )
        return Dependencies(*common, packages, tag, found[0], base, base_id)
    packages = resolution.resolve(
        requirements, source, environment, held_packages.CACHE / digest, emit
    )
    if not packages:
        emit(f"dependencies: {base} holds everything {source} asks for: no layer to build")
        return Dependencies(*common, packages, None, None, base, base_id)
    emit(f"dependencies: building {tag}, one layer on {base} ({len(packages)} package(s))...")
    started = time.monotonic()
    build_layer(tag, base_id, packages, digest, held_packages.CACHE / digest / "wheels", emit)
    image_id = _image_id(tag)
    emit(f"dependencies: built {tag} ({image_id[7:19]}) in {duration(time.monotonic() - started)}")
    return Dependencies(*common, packages, tag, image_id, base, base_id, built=True)


def build_arguments(
    dockerfile_path: Path, wheels_address: str, digest: str, packages: Sequence[str]
) -> list[str]:
    """`docker build`'s arguments for the layer: the wheels' server reached on the host's
    network under images.WHEELS_HOST (its address outside every cache key, as for the training
    image), the digest and the resolved packages as labels."""
    return [
        "-f",
        str(dockerfile_path),
        "--network",
        "host",
        "--add-host",
        f"{images.WHEELS_HOST}:{wheels_address}",
        "--label",
        f"{DIGEST_LABEL}={digest}",
        "--label",
        f"{RESOLVED_LABEL}={' '.join(packages)}",
    ]


def build_layer(
    tag: str, base_id: str, packages: Sequence[str], digest: str, wheels: Path, emit: Emit
) -> None:
    """`docker build` of the layer, its steps shown as they come (provision.build_watch); the
    context is a directory holding its Dockerfile alone."""
    with tempfile.TemporaryDirectory(prefix="tmn-deps-") as context:
        path = Path(context) / "Dockerfile"
        path.write_text(dockerfile(base_id, packages))
        with images.serve_wheels(wheels) as address:
            images.build_from(
                build_arguments(path, address, digest, packages), tag, emit, Path(context)
            )


def ship_layer(
    inventory: Inventory,
    dependencies: Dependencies,
    emit: Emit,
    looked: dict[str, tuple[str, str]] | None = None,
) -> None:
    """The layer onto every node that lacks it, by layers (provision.ship): a node that holds
    its base fetches the one layer; one that holds the layer gets nothing, said. `looked`: the
    nodes' answers to ship.node_images, where they were asked already."""
    if dependencies.image is None:
        return
    shipment = ship.ship(
        inventory, dependencies.image, emit=emit, known_id=dependencies.image_id, looked=looked
    )
    if not shipment.via:
        emit(
            f"dependencies: every node holds {dependencies.image} "
            f"({shipment.image_id[7:19]}) already: nothing to ship"
        )
    else:
        emit(f"dependencies: {ship_progress.summary(shipment)}")


class _Look:
    """ship.node_images of a layer, asked in a thread of its own: the nodes answer while the
    launcher goes on here (it connects and sends the project), not before it starts."""

    def __init__(self, inventory: Inventory, image: str) -> None:
        self._answer: dict[str, tuple[str, str]] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._ask, args=(inventory, image), name="tmn-layer-look", daemon=True
        )
        self._thread.start()

    def _ask(self, inventory: Inventory, image: str) -> None:
        try:
            self._answer = ship.node_images(inventory, image)
        except BaseException as error:  # raised where the answer is wanted
            self._error = error

    def answer(self) -> dict[str, tuple[str, str]]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._answer is not None
        return self._answer


def begin_for_inventory(
    inventory: Inventory,
    requirements: Sequence[str],
    source: str,
    emit: Emit,
    recorded: dict[str, Any] | None = None,
    spares: Sequence[Host] = (),
) -> tuple[Dependencies, Callable[[], None]]:
    """A job in containers, in two halves: the layer ready here (built where it must be), and
    a function that makes it ready on every node of the (narrowed) inventory, then on its
    `spares` (RESTARTS=: a lost node's place) as far as they answer, said where one does not
    (a restart onto it would then refuse it, naming it). The job calls the second half before
    it checks the nodes' images. A layer found ready here is looked for on the nodes meanwhile,
    in a thread (a later run's usual case: every node holds it, and the look costs the job no
    time); a layer just built is shipped by the second half, which shows its progress."""
    found = prepare_layer(inventory.training_image, requirements, source, emit, recorded)
    look = None
    if found.image is not None and not found.built:
        look = _Look(inventory, found.image)
    done: list[Exception | None] = []  # once: a restart's second call says the same

    def ready() -> None:
        if not done:
            try:
                _ready_on_nodes(inventory, found, emit, spares, look)
                done.append(None)
            except Exception as error:  # Ctrl-C goes on up, unremembered
                done.append(error)
        if done[0] is not None:
            raise done[0]

    return found, ready


def _ready_on_nodes(
    inventory: Inventory,
    found: Dependencies,
    emit: Emit,
    spares: Sequence[Host],
    look: _Look | None,
) -> None:
    ship_layer(inventory, found, emit, looked=look.answer() if look is not None else None)
    if spares and found.image is not None:
        try:
            ship_layer(replace(inventory, hosts=tuple(spares)), found, emit)
        except UserError as error:
            emit(
                f"dependencies: the spare node(s) {', '.join(h.name for h in spares)} did not "
                f"take {found.image}: {error}"
            )


def _environment_key(environment: held_packages.Environment) -> str:
    return hashlib.sha256(
        json.dumps([sys.prefix, environment.tags, sorted(environment.installed.values())]).encode()
    ).hexdigest()


def for_this_machine(
    requirements: Sequence[str],
    source: str,
    emit: Emit,
    recorded: dict[str, Any] | None = None,
) -> Dependencies:
    """A local job: the same requirements resolved against this machine's environment, the
    packages it lacks installed (`pip install --target`) into CACHE/DIGEST/site (CACHE:
    held_packages'), once; `recorded` (`make rerun`): the recorded run's directory, where it is
    still there."""
    directory = Path((recorded or {}).get("directory") or "/nonexistent")
    if recorded and directory.is_dir():
        emit(f"dependencies: the run's own packages in {directory}: nothing to install")
        return Dependencies.recorded(recorded, directory=directory)
    environment = held_packages.probe_here()
    refused = held_packages.refusal(requirements, source, environment)
    if refused is not None:
        raise refused
    digest = layer_digest(
        requirements, _environment_key(environment), held_packages.constraints(environment)
    )
    common = (source, tuple(requirements), digest)
    site = held_packages.CACHE / digest / SITE
    if site.is_dir():
        packages = tuple(
            (held_packages.CACHE / digest / resolution.RESOLVED_FILE).read_text().split()
        )
        emit(
            f"dependencies: {site} holds {source}'s {len(packages)} package(s) already: "
            "nothing to install"
        )
        return Dependencies(*common, packages, directory=site)
    packages = resolution.resolve(
        requirements, source, environment, held_packages.CACHE / digest, emit
    )
    if not packages:
        emit(f"dependencies: {sys.prefix} holds everything {source} asks for")
        return Dependencies(*common, packages)
    scratch = Path(tempfile.mkdtemp(prefix=".site-", dir=held_packages.CACHE / digest))
    emit(f"dependencies: installing {len(packages)} package(s) into {site} (not into .venv)...")
    code, output = resolution.run_pip(
        [
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--no-warn-script-location",
            "--target",
            str(scratch),
            "--find-links",
            str(held_packages.CACHE / digest / "wheels"),
            "-r",
            str(held_packages.CACHE / digest / resolution.RESOLVED_FILE),
        ]
    )
    if code != 0:
        shutil.rmtree(scratch, ignore_errors=True)
        raise UserError(
            f"installing {source}'s packages into {site} failed: {resolution.last_error(output)}",
            exit_code=1,
        )
    resolution.settle(scratch, site)
    return Dependencies(*common, packages, directory=site, built=True)
