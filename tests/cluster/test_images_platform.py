"""The training image built for the nodes' platform: their architecture asked over SSH (fake
nodes here), one platform or a refusal naming the nodes, --platform given to the build, and
the built image's architecture checked."""

from __future__ import annotations

import subprocess
import uuid

import pytest

from tests import helpers
from tests.fakes import FakeNodes
from torch_multinode.cluster import cli as cluster_cli
from torch_multinode.cluster import engine, execution
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.remote import Result
from torch_multinode.provision import images, platforms
from torch_multinode.sim import nodes as sim


@pytest.mark.parametrize(
    "architecture, platform",
    [
        ("x86_64", "linux/amd64"),
        ("aarch64", "linux/arm64"),
        ("amd64", "linux/amd64"),  # as an image records it
        ("arm64", "linux/arm64"),
        ("x86_64\n", "linux/amd64"),  # as uname -m prints it
        ("ppc64le", "linux/ppc64le"),
    ],
)
def test_a_machine_s_architecture_is_docker_s_platform(architecture, platform):
    assert platforms.platform_of(architecture) == platform


def test_an_architecture_docker_builds_nothing_for_is_refused():
    with pytest.raises(UserError) as refused:
        platforms.platform_of("sparc64")
    assert refused.value.line().startswith(
        "Error: architecture 'sparc64' is not one Docker builds images for (amd64, arm, arm64"
    )


def hosts(*names):
    inventory = helpers.inventory({name: helpers.node(n) for n, name in enumerate(names, 1)})
    return list(inventory.hosts)


def answering(machines: dict[str, str | Result]) -> FakeNodes:
    """Nodes that answer `uname -m` with their machine."""
    return FakeNodes(responder=lambda host, command: machines[host.name])


def test_nodes_of_one_architecture_give_their_platform_each_asked_once():
    nodes = answering({"n1": "x86_64\n", "n2": "x86_64\n"})
    assert platforms.nodes_platform(hosts("n1", "n2"), nodes) == "linux/amd64"
    assert sorted(nodes.commands) == [("n1", "uname -m"), ("n2", "uname -m")]
    arm = answering({"n1": "aarch64\n"})
    assert platforms.nodes_platform(hosts("n1"), arm) == "linux/arm64"


def test_nodes_that_differ_in_architecture_are_refused_naming_them():
    nodes = answering({"n1": "x86_64\n", "n2": "aarch64\n", "n3": "x86_64\n"})
    with pytest.raises(UserError) as refused:
        platforms.nodes_platform(hosts("n1", "n2", "n3"), nodes)
    assert refused.value.line() == (
        "Error: the nodes differ in architecture (n1, n3 are linux/amd64; n2 is linux/arm64), "
        "and one training image serves one (try an inventory or --group of nodes of one "
        "architecture)"
    )
    assert refused.value.exit_code == 2


def test_a_node_that_cannot_say_its_architecture_is_named():
    nodes = answering({"n1": "x86_64\n", "n2": "x86_64\n"})
    nodes.down = {"n2"}
    with pytest.raises(UserError) as refused:
        platforms.nodes_platform(hosts("n1", "n2"), nodes)
    assert refused.value.line() == (
        "Error: cannot learn the nodes' architecture, which the image is built for: host 'n2': "
        "cannot SSH to 10.1.0.2:22: timed out (try bringing the node back; make image without "
        "INVENTORY builds for this machine's platform)"
    )
    assert refused.value.exit_code == 1
    failing = answering(
        {"n1": Result("n1", "uname -m", 127, "", "sh: 1: uname: not found"), "n2": "x86_64"}
    )
    with pytest.raises(UserError, match="host 'n1': uname -m exited 127: sh: 1: uname: not found"):
        platforms.nodes_platform(hosts("n1", "n2"), failing)
    odd = answering({"n1": "mips\n"})
    with pytest.raises(UserError, match="host 'n1': architecture 'mips' is not one Docker"):
        platforms.nodes_platform(hosts("n1"), odd)


def test_an_image_of_another_architecture_is_refused_and_its_own_is_not():
    assert platforms.architecture_refusal("t:1", "amd64", "linux/amd64") is None
    refusal = platforms.architecture_refusal("t:1", "amd64", "linux/arm64")
    assert refusal.line() == (
        "Error: the image t:1 was built for linux/amd64, not the nodes' linux/arm64: the build "
        "did not follow --platform linux/arm64 (try building on a machine of the nodes' "
        "architecture)"
    )
    assert refusal.exit_code == 1


@pytest.fixture
def no_build(monkeypatch):
    """images.build with the engine's answers faked up to the docker build: the base is
    amd64, every docker build is recorded, never run."""
    built: list[dict] = []
    monkeypatch.setattr(images, "require_engine", lambda: None)
    monkeypatch.setattr(images, "debian_base", lambda *args: None)
    monkeypatch.setattr(images, "fetch_wheels", lambda progress, directory=None: None)
    monkeypatch.setattr(images, "recipe", lambda kind, base_image=None, root=None: "f00d")
    monkeypatch.setattr(images, "image_exists", lambda tag: False)
    monkeypatch.setattr(platforms, "image_architecture", lambda tag: "amd64")

    def docker_build(arguments, tag, progress, base, platform, context=None):
        built.append({"tag": tag, "platform": platform})
        raise UserError("stop here: the build was reached", exit_code=1)

    monkeypatch.setattr(images, "_docker_build", docker_build)
    return built


def test_the_build_is_pinned_to_the_nodes_platform(no_build):
    with pytest.raises(UserError, match="the build was reached"):
        images.build("cpu", "t:1", lambda _: None, platform="linux/amd64")
    assert no_build == [{"tag": "t:1", "platform": "linux/amd64"}]
    with pytest.raises(UserError, match="the build was reached"):
        images.build("cpu", "t:1", lambda _: None)  # no inventory: this machine's platform
    assert no_build[-1] == {"tag": "t:1", "platform": None}


