"""provision.ship's pure parts: the engine's progress folded per node, the progress line, the
registry names, and the reasons the stream is chosen. No network, no engine."""

from __future__ import annotations

import ast
import hashlib
import io
import json
import re
import tarfile

import jinja2
import pytest
import yaml

from tests.helpers import REPO_ROOT, inventory_text, node
from torch_multinode.cluster.inventory_read import parse
from torch_multinode.provision import platforms, ship, ship_progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_pulls_layers_fold_into_bytes_fetched_and_bytes_to_fetch():
    progress = ship_progress.LayerProgress()
    messages = [
        {"status": "Pulling from torch-multinode/train", "id": "test"},
        {"status": "Already exists", "id": "aaa"},
        {"status": "Pulling fs layer", "id": "bbb"},
        {"status": "Pulling fs layer", "id": "ccc"},
        {"status": "Downloading", "progressDetail": {"current": 400, "total": 1000}, "id": "bbb"},
        {"status": "Downloading", "progressDetail": {"current": 50, "total": 200}, "id": "ccc"},
    ]
    for message in messages:
        progress.feed(message)
    assert (progress.done, progress.total) == (450, 1200)  # the layer it had is not counted
    assert progress.feed({"status": "Download complete", "id": "ccc"}) == ""
    assert (
        progress.feed(
            {"status": "Extracting", "progressDetail": {"current": 9, "total": 99}, "id": "ccc"}
        )
        == "unpacking"
    )
    assert (progress.done, progress.total) == (600, 1200)
    progress.feed({"status": "Pull complete", "id": "bbb"})
    assert progress.done == progress.total == 1200
    assert progress.error == ""


def test_a_push_counts_only_the_layers_the_registry_lacked():
    progress = ship_progress.LayerProgress()
    for message in (
        {"status": "Layer already exists", "id": "aaa"},
        {"status": "Pushing", "progressDetail": {"current": 512, "total": 2048}, "id": "bbb"},
        {"status": "Pushed", "id": "bbb"},
    ):
        progress.feed(message)
    assert (progress.done, progress.total) == (2048, 2048)


def test_an_engine_error_is_kept_word_for_word():
    progress = ship_progress.LayerProgress()
    phase = progress.feed(
        {"errorDetail": {"message": "x"}, "error": "received unexpected HTTP status: 500 "}
    )
    assert phase == "failed"
    assert progress.error == "received unexpected HTTP status: 500"


def test_engine_lines_skip_what_is_not_json():
    lines = ['{"status": "a"}\n', "\n", "Warning: something\n", "{broken\n", '{"id": "b"}']
    assert list(ship_progress.engine_lines(lines)) == [{"status": "a"}, {"id": "b"}]


def test_a_nodes_progress_line_every_few_seconds_with_rate_and_time_left():
    clock, lines = Clock(), []
    meter = ship_progress.Meter("node1", lines.append, every=3.0, clock=clock)
    clock.now += 1
    meter.update(10_000_000, 100_000_000)
    assert lines == []  # not yet: one line per node every few seconds
    clock.now += 3  # 4 s in, 40 MB of 100 MB: 10 MB/s, 6 s left
    meter.update(40_000_000)
    assert lines == ["[image] node1: 40.0 MB of 100.0 MB, 10.0 MB/s, about 6 s left"]
    clock.now += 100
    meter.update(40_000_000, phase="unpacking")
    assert lines[-1] == "[image] node1: 40.0 MB of 100.0 MB, 384.6 KB/s, about 2 min 36 s left"
    meter.update(100_000_000, phase="unpacking")
    clock.now += 5
    meter.update(100_000_000, phase="unpacking")
    assert lines[-1].endswith(", unpacking")


