"""10. Shipping the training image: its first shipment through the registry against the
stream, each from nothing on both nodes, then the bytes each node receives after a change
to its top layer; and the registry surgery that makes a shipment start from nothing."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from torch_multinode.bench.measure import (
    Progress,
    Series,
    node_containers,
    node_rx,
    ratio_series,
    side_by_side,
)
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory import Inventory
from torch_multinode.cluster.inventory_read import load
from torch_multinode.provision import images
from torch_multinode.sim import nodes as sim

# -- 10. shipping the training image ---------------------------------------------------------

# What a user's rebuild changes when only the Dockerfile's last step changed: one new file in
# the top layer (random bytes, so that no compression makes it smaller on the wire).
TOP_LAYER_BYTES = 1 << 20
TOP_LAYER_TAG = "bench-top-layer"
REGISTRY_QUIET_SECONDS = 30  # no connection to another cluster's registry for this long
REGISTRY_QUIET_LIMIT = 600  # then go on anyway, saying so


def clear_nodes(containers: dict[str, str], image: str, image_id: str) -> None:
    """Remove `image` from every node, and the layers no other image holds, so the next
    shipment starts from nothing."""
    for node, container in containers.items():
        sim.docker("exec", container, "docker", "rmi", "-f", image, check=False)
        sim.docker("exec", container, "docker", "image", "prune", "-f")
        if (
            sim.docker(
                "exec", container, "docker", "image", "inspect", image_id, check=False
            ).returncode
            == 0
        ):
            raise UserError(
                f"on {node}: {image} ({image_id[7:19]}) is still there after rmi and prune"
            )


def repository_of(image: str) -> str:
    """The image's repository: its name without the tag."""
    name, _, last = image.rpartition("/")
    return f"{name}/{last.split(':')[0]}" if name else last.split(":")[0]


def _linked(directory: Path) -> set[str]:
    """The digests a repository links (layers, configs, manifests): the names of its link dirs."""
    found = set()
    for kind in ("_layers", "_manifests/revisions"):
        folder = directory / kind / "sha256"
        if folder.is_dir():
            found |= {entry.name for entry in folder.iterdir()}
    return found


def registry_files(storage: Path, repository: str) -> list[Path]:
    """What to delete from the registry's storage (its docker/registry/v2 directory) for it to
    forget `repository`: the repository's directory, then the blobs it links that no other
    repository links."""
    root = storage / "repositories"
    directory = root / repository
    if not directory.is_dir():
        return []
    mine = _linked(directory)
    others = set()
    for layers in root.rglob("_layers"):
        if layers.parent != directory:
            others |= _linked(layers.parent)
    blobs = storage / "blobs" / "sha256"
    return [
        directory,
        *(blobs / d[:2] / d for d in sorted(mine - others) if (blobs / d[:2] / d).exists()),
    ]


def registry_storage(registry) -> Path:
    """The storage of the registry instance `registry` (ship.Registry), from its config."""
    import yaml

    from torch_multinode.provision import ship

    config = yaml.safe_load((ship.REGISTRY_DIR / f"{registry.instance}.yml").read_text())
    return Path(config["storage"]["filesystem"]["rootdirectory"]) / "docker" / "registry" / "v2"


def registry_endpoints(configs: list[str]) -> set[str]:
    """address:port of each registry instance, from its config's file name
    (torch-multinode-registry-172-30-150-1-5000.yml)."""
    found = set()
    for name in configs:
        parts = name.removesuffix(".yml").removeprefix("torch-multinode-registry-").split("-")
        if len(parts) == 5 and all(p.isdigit() for p in parts):
            found.add(f"{'.'.join(parts[:4])}:{parts[4]}")
    return found


def connections_to(ss_output: str, endpoints: set[str]) -> int:
    """Established TCP connections (`ss -Htn state established`) with an end in `endpoints`."""
    return sum(
        1 for line in ss_output.splitlines() if any(f in endpoints for f in line.split()[2:4])
    )


