"""The training image travels by layers, through the controller's registry (issue 20), on the
provisioned 2-node cluster of jobs in containers:

- `make provision` pushed the image to the registry on the controller's management address and
  both nodes pulled it at once, a progress line per node while it moved;
- the registry answers only on that address and only to a client holding the certificate
  provisioning gave the nodes;
- after a change to the image's top layer, each node receives at most that layer plus the
  registry's overhead (measured on the nodes' own network counters);
- after `make image`'s own build runs again with one more line in docker/entrypoint.sh, each
  node receives only the layers above the torch install, which the rebuild kept.

The stream (docker save | ssh | docker load), chosen automatically when no registry runs, is
tested with the provisioning scenarios (tests/ansible), whose jobs run on the hosts.
"""

from __future__ import annotations

import os
import re
import subprocess
import uuid

import pytest

from tests.conftest import TEST_IMAGE, VENV_BIN
from tests.helpers import on_node
from tests.image_layers import install_step
from torch_multinode.provision import images, ship

pytestmark = [pytest.mark.sim, pytest.mark.timeout(1800)]

# What may cross a node's links besides the changed layer: the manifest and the image's
# configuration (its history names every layer), TLS handshakes with both certificates, and
# the SSH sessions of `cluster ship` itself (checking the image ID before and after, the pull).
OVERHEAD = 512 * 1024
LAYER_BYTES = 3 * 1024 * 1024


def _received(cluster, index: int) -> int:
    """Bytes node `index` has received on all its network interfaces but loopback."""
    out = on_node(
        cluster,
        index,
        'for i in /sys/class/net/*; do [ "${i##*/}" = lo ] || cat $i/statistics/rx_bytes; done',
    )
    return sum(int(value) for value in out.split())


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VENV_BIN / "cluster"), *args], capture_output=True, text=True, timeout=900, check=False
    )


def test_provisioning_pulled_the_image_from_the_registry_a_line_per_node(provisioned):
    out = provisioned.provision.stdout
    assert provisioned.provision.returncode == 0, provisioned.provision.stderr[-3000:]
    gateway = provisioned.cluster.config.mgmt_gateway
    assert f"to node1, node2 through the registry on {gateway}:5000: each node fetches" in out
    for node in ("node1", "node2"):
        lines = re.findall(
            rf"^\[image\] {node}: [\d.]+ [KMG]?B( of [\d.]+ [KMG]?B)?, .*$", out, re.M
        )
        assert lines, f"no progress line for {node} in:\n{out[-3000:]}"
    done = [line for line in out.splitlines() if line.startswith(f"Done: {TEST_IMAGE} (")]
    assert len(done) == 1 and "on every node, through the registry in" in done[0], out[-3000:]


def test_the_registry_answers_on_the_management_address_only_to_the_nodes_certificate(
    provisioned,
):
    endpoint = f"{provisioned.cluster.config.mgmt_gateway}:5000"
    certs = f"/etc/docker/certs.d/{endpoint}"
    probe = (
        "import socket, ssl, sys\n"
        "context = ssl.create_default_context(cafile=sys.argv[1] + '/ca.crt')\n"
        "if sys.argv[2] == 'cert':\n"
        "    context.load_cert_chain(sys.argv[1] + '/client.cert', sys.argv[1] + '/client.key')\n"
        "host, port = sys.argv[3].split(':')\n"
        "try:\n"
        "    with context.wrap_socket(socket.create_connection((host, int(port)), 5),\n"
        "                             server_hostname=host) as s:\n"
        "        s.sendall(b'GET /v2/ HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n')\n"
        "        print(s.recv(100).split(b'\\r\\n')[0].decode())\n"
        "except (ssl.SSLError, OSError) as exc:\n"
        "    print('refused', type(exc).__name__)\n"
    )

    def attempt(client: str) -> str:
        command = f"python3 - {certs} {client} {endpoint} <<'PY'\n{probe}PY"
        return on_node(provisioned.cluster, 1, command).strip()

    assert attempt("cert") == "HTTP/1.0 200 OK"
    without = attempt("none")
    assert without.startswith("refused"), without
    # bound to that address alone: nothing listens on the port on any other address
    listening = subprocess.run(
        ["ss", "-Hltn", "sport = :5000"], capture_output=True, text=True, check=True
    ).stdout.split()
    local = {word for word in listening if word.endswith(":5000")}
    assert endpoint in local and not local & {"0.0.0.0:5000", "*:5000", "[::]:5000"}, local