def test_the_registry_names_the_image_under_its_address():
    registry = ship.Registry("172.30.77.1", 5000)
    assert registry.endpoint == "172.30.77.1:5000"
    assert registry.instance == "torch-multinode-registry-172-30-77-1-5000"
    assert registry.reference("torch-multinode/train:test") == (
        "172.30.77.1:5000/torch-multinode/train:test"
    )
    assert registry.reference("torch-multinode/train") == (
        "172.30.77.1:5000/torch-multinode/train:latest"
    )
    # the instance name is the one ansible/roles/image_registry gives its files (its vars'
    # expression rendered here, with stand-ins for ansible's regex_replace and zip filters)
    expression = yaml.safe_load(
        (REPO_ROOT / "ansible/roles/image_registry/vars/main.yml").read_text()
    )["image_registry_instance_names"]
    environment = jinja2.Environment()
    environment.filters["regex_replace"] = lambda text, pattern, by: re.sub(pattern, by, text)
    environment.filters["zip"] = lambda first, second: list(zip(first, second, strict=True))
    names = environment.from_string(expression).render(
        image_registry_addresses=["172.30.77.1"], image_registry_port_used=5000
    )
    assert ast.literal_eval(names) == {"172.30.77.1": registry.instance}


def _inventory(tmp_path, **cluster_vars):
    text = inventory_text({"n1": node(1), "n2": node(2)}, **cluster_vars)
    return parse(text, tmp_path / "inventory.yml")


def test_image_registry_false_streams_and_says_why(tmp_path):
    inventory = _inventory(tmp_path, image_registry=False)
    assert ship.find_registries(inventory) == ({}, "image_registry: false in the inventory")


def test_a_registry_never_set_up_for_the_address_streams_and_says_why(tmp_path, monkeypatch):
    inventory = _inventory(tmp_path, image_registry_port=5123)
    monkeypatch.setattr(ship, "REGISTRY_DIR", tmp_path / "none")
    route = json.dumps([{"dst": "10.7.0.11", "prefsrc": "10.7.0.1"}])
    monkeypatch.setattr(
        ship.subprocess,
        "run",
        lambda *a, **k: ship.subprocess.CompletedProcess(a, 0, route, ""),
    )
    assert ship.find_registries(inventory) == (
        {},
        "no registry is set up for 10.7.0.1:5123 (make provision sets it up)",
    )


def test_a_registry_that_does_not_answer_names_its_log(tmp_path, monkeypatch):
    inventory = _inventory(tmp_path)
    registry = ship.Registry("127.0.0.1", 9)  # discard port: nothing listens on loopback
    monkeypatch.setattr(ship, "registry_for", lambda host, port: registry)
    monkeypatch.setattr(ship, "REGISTRY_DIR", tmp_path)
    monkeypatch.setattr(ship, "CERTS_D", tmp_path / "certs.d")
    (tmp_path / f"{registry.instance}.yml").write_text("version: 0.1\n")
    (tmp_path / "certs.d" / registry.endpoint).mkdir(parents=True)
    (tmp_path / "certs.d" / registry.endpoint / "client.cert").write_text("x")
    found, why = ship.find_registries(inventory)
    assert found == {}
    assert why.startswith("the registry on 127.0.0.1:9 does not answer (")
    assert why.endswith(f"its log: /var/log/torch-multinode/{registry.instance}.log)")


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("yes", "cluster field 'image_registry': 'yes' is neither true nor false"),
        (70000, "field 'image_registry_port': 70000 is not a port number (1-65535)"),
    ],
)
def test_the_registry_fields_are_checked(tmp_path, value, error):
    field = "image_registry" if error.count("image_registry'") else "image_registry_port"
    with pytest.raises(ship.UserError, match=error.replace("(", r"\(").replace(")", r"\)")):
        _inventory(tmp_path, **{field: value})


