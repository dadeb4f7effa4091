"""Shipping the training image to the nodes: by layers through the controller's registry, or
by stream when no registry can run.

Through the registry (ansible/roles/image_registry runs it, one instance per address the nodes
reach the controller on, TLS with client certificates): the controller's engine pushes the
image (only layers the registry lacks travel), then every node's engine pulls at once, so a
node fetches only the layers it lacks. Without one (image_registry: false, no instance set up
for the address, or it does not answer): one `docker save` on the controller is written into
`docker load` on every node lacking the image, over SSH, each node sent only the layers it
lacks, and this is said with the reason.

Either way a line per node every few seconds says how far the image has come (bytes, rate,
time left), and at the end every node must hold the controller's image ID.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch_multinode.cluster import routes, trust, version_lock
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.cluster.remote import on_all
from torch_multinode.provision import images, platforms
from torch_multinode.provision.ship_progress import (
    Emit,
    LayerProgress,
    Meter,
    Shipment,
    engine_lines,
)

REGISTRY_DIR = Path("/etc/torch-multinode/registry")
CERTS_D = Path("/etc/docker/certs.d")
CHUNK = 1 << 20
ENGINE_TIMEOUT = 30

# Sent to a node's python3 (or run here): one request to the local Docker engine's socket, its
# streamed JSON lines written out as they come. The engine's own API reports a pull's or a
# push's progress per layer, which the docker CLI prints only on a terminal.
ENGINE_REQUEST = r"""
import base64, http.client, socket, sys
class Engine(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect("/var/run/docker.sock")
engine = Engine("localhost")
engine.request("POST", sys.argv[1], headers={"X-Registry-Auth": base64.b64encode(b"{}").decode()})
response = engine.getresponse()
if response.status >= 300:
    sys.stdout.write('{"error": %r}\n' % response.read().decode(errors="replace").strip())
    sys.exit(1)
for line in response:
    sys.stdout.write(line.decode(errors="replace"))
    sys.stdout.flush()
"""


def instance_name(address: str, port: int | str) -> str:
    """The registry instance's name for `address` and `port` (ansible/roles/image_registry's:
    its settings, certificate, key, pid file and log are named after it); port "*" gives the
    pattern of every port's."""
    return f"torch-multinode-registry-{address.replace('.', '-')}-{port}"


@dataclass(frozen=True)
class Registry:
    """One instance of the controller's registry, as a node reaches it."""

    address: str
    port: int

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}"

    @property
    def instance(self) -> str:
        return instance_name(self.address, self.port)

    def reference(self, image: str) -> str:
        """The image's name in this registry: the same repository and tag under its address."""
        return f"{self.endpoint}/{image if ':' in image.rsplit('/', 1)[-1] else image + ':latest'}"


def image_id(image: str) -> str:
    proc = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", image],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise UserError(
            f"the training image {image} is not in this machine's Docker engine",
            hint="make image (make provision builds it first)",
            exit_code=1,
        )
    return proc.stdout.strip()


def _sudo(host: Host) -> str:
    """Root's commands on a node: as root, or through passwordless sudo (make bootstrap)."""
    return "" if (host.ssh_user or "root") == "root" else "sudo -n "