def test_a_change_to_the_top_layer_sends_each_node_only_that_layer(provisioned, tmp_path):
    tag = f"{TEST_IMAGE}-top-{uuid.uuid4().hex[:8]}"
    (tmp_path / "change.bin").write_bytes(os.urandom(LAYER_BYTES))  # incompressible
    (tmp_path / "Dockerfile").write_text(f"FROM {TEST_IMAGE}\nCOPY change.bin /opt/change.bin\n")
    subprocess.run(
        ["docker", "build", "-q", "-t", tag, str(tmp_path)], check=True, capture_output=True
    )
    cluster = provisioned.cluster
    try:
        before = {index: _received(cluster, index) for index in (1, 2)}
        shipped = _cli("ship", "-i", str(provisioned.inventory), "--image", tag)
        after = {index: _received(cluster, index) for index in (1, 2)}
        assert shipped.returncode == 0, shipped.stdout + shipped.stderr
        assert "through the registry on" in shipped.stdout.splitlines()[0], shipped.stdout
        whole = int(
            subprocess.run(
                ["docker", "image", "inspect", "--format", "{{.Size}}", tag],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        for index in (1, 2):
            moved = after[index] - before[index]
            assert moved <= LAYER_BYTES + OVERHEAD, (
                f"node{index} received {moved} bytes for a {LAYER_BYTES}-byte layer of a "
                f"{whole}-byte image:\n{shipped.stdout}"
            )
            held = on_node(cluster, index, f"docker image inspect --format '{{{{.Id}}}}' {tag}")
            assert held.strip() == ship.image_id(tag)
        # what the nodes' engines reported fetching: that layer, not the image
        done = shipped.stdout.splitlines()[-1]
        sizes = re.findall(r"node\d ([\d.]+) MB", done)
        assert len(sizes) == 2 and all(2.9 < float(size) < 3.5 for size in sizes), done
    finally:
        for index in (1, 2):
            on_node(cluster, index, f"docker rmi {tag} >/dev/null 2>&1 || true")
        subprocess.run(["docker", "rmi", tag], capture_output=True, check=False)


def test_a_rebuild_after_an_entrypoint_change_ships_only_the_layers_above_the_install(
    provisioned, entrypoint_rebuild
):
    """The image the nodes hold (the fixture's build), rebuilt by images.build from a copy of
    the repository with one line appended to docker/entrypoint.sh: the torch install is the
    same layer, so `cluster ship` sends each node only the few small layers above it."""
    tag = entrypoint_rebuild.tag
    cluster = provisioned.cluster
    try:
        install, above = install_step(tag)
        first_install, first_above = install_step(TEST_IMAGE)
        assert install.image_id == first_install.image_id
        # the layers made anew (py-spy's, above the install, was kept and is not sent again)
        kept = {step.image_id for step in first_above}
        new_bytes = sum(step.size for step in above if step.image_id not in kept)
        before = {index: _received(cluster, index) for index in (1, 2)}
        shipped = _cli("ship", "-i", str(provisioned.inventory), "--image", tag)
        after = {index: _received(cluster, index) for index in (1, 2)}
        assert shipped.returncode == 0, shipped.stdout + shipped.stderr
        assert "through the registry on" in shipped.stdout.splitlines()[0], shipped.stdout
        for index in (1, 2):
            moved = after[index] - before[index]
            assert moved <= new_bytes + OVERHEAD, (
                f"node{index} received {moved} bytes for {new_bytes} bytes of new layers above a "
                f"{install.size}-byte install layer:\n{shipped.stdout}"
            )
            held = on_node(cluster, index, f"docker image inspect --format '{{{{.Id}}}}' {tag}")
            assert held.strip() == ship.image_id(tag)
    finally:
        for index in (1, 2):
            on_node(cluster, index, f"docker rmi {tag} >/dev/null 2>&1 || true")


def test_with_the_base_pulled_by_the_nodes_only_the_layers_above_it_are_streamed(
    provisioned, tmp_path
):
    """image_base_from_nodes: each node pulls the base itself (NVIDIA's on a real cluster; here
    the controller's registry stands in for nvcr.io) and only the layers above it come from
    the controller, by stream, since the node's pull keeps the base registry's digests. The base
    is the training image's own (its bottom layers, which the nodes hold from provisioning):
    the stream's `docker save` then writes half a GB, not the whole training image."""
    endpoint = f"{provisioned.cluster.config.mgmt_gateway}:5000"
    suffix = uuid.uuid4().hex[:8]
    base = f"{endpoint}/torch-multinode-test/base:{suffix}"
    tag = f"torch-multinode-test/derived:{suffix}"
    subprocess.run(["docker", "tag", images.CPU_BASE_IMAGE, base], check=True, capture_output=True)
    (tmp_path / "change.bin").write_bytes(os.urandom(LAYER_BYTES))
    (tmp_path / "Dockerfile").write_text(
        f"FROM {base}\nLABEL {ship.BASE_LABEL}={base}\nCOPY change.bin /opt/change.bin\n"
    )
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(
        provisioned.inventory.read_text().replace(
            f"training_image: {TEST_IMAGE}",
            f"training_image: {tag}\n    image_base_from_nodes: true",
        )
    )
    assert "image_base_from_nodes: true" in inventory.read_text()
    cluster = provisioned.cluster
    try:
        pushed = subprocess.run(["docker", "push", base], capture_output=True, text=True)
        assert pushed.returncode == 0, pushed.stdout + pushed.stderr
        subprocess.run(
            ["docker", "build", "-q", "-t", tag, str(tmp_path)], check=True, capture_output=True
        )
        before = {index: _received(cluster, index) for index in (1, 2)}
        shipped = _cli("ship", "-i", str(inventory))
        after = {index: _received(cluster, index) for index in (1, 2)}
        assert shipped.returncode == 0, shipped.stdout + shipped.stderr
        lines = shipped.stdout.splitlines()
        assert lines[0] == (
            f"Each of node1, node2 pulls the base {base} itself (image_base_from_nodes: true)..."
        )
        assert any(
            line.endswith(f"lacks): the base came from each node's own pull of {base}.")
            for line in lines
        ), shipped.stdout
        for index in (1, 2):
            moved = after[index] - before[index]
            assert moved <= LAYER_BYTES + OVERHEAD, f"node{index}: {moved}\n{shipped.stdout}"
            held = on_node(cluster, index, f"docker image inspect --format '{{{{.Id}}}}' {tag}")
            assert held.strip() == ship.image_id(tag)
    finally:
        for index in (1, 2):
            on_node(cluster, index, f"docker rmi {tag} {base} >/dev/null 2>&1 || true")
        subprocess.run(["docker", "rmi", tag, base], capture_output=True, check=False)