def _archive(entries: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _diff_id(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_each_node_is_sent_the_archive_less_the_layers_it_holds():
    base, middle, top = b"base layer" * 10000, b"middle layer" * 3000, b"the changed top layer"
    entries = {
        "aaa/layer.tar": base,
        "aaa/json": b"{}",
        "bbb/layer.tar": middle,
        "ccc/layer.tar": top,
        "config.json": b'{"rootfs": "..."}',
        "manifest.json": b"[]",
    }
    outputs = {name: io.BytesIO() for name in ("n1", "n2", "n3")}
    sent = dict.fromkeys(outputs, 0)

    def counted(name):
        def on_sent(count):
            sent[name] += count

        return ship._Counted(outputs[name], on_sent)

    skip = {
        "n1": {_diff_id(base), _diff_id(middle)},  # holds the chain up to the top layer
        "n2": {_diff_id(base)},
        "n3": set(),  # holds nothing: everything
    }
    broken = ship._rewrite(
        io.BytesIO(_archive(entries)), {name: counted(name) for name in outputs}, skip
    )
    assert broken == {}
    received = {}
    for name, out in outputs.items():
        out.seek(0)
        with tarfile.open(fileobj=out, mode="r") as tar:
            received[name] = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        assert sent[name] == len(out.getvalue())
    assert received["n3"] == entries
    assert set(received["n2"]) == set(entries) - {"aaa/layer.tar"}
    assert set(received["n1"]) == {"aaa/json", "ccc/layer.tar", "config.json", "manifest.json"}
    assert received["n1"]["ccc/layer.tar"] == top
    assert sent["n1"] < sent["n2"] < sent["n3"]


def test_a_node_holds_the_longest_chain_any_of_its_images_shares(monkeypatch, tmp_path):
    layers = ["sha256:a", "sha256:b", "sha256:c"]
    answers = "\n".join(
        [
            json.dumps(["sha256:a", "sha256:x"]),  # shares one
            json.dumps(["sha256:a", "sha256:b"]),  # the base: shares two
            json.dumps(["sha256:b", "sha256:c"]),  # not from the bottom: none
            "not json",
        ]
    )

    class Finished:
        returncode = 0

        def communicate(self, timeout):
            return answers, ""

    monkeypatch.setattr(ship, "_on_node", lambda *a, **k: Finished())
    inventory = _inventory(tmp_path)
    assert ship.held_layers(inventory, inventory.hosts[0], layers) == 2
    answers = ""
    assert ship.held_layers(inventory, inventory.hosts[0], layers) == 0


def test_the_base_is_read_from_the_images_oci_label(monkeypatch):
    # what the engine prints for the label, then for an image without it
    replies = iter(["nvcr.io/nvidia/pytorch:25.12-py3\n", "\n"])
    monkeypatch.setattr(
        ship.images,
        "docker",
        lambda *args, **k: ship.subprocess.CompletedProcess(args, 0, next(replies), ""),
    )
    assert ship.base_of("img") == "nvcr.io/nvidia/pytorch:25.12-py3"
    assert ship.base_of("img") == ""


def test_a_node_of_another_architecture_is_refused_before_anything_moves(monkeypatch, tmp_path):
    inventory = _inventory(tmp_path)
    monkeypatch.setattr(ship, "image_id", lambda image: "sha256:" + "a" * 64)
    monkeypatch.setattr(
        ship, "node_images", lambda inv, image: {"n1": ("", "x86_64"), "n2": ("", "aarch64")}
    )
    monkeypatch.setattr(platforms, "image_architecture", lambda image: "amd64")
    moved = []
    monkeypatch.setattr(ship, "find_registries", lambda inv: moved.append("asked") or ({}, ""))
    with pytest.raises(ship.UserError) as refused:
        ship.ship(inventory, "t:1", emit=moved.append)
    assert refused.value.line() == (
        "Error: t:1 is built for linux/amd64, but n2 is linux/arm64 (try make provision "
        f"INVENTORY={inventory.path} (it builds for the nodes' platform))"
    )
    assert moved == []


def test_nodes_that_hold_the_image_are_left_alone(monkeypatch, tmp_path):
    inventory = _inventory(tmp_path)
    wanted = "sha256:" + "a" * 64
    monkeypatch.setattr(ship, "image_id", lambda image: wanted)
    monkeypatch.setattr(
        ship, "node_images", lambda inv, image: {"n1": (wanted, "x86_64"), "n2": (wanted, "x86_64")}
    )
    shipment = ship.ship(inventory, "t:1", emit=pytest.fail)
    assert (shipment.via, shipment.already) == ("", ["n1", "n2"])
    assert (
        ship_progress.summary(shipment)
        == "Every node already holds t:1 (aaaaaaaaaaaa): nothing sent."
    )


def test_a_node_the_registry_fails_gets_the_stream_and_is_told_why(monkeypatch, tmp_path):
    inventory = _inventory(tmp_path)
    wanted = "sha256:" + "a" * 64
    held = {"n1": "", "n2": ""}
    monkeypatch.setattr(ship, "image_id", lambda image: wanted)
    monkeypatch.setattr(
        ship, "node_images", lambda inv, image: {n: (i, "x86_64") for n, i in held.items()}
    )
    monkeypatch.setattr(platforms, "image_architecture", lambda image: "amd64")
    registry = ship.Registry("10.1.0.254", 5000)
    monkeypatch.setattr(ship, "find_registries", lambda inv: ({"n1": registry, "n2": registry}, ""))
    monkeypatch.setattr(ship, "push", lambda image, reg, emit: 100)

    def pull(inv, host, image, reg, emit):
        if host.name == "n2":
            raise ship.UserError("on n2: pulling t:1 from 10.1.0.254:5000 failed: no space left")
        held["n1"] = wanted
        return 10

    def stream(inv, hosts, image, emit):
        assert [host.name for host in hosts] == ["n2"]
        held["n2"] = wanted
        return {"n2": 99}

    monkeypatch.setattr(ship, "pull", pull)
    monkeypatch.setattr(ship, "stream", stream)
    said = []
    shipment = ship.ship(inventory, "t:1", emit=said.append)
    assert shipment.received == {"n1": 10, "n2": 99}
    assert said[-1] == (
        "Shipping t:1 (aaaaaaaaaaaa) to n2 by stream (docker save | ssh | docker load, each node "
        "sent only the layers it lacks): the registry failed them: on n2: pulling t:1 from "
        "10.1.0.254:5000 failed: no space left."
    )
    # asked for the registry alone, the same failure is the command's error
    held.update(n1="", n2="")
    with pytest.raises(ship.UserError, match="on n2: pulling t:1 .* no space left"):
        ship.ship(inventory, "t:1", via="registry", emit=said.append)


class _Request:
    """An engine request's process, as _follow reads it."""

    def __init__(self, lines, stderr="", code=0):
        self.stdout, self.stderr, self.code = iter(lines), io.StringIO(stderr), code

    def wait(self):
        return self.code


def test_an_engine_request_is_followed_to_its_bytes_or_its_reason():
    lines = [
        json.dumps(
            {"status": "Downloading", "progressDetail": {"current": 7, "total": 9}, "id": "a"}
        )
        + "\n",
        json.dumps({"status": "Pull complete", "id": "a"}) + "\n",
    ]
    clock, shown = Clock(), []
    meter = ship_progress.Meter("n1", shown.append, every=0.0, clock=clock)
    assert ship._follow(_Request(lines), meter) == (9, "")
    assert shown[0].startswith("[image] n1: 7 B of 9 B")
    failed = _Request(lines[:1], "ssh: connect to host 10.1.0.1 port 22: timed out\n", code=255)
    assert ship._follow(failed, meter) == (7, "ssh: connect to host 10.1.0.1 port 22: timed out")
    refused = _Request(['{"error": "unauthorized: authentication required"}\n'], code=0)
    assert ship._follow(refused, meter) == (0, "unauthorized: authentication required")