def wait_for_quiet_registries(mine: set[str], progress: Progress) -> float:
    """Wait until no registry instance but `mine` has had a connection for
    REGISTRY_QUIET_SECONDS (Docker's registry client keeps none open between requests), so
    that forgetting the image does not pull it from under another cluster's shipment; the
    seconds waited."""
    from torch_multinode.provision import ship

    others = registry_endpoints([p.name for p in ship.REGISTRY_DIR.glob("*.yml")]) - mine
    started = quiet_since = time.monotonic()
    said = False
    while others and time.monotonic() - quiet_since < REGISTRY_QUIET_SECONDS:
        out = subprocess.run(
            ["ss", "-Htn", "state", "established"], capture_output=True, text=True, check=False
        ).stdout
        if connections_to(out, others):
            quiet_since = time.monotonic()
            if not said:
                progress(
                    f"image: another cluster's registry ({', '.join(sorted(others))}) is busy; "
                    "waiting for it to be quiet before the storage they share forgets the image..."
                )
                said = True
        if time.monotonic() - started > REGISTRY_QUIET_LIMIT:
            progress(f"image: still busy after {REGISTRY_QUIET_LIMIT} s; going on")
            break
        time.sleep(1)
    return time.monotonic() - started


def forget_in_registry(inventory: Inventory, image: str, progress: Progress) -> int:
    """Make the controller's registry forget `image`'s repository, so the next push uploads
    every layer and every node pulls it whole; the bytes of blobs deleted.

    Bench-only: this deletes files under the registry's storage while it runs, which works
    only because its config has no cache (it reads the files on every request) and because
    the bench runs as root on the controller. Nothing in the project does this to a registry:
    the storage is shared by every instance (every cluster provisioned from this controller),
    so the other clusters' registries forget the repository too until the next push restores
    it (the same layers give the same blobs). A separate repository name would not do: the
    controller's engine remembers which repository of this registry holds each layer and
    mounts it from there instead of uploading it. Blobs another repository links stay (deleting
    them would break it): the push uploads them all the same, since the registry answers
    'unknown' for every blob this repository no longer links (its log: HEAD 404, then an
    upload, no mount)."""
    from torch_multinode.provision import ship

    registries, reason = ship.find_registries(inventory)
    if not registries:
        raise UserError(f"no registry to measure: {reason}", hint="make provision")
    wait_for_quiet_registries({r.endpoint for r in registries.values()}, progress)
    deleted = 0
    for storage in {registry_storage(r) for r in registries.values()}:
        for path in registry_files(storage, repository_of(image)):
            if path.is_dir():
                deleted += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                subprocess.run(["rm", "-rf", "--", str(path)], check=True)
    return deleted


def ship_from_nothing(inventory_path: Path, image: str, via: str, progress: Progress) -> dict:
    """`image` removed from both nodes (and, through the registry, from the registry), then
    shipped `via` 'registry' or 'stream': wall seconds, and what each node received."""
    from torch_multinode.provision import ship

    inventory = load(inventory_path)
    containers = node_containers(inventory_path)
    wanted = ship.image_id(image)
    clear_nodes(containers, image, wanted)
    forgotten = forget_in_registry(inventory, image, progress) if via == "registry" else 0
    before = node_rx(containers)
    started = time.monotonic()
    shipment = ship.ship(inventory, image, via=via, emit=lambda line: progress(f"image: {line}"))
    seconds = time.monotonic() - started
    after = node_rx(containers)
    if shipment.via != via:
        raise UserError(f"asked to ship {image} {via}, it went {shipment.via or 'nowhere'}")
    return {
        "seconds": seconds,
        "received": shipment.received,
        "rx_bytes": {node: after[node] - before[node] for node in containers},
        "registry_bytes_forgotten": forgotten,
    }


def top_layer_size(image: str) -> int:
    """The size of the image's last layer (`docker history`, newest first)."""
    out = sim.docker("history", "--no-trunc", "--human=false", "--format", "{{.Size}}", image)
    return int(out.stdout.split()[0])


def derived_tag(image: str) -> str:
    """The image's repository with the bench's tag: what a rebuild under a new tag pushes."""
    return f"{repository_of(image)}:{TOP_LAYER_TAG}"