def test_nodes_of_another_architecture_than_the_base_are_refused_before_any_build(no_build):
    with pytest.raises(UserError) as refused:
        images.build("cpu", "t:1", lambda _: None, platform="linux/arm64")
    assert refused.value.line() == (
        "Error: the nodes run linux/arm64, this machine linux/amd64: the image's Debian base and "
        "wheels are this machine's (try make image on a linux/arm64 machine, then make "
        "provision there)"
    )
    assert no_build == []


def test_an_up_to_date_image_of_another_architecture_is_built_again(no_build, monkeypatch):
    monkeypatch.setattr(images, "image_exists", lambda tag: True)
    monkeypatch.setattr(images, "image_label", lambda tag, name: "f00d")
    monkeypatch.setattr(images, "_image_id", lambda tag: "sha256:abc")
    monkeypatch.setattr(
        platforms, "image_architecture", lambda tag: "arm64" if tag == "t:1" else "amd64"
    )
    with pytest.raises(UserError, match="the build was reached"):
        images.build("cpu", "t:1", lambda _: None, platform="linux/amd64")
    monkeypatch.setattr(platforms, "image_architecture", lambda tag: "amd64")
    lines: list[str] = []
    assert images.build("cpu", "t:1", lines.append, platform="linux/amd64").up_to_date
    assert lines == ["t:1 is up to date: built from the same Dockerfile, base and wheels."]


def test_the_label_build_is_pinned_as_the_image_was():
    command, _ = images.label_command("sha256:abc", "t:1", "2.14.1", "f00d", "linux/arm64")
    assert command[:5] == ["docker", "build", "--quiet", "--platform", "linux/arm64"]
    unpinned, _ = images.label_command("sha256:abc", "t:1", "2.14.1", "f00d")
    assert "--platform" not in unpinned


def test_cluster_image_for_an_inventory_of_mixed_nodes_is_one_error_line(
    monkeypatch, tmp_path, capsys
):
    path = tmp_path / "inventory.yml"
    path.write_text(
        helpers.inventory_text(
            {"n1": helpers.node(1), "n2": helpers.node(2)}, launch_mode="container"
        )
    )
    nodes = answering({"n1": "x86_64\n", "n2": "aarch64\n"})
    monkeypatch.setattr(execution, "SshNodes", lambda inventory: nodes)
    monkeypatch.setattr(sim, "require_engine", lambda: None)
    monkeypatch.setattr(images, "build", lambda *a, **k: pytest.fail("nothing is built"))
    assert cluster_cli.main(["image", "-i", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        "Error: the nodes differ in architecture (n1 is linux/amd64; n2 is linux/arm64), and one "
        "training image serves one (try an inventory or --group of nodes of one architecture)\n"
    )
    assert nodes.closed


def test_cluster_image_for_an_inventory_builds_for_its_nodes(monkeypatch, tmp_path, capsys):
    path = tmp_path / "inventory.yml"
    path.write_text(helpers.inventory_text({"n1": helpers.node(1)}, launch_mode="container"))
    monkeypatch.setattr(execution, "SshNodes", lambda inventory: answering({"n1": "aarch64\n"}))
    monkeypatch.setattr(sim, "require_engine", lambda: None)
    asked = {}

    def build(kind, tag, progress=None, base_image=None, platform=None):
        asked.update(kind=kind, tag=tag, platform=platform)
        raise UserError("stop here", exit_code=1)

    monkeypatch.setattr(images, "build", build)
    assert cluster_cli.main(["image", "-i", str(path)]) == 1
    assert asked == {
        "kind": "cpu",
        "tag": "torch-multinode/train:latest",
        "platform": "linux/arm64",
    }
    assert "The 1 node(s) run linux/arm64: the image is built for it." in capsys.readouterr().err


def test_an_image_s_architecture_is_read_from_this_engine():
    """On an image made here (docker import: nothing pulled), and a missing one refused."""
    engine.require_engine()
    tag = f"tmn-arch:{uuid.uuid4().hex[:8]}"
    subprocess.run(
        f"tar cf - --files-from /dev/null | docker import - {tag}",
        shell=True,
        check=True,
        capture_output=True,
    )
    try:
        here = sim.docker("info", "--format", "{{.Architecture}}").stdout.strip()
        assert platforms.platform_of(platforms.image_architecture(tag)) == platforms.platform_of(
            here
        )
    finally:
        sim.docker("rmi", tag, check=False)
    with pytest.raises(UserError, match=f"no image {tag} on this machine's engine"):
        platforms.image_architecture(tag)


@pytest.mark.parametrize("gpus", [True, False])
def test_the_built_images_report_counts_this_machines_gpus_when_it_has_some(
    monkeypatch, capsys, gpus
):
    # Without --gpus a CUDA image always reports "gpus: 0", even on a GPU controller.
    monkeypatch.setattr(
        images,
        "build",
        lambda kind, tag, **_: images.BuiltImage(tag, kind, "sha256:" + "ab" * 32, 1.0, "2.14.1"),
    )
    monkeypatch.setattr(images, "gpu_present", lambda: gpus)
    asked = {}

    def versions(tag, gpus=False):
        asked.update(tag=tag, gpus=gpus)
        return {"torch": "2.14.1", "gpus": "2" if gpus else "0"}

    monkeypatch.setattr(images, "versions", versions)
    assert cluster_cli.main(["image", "--kind", "cuda", "--tag", "tmn-report:1"]) == 0
    assert asked == {"tag": "tmn-report:1", "gpus": gpus}
    assert f"  gpus: {2 if gpus else 0}\n" in capsys.readouterr().out