def _on_node(inventory: Inventory, host: Host, command: str, **kwargs) -> subprocess.Popen:
    target = f"{host.ssh_user}@{host.ssh_address}" if host.ssh_user else host.ssh_address
    return subprocess.Popen(
        [*trust.openssh_command(inventory, host), target, command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=kwargs.pop("text", True),
        **kwargs,
    )


def node_images(inventory: Inventory, image: str) -> dict[str, tuple[str, str]]:
    """Each node's ID for `image` ('' where it has none) and its machine's architecture."""

    def one(host: Host) -> tuple[str, str]:
        inspect = f"{_sudo(host)}docker image inspect --format '{{{{.Id}}}}' {shlex.quote(image)}"
        process = _on_node(inventory, host, f"uname -m; {inspect} 2>/dev/null || true")
        out, _ = process.communicate(timeout=ENGINE_TIMEOUT + 30)
        lines = out.split()
        return (lines[1] if len(lines) > 1 else "", lines[0] if lines else "")

    return on_all(inventory.hosts, one)


def registry_for(host: Host, port: int) -> Registry:
    """The controller's address on the network this node is reached through."""
    return Registry(routes.address_towards(host), port)


def find_registries(inventory: Inventory) -> tuple[dict[str, Registry], str]:
    """The registry instance each node pulls from, or ({}, why there is none to use)."""
    if not inventory.image_registry:
        return {}, "image_registry: false in the inventory"
    found = {
        host.name: registry_for(host, inventory.image_registry_port) for host in inventory.hosts
    }
    for registry in set(found.values()):
        config = REGISTRY_DIR / f"{registry.instance}.yml"
        if not config.exists():
            return {}, f"no registry is set up for {registry.endpoint} (make provision sets it up)"
        if not (CERTS_D / registry.endpoint / "client.cert").exists():
            return {}, f"this machine's Docker engine holds no certificate for {registry.endpoint}"
        try:
            socket.create_connection((registry.address, registry.port), timeout=3).close()
        except OSError as exc:
            return {}, (
                f"the registry on {registry.endpoint} does not answer ({exc.strerror or exc}; its "
                f"log: /var/log/torch-multinode/{registry.instance}.log)"
            )
    return found, ""


def _engine(arguments: list[str], path: str) -> list[str]:
    return [*arguments, "-c", ENGINE_REQUEST, path]


def push(image: str, registry: Registry, emit: Emit) -> int:
    """Push `image` from this machine's engine into `registry`; the bytes that moved."""
    reference = registry.reference(image)
    subprocess.run(["docker", "tag", image, reference], check=True, capture_output=True)
    repository, _, tag = reference.rpartition(":")
    meter = Meter(f"registry {registry.endpoint}", emit)
    try:
        process = subprocess.Popen(
            _engine([sys.executable], f"/images/{repository}/push?tag={tag}"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        moved, failure = _follow(process, meter)
        if failure:
            raise UserError(
                f"pushing {image} to the registry on {registry.endpoint} failed: {failure}",
                exit_code=1,
            )
    finally:
        subprocess.run(["docker", "rmi", reference], check=False, capture_output=True)
    return moved


def _follow(process: subprocess.Popen, meter: Meter) -> tuple[int, str]:
    """An engine request's progress read as it comes, shown by `meter`: the bytes it moved,
    and why it failed ('' when it did not)."""
    assert process.stdout is not None and process.stderr is not None  # both PIPE
    progress = LayerProgress()
    for message in engine_lines(process.stdout):
        phase = progress.feed(message)
        meter.update(progress.done, progress.total, phase)
    stderr = process.stderr.read()
    if process.wait() != 0 or progress.error:
        return progress.done, progress.error or (
            stderr.strip().splitlines() or ["no reason given"]
        )[-1]
    return progress.done, ""


def engine_pull(
    inventory: Inventory, host: Host, reference: str, emit: Emit, then: str = ""
) -> int:
    """Have `host`'s engine pull `reference` from its registry (only the layers it lacks),
    a progress line every few seconds, then run `then` there; the bytes it fetched."""
    repository, _, tag = reference.rpartition(":")
    if not repository or "/" in tag:  # no tag (a colon, if any, was the registry's port)
        repository, tag = reference, "latest"
    request = shlex.join(
        ["python3", "-c", ENGINE_REQUEST, f"/images/create?fromImage={repository}&tag={tag}"]
    )
    command = f"{_sudo(host)}{request}" + (f" && {then}" if then else "")
    fetched, failure = _follow(_on_node(inventory, host, command), Meter(host.name, emit))
    if failure:
        raise UserError(f"on {host.name}: pulling {reference} failed: {failure}")
    return fetched


def pull(inventory: Inventory, host: Host, image: str, registry: Registry, emit: Emit) -> int:
    """Have `host`'s engine pull `image` from `registry` (only the layers it lacks) and name it
    as the controller does; the bytes it fetched."""
    reference = registry.reference(image)
    sudo = _sudo(host)
    retag = (
        f"{sudo}docker tag {shlex.quote(reference)} {shlex.quote(image)} && "
        f"{sudo}docker rmi {shlex.quote(reference)} >/dev/null"
    )
    return engine_pull(inventory, host, reference, emit, then=retag)


BASE_LABEL = images.BASE_LABEL


def base_of(image: str) -> str:
    """The base the image was built on, as its OCI label records it ('' where it has none)."""
    return images.image_label(image, BASE_LABEL)


def image_layers(image: str) -> list[str]:
    """The image's layers (diff IDs), bottom first, as this machine's engine holds it."""
    proc = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{json .RootFS.Layers}}", image],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout)


# On a node: the layers (bottom first) of every image its engine holds, one JSON list a line.
NODE_LAYERS = (
    'ids=$({sudo}docker images --quiet --no-trunc | sort -u); [ -z "$ids" ] || '
    "{sudo}docker image inspect --format '{{{{json .RootFS.Layers}}}}' $ids"
)


def held_layers(inventory: Inventory, host: Host, layers: list[str]) -> int:
    """How many of `layers`, from the bottom, `host` already holds as one chain (a layer
    counts only with every layer below it, as Docker stores them)."""
    process = _on_node(inventory, host, NODE_LAYERS.format(sudo=_sudo(host)))
    out, _ = process.communicate(timeout=ENGINE_TIMEOUT + 30)
    best = 0
    for line in out.splitlines():
        try:
            chain = json.loads(line)
        except json.JSONDecodeError:
            continue
        common = 0
        for mine, theirs in zip(layers, chain or [], strict=False):
            if mine != theirs:
                break
            common += 1
        best = max(best, common)
    return best


class _Counted:
    """A node's `docker load` input, counting what goes in and reporting it."""

    def __init__(self, stream, on_sent: Callable[[int], None]) -> None:
        self.stream = stream
        self.on_sent = on_sent

    def write(self, data: bytes) -> int:
        self.stream.write(data)
        self.on_sent(len(data))
        return len(data)


def _rewrite(archive, outputs: dict[str, _Counted], skip: dict[str, set[str]]) -> dict[str, str]:
    """`docker save`'s archive written to every node less the layers that node holds:
    `docker load` takes a layer from its own store when its chain is there and reads the
    layer's file only otherwise. A layer file is known by its content's digest (its diff ID),
    so each is spooled here while it is hashed, then sent to the nodes that lack it. The nodes
    whose input broke, with why."""
    writers = {
        # a stream ("w|") only writes to its file; typeshed asks for a seekable one
        name: tarfile.open(fileobj=out, mode="w|")  # type: ignore[call-overload]
        for name, out in outputs.items()
    }
    broken: dict[str, str] = {}

    def add(name: str, member: tarfile.TarInfo, data) -> None:
        if name in broken:
            return
        try:
            writers[name].addfile(member, data)
        except OSError as exc:
            broken[name] = f"the connection ended early ({exc.strerror or exc})"

    source = tarfile.open(fileobj=archive, mode="r|")
    for member in source:
        data = source.extractfile(member) if member.isfile() else None
        if data is None:
            for name in writers:
                add(name, member, None)
            continue
        with tempfile.TemporaryFile() as spool:
            digest = hashlib.sha256()
            while chunk := data.read(CHUNK):
                digest.update(chunk)
                spool.write(chunk)
            diff_id = f"sha256:{digest.hexdigest()}"  # only a layer's file can match one
            for name in writers:
                if diff_id not in skip[name]:
                    spool.seek(0)
                    add(name, member, spool)
    for name, writer in writers.items():
        if name not in broken:
            try:
                writer.close()
            except OSError as exc:
                broken[name] = f"the connection ended early ({exc.strerror or exc})"
    return broken


def stream(inventory: Inventory, hosts: list[Host], image: str, emit: Emit) -> dict[str, int]:
    """One `docker save` here written into `docker load` on every host at once, each host sent
    only the layers it lacks (all of them, read straight through, when no host holds any);
    the bytes each received. A host whose load fails is named once every other is done."""
    layers = image_layers(image)
    held = on_all(hosts, lambda host: held_layers(inventory, host, layers))
    size = images.image_size(image)
    loads = {
        host.name: _on_node(
            inventory, host, f"{_sudo(host)}docker load --quiet", stdin=subprocess.PIPE, text=False
        )
        for host in hosts
    }
    sent = dict.fromkeys(loads, 0)
    # the image's size is what a node lacking every layer receives; others, less
    meters = {name: Meter(name, emit, total=size if not held[name] else 0) for name in loads}

    def counted(name: str) -> _Counted:
        def on_sent(count: int) -> None:
            sent[name] += count
            meters[name].update(sent[name])

        return _Counted(loads[name].stdin, on_sent)

    save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
    assert save.stdout is not None  # stdout=PIPE
    outputs = {name: counted(name) for name in loads}
    if any(held.values()):
        skip = {name: set(layers[: held[name]]) - set(layers[held[name] :]) for name in loads}
        broken = _rewrite(save.stdout, outputs, skip)
    else:
        broken = {}
        while chunk := save.stdout.read(CHUNK):
            for name, out in outputs.items():
                if name not in broken:
                    try:
                        out.write(chunk)
                    except OSError as exc:
                        broken[name] = f"the connection ended early ({exc.strerror or exc})"
    failures = []
    for name, load in loads.items():
        assert load.stdin is not None  # stdin=PIPE
        try:
            load.stdin.close()
        except OSError:
            pass
        load.stdin = None  # closed: communicate() must not flush it
        _, err = load.communicate(timeout=600)
        if load.returncode != 0:
            lines = err.decode(errors="replace").strip().splitlines() or [broken.get(name, "")]
            failures.append(f"on {name}: docker load of {image} failed: {lines[-1]}")
    if save.wait() != 0:
        raise UserError(f"docker save {image} failed on this machine", exit_code=1)
    if failures:
        raise UserError(failures[0], hint="make netcheck (disk space, the engine)", exit_code=1)
    return sent


def ship(
    inventory: Inventory,
    image: str | None = None,
    via: str = "auto",
    emit: Emit = print,
    known_id: str | None = None,
    looked: dict[str, tuple[str, str]] | None = None,
) -> Shipment:
    """Bring `image` (the inventory's training image) to every node lacking the controller's
    ID for it; `via`: 'auto' (the registry when it answers, else the stream, said so),
    'registry' (refuse without one) or 'stream'. `known_id`: that ID, and `looked`: what
    node_images answered, where the caller has them already."""
    image = image or inventory.training_image
    wanted = known_id or image_id(image)
    reason = ""
    started = time.monotonic()
    found = looked if looked is not None else node_images(inventory, image)
    held = {name: identity for name, (identity, _) in found.items()}
    lacking = [host for host in inventory.hosts if held[host.name] != wanted]
    shipment = Shipment(image, wanted, "", already=[n for n, i in held.items() if i == wanted])
    if not lacking:
        return shipment
    platform = platforms.platform_of(platforms.image_architecture(image))
    for host in lacking:
        architecture = found[host.name][1]
        if not architecture:
            raise UserError(
                f"{host.name} did not answer over SSH", hint="make netcheck", exit_code=1
            )
        if platforms.platform_of(architecture) != platform:
            raise UserError(
                f"{image} is built for {platform}, but {host.name} is "
                f"{platforms.platform_of(architecture)}",
                hint=f"make provision INVENTORY={inventory.path} (it builds for the nodes' platform)",
            )
    if inventory.image_base_from_nodes:
        # The nodes' own pull of the base leaves its layers under the base registry's digests,
        # which the controller's registry cannot offer again: what lies above goes by stream.
        base = base_of(image)
        if not base:
            raise UserError(
                f"image_base_from_nodes: true, but {image} records no base image (label "
                f"{BASE_LABEL})",
                hint="make image BASE_IMAGE=... (it records the base), or "
                "image_base_from_nodes: false",
            )
        emit(
            f"Each of {', '.join(h.name for h in lacking)} pulls the base {base} itself "
            "(image_base_from_nodes: true)..."
        )
        on_all(lacking, lambda host: engine_pull(inventory, host, base, emit))
        via, reason = "stream", f"the base came from each node's own pull of {base}"
    registries: dict[str, Registry]
    if via == "stream":
        registries, reason = {}, reason or "asked for the stream"
    else:
        registries, reason = find_registries(inventory)
    if registries:
        shipment.via = "registry"
        emit(
            f"Shipping {image} ({wanted[7:19]}) to {', '.join(h.name for h in lacking)} through "
            f"the registry on {', '.join(sorted({r.endpoint for r in registries.values()}))}: "
            "each node fetches only the layers it lacks."
        )
        received, failed = _through_registries(inventory, lacking, image, registries, emit)
        if failed and via == "registry":
            raise UserError(next(iter(failed.values())), exit_code=1)
        if failed:  # what the registry could not bring goes by stream, said so
            shipment.reason = "; ".join(failed.values())
            late = [host for host in lacking if host.name in failed]
            _say_stream(emit, image, wanted, late, f"the registry failed them: {shipment.reason}")
            received.update(stream(inventory, late, image, emit))
    else:
        if via == "registry":
            raise UserError(f"no registry to ship {image} through: {reason}", exit_code=1)
        shipment.via, shipment.reason = "stream", reason
        _say_stream(emit, image, wanted, lacking, reason)
        received = stream(inventory, lacking, image, emit)
    shipment.received = received
    after = {name: identity for name, (identity, _) in node_images(inventory, image).items()}
    for host in lacking:
        if after[host.name] != wanted:
            raise UserError(
                f"on {host.name}: {image} is {after[host.name][7:19] or 'missing'} after shipping, "
                f"not this machine's {wanted[7:19]}",
                exit_code=1,
            )
    shipment.seconds = time.monotonic() - started
    if image == inventory.training_image:  # shipped on purpose: what the lock expects now
        version_lock.image_shipped(
            inventory.path,
            [h.name for h in lacking],
            wanted,
            lambda: images.stack_labels(image),
        )
    return shipment


def _say_stream(emit: Emit, image: str, wanted: str, hosts: list[Host], reason: str) -> None:
    emit(
        f"Shipping {image} ({wanted[7:19]}) to {', '.join(h.name for h in hosts)} by stream "
        f"(docker save | ssh | docker load, each node sent only the layers it lacks): {reason}."
    )


def _through_registries(
    inventory: Inventory,
    hosts: list[Host],
    image: str,
    registries: dict[str, Registry],
    emit: Emit,
) -> tuple[dict[str, int], dict[str, str]]:
    """Push to each instance, then every node pulls from its own; the bytes each node fetched,
    and why the nodes the registry could not serve were not (a failed push fails its nodes)."""
    failed: dict[str, str] = {}
    for registry in sorted(set(registries.values()), key=lambda r: r.endpoint):
        try:
            push(image, registry, emit)
        except UserError as error:
            failed.update(
                {name: str(error) for name, used in registries.items() if used == registry}
            )

    def one(host: Host) -> int | str:
        try:
            return pull(inventory, host, image, registries[host.name], emit)
        except UserError as error:
            return str(error)

    pulled = on_all([host for host in hosts if host.name not in failed], one)
    failed.update({name: result for name, result in pulled.items() if isinstance(result, str)})
    return {name: got for name, got in pulled.items() if isinstance(got, int)}, failed