def build_top_layer_change(image: str, tag: str) -> None:
    """`tag`: `image` with one changed file added on top, as a rebuild after an edit to the
    Dockerfile's last step makes."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-image-") as scratch:
        context = Path(scratch)
        (context / "changed.bin").write_bytes(os.urandom(TOP_LAYER_BYTES))
        (context / "Dockerfile").write_text(
            f"FROM {image}\nCOPY changed.bin /opt/torch-multinode-bench/changed.bin\n"
        )
        sim.docker("build", "-q", "-t", tag, str(context), timeout=600)


def ship_top_layer_change(inventory_path: Path, image: str, progress: Progress) -> dict:
    """After `image` reached the nodes through the registry: the same image with a changed top
    layer, shipped as `cluster ship` chooses (via auto); bytes each node received, on its own
    network counters and as the shipment counted them, against the image's and the layer's
    size. The derived image is removed afterwards (nodes, this machine, its registry tag)."""
    from torch_multinode.provision import ship

    inventory = load(inventory_path)
    containers = node_containers(inventory_path)
    tag = derived_tag(image)
    build_top_layer_change(image, tag)
    try:
        whole, layer = images.image_size(tag), top_layer_size(tag)
        before = node_rx(containers)
        started = time.monotonic()
        shipment = ship.ship(
            inventory, tag, via="auto", emit=lambda line: progress(f"image: {line}")
        )
        seconds = time.monotonic() - started
        after = node_rx(containers)
    finally:
        for container in containers.values():
            sim.docker("exec", container, "docker", "rmi", tag, check=False)
        sim.docker("rmi", tag, check=False)
        registries, _ = ship.find_registries(inventory)
        for storage in {registry_storage(r) for r in registries.values()}:
            # The tag only: the layer's blob stays until a garbage collection, like any tag's.
            tags = storage / "repositories" / repository_of(image) / "_manifests" / "tags"
            subprocess.run(["rm", "-rf", "--", str(tags / TOP_LAYER_TAG)], check=False)
    rx = {node: after[node] - before[node] for node in containers}
    return {
        "via": shipment.via,
        "reason": shipment.reason,
        "seconds": seconds,
        "image_bytes": whole,
        "layer_bytes": layer,
        "received": shipment.received,
        "rx_bytes": rx,
        "rx_over_image": {node: value / whole for node, value in rx.items()},
    }


def measure_image(inventory: Path, image: str, reps: int, progress: Progress) -> dict:
    """On 2 nodes provisioned for jobs in containers (`inventory`, holding `image`): the first
    shipment of the whole image through the registry (push, then both nodes pull at once)
    against the stream (docker save | ssh | docker load on both), side by side, each from
    nothing; then the bytes each node receives after a change to the image's top layer."""
    registry: list[dict] = []
    stream: list[dict] = []

    order: list[str] = []

    def one(via: str, into: list) -> Callable[[], float]:
        def measure() -> float:
            how = "through the registry" if via == "registry" else "streamed whole"
            progress(f"image: shipping {image} {how}, from nothing on both nodes...")
            order.append(via)
            into.append(ship_from_nothing(inventory, image, via, progress))
            return into[-1]["seconds"]

        return measure

    first, second = side_by_side(
        reps,
        one("registry", registry),
        one("stream", stream),
        lambda rep, through, whole: progress(
            f"image: rep {rep + 1}/{reps}: first shipment through the registry {through:.0f} s, "
            f"streamed whole {whole:.0f} s"
        ),
    )
    if order[-1] == "stream":
        # A node that loaded the image from a stream knows no registry digest for its layers
        # and would fetch them all again: the top-layer change starts from a registry pull.
        progress("image: shipping it through the registry again, so the nodes know its layers...")
        ship_from_nothing(inventory, image, "registry", progress)
    progress("image: a changed top layer, through the registry...")
    changed = ship_top_layer_change(inventory, image, progress)
    progress(
        "image: top-layer change: "
        + ", ".join(
            f"{node} {value:,} bytes received ({changed['rx_over_image'][node]:.5f} of the image)"
            for node, value in changed["rx_bytes"].items()
        )
    )
    return {
        "image": image,
        "image_bytes": images.image_size(image),
        "order": order,
        "registry_seconds": Series(first).as_dict(),
        "stream_seconds": Series(second).as_dict(),
        "ratio": ratio_series(first, second).as_dict(),
        "registry_runs": registry,
        "stream_runs": stream,
        "top_layer": changed,
    }
