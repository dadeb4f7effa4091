"""The training image's CPU twin: built from docker/Dockerfile, it says what it holds, and it
is the environment only: editing the project's code leaves the image as it is."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
import tomllib
import urllib.request

import pytest

from tests.image_layers import install_step
from torch_multinode import cluster
from torch_multinode.bench.rebuild import edit_line, scratch_checkout
from torch_multinode.cluster.engine import docker
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.versions import TORCH_LABEL
from torch_multinode.provision import images
from torch_multinode.sim.nodes import REPO_ROOT

# The first of these to ask for the training image builds it in its set-up (the torch wheels
# fetched, the base made, the image built, and the `provisioned` pair readied beside them):
# near 15 minutes on two loaded cores (CI run 30 stopped it at the default 900 s, mid-build). The
# limit only keeps a hang from holding the run.
pytestmark = pytest.mark.timeout(2400)


def test_image_pins_follow_the_project_pins():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert f"torch=={images.TORCH_VERSION}" in project["dependencies"]
    assert f"torchvision=={images.TORCHVISION_VERSION}" in project["dependencies"]
    # What the wheels are fetched for is what the image installs from them.
    dockerfile = images.DOCKERFILE.read_text()
    for requirement in (images.TENSORBOARD_REQUIREMENT, images.PYYAML_REQUIREMENT):
        assert requirement in project["dependencies"]
        assert f'"{requirement}"' in dockerfile
    assert f"py-spy=={images.PY_SPY_VERSION}" in project["dependencies"]
    assert f"ARG PY_SPY_VERSION={images.PY_SPY_VERSION}\n" in dockerfile
    assert f"torchft=={images.TORCHFT_VERSION}" in project["dependencies"]
    assert f"ARG TORCHFT_VERSION={images.TORCHFT_VERSION}\n" in dockerfile


def test_build_arguments_choose_the_base():
    # Both kinds: the Debian base and the pinned wheels, the torch the tests run; the CUDA
    # image keeps the GPU libraries the CPU twin drops. (The CUDA kind was NVIDIA's
    # pytorch:25.12, whose torch 2.10 lacks what the code calls.)
    # The wheels are served on the engine's loopback, which the build reaches on the host's
    # network: they never enter the context or a layer. Their server's address changes from
    # build to build and goes only into --add-host, which no layer's cache key holds: the
    # build arguments (which the keys hold) are the same whatever the address.
    for kind, keep in (("cuda", "1"), ("cpu", "0")):
        arguments = images.build_args(kind, None, "127.31.41.59")
        assert f"BASE_IMAGE={images.CPU_BASE_IMAGE}" in arguments
        assert "WHEELS_URL=http://tmn-wheels:47719/" in arguments
        assert images.WHEELS_URL == "http://tmn-wheels:47719/"
        assert f"KEEP_GPU_LIBRARIES={keep}" in arguments
        assert arguments[arguments.index("--network") + 1] == "host"
        assert arguments[arguments.index("--add-host") + 1] == "tmn-wheels:127.31.41.59"
        other = images.build_args(kind, None, "127.2.7.18")
        assert [a for a in other if "127." not in a] == [a for a in arguments if "127." not in a]
        assert [a for a in other if "127." in a] == ["tmn-wheels:127.2.7.18"]
    # Another base brings its own torch: no wheels, nothing to keep or strip, no host network.
    nvidia = images.build_args("cuda", "nvcr.io/nvidia/pytorch:26.10-py3")
    assert "BASE_IMAGE=nvcr.io/nvidia/pytorch:26.10-py3" in nvidia
    assert not any(a.startswith(("WHEELS_URL=", "KEEP_GPU_LIBRARIES=")) for a in nvidia)
    assert "--network" not in nvidia and "--add-host" not in nvidia
    with pytest.raises(UserError, match="image kind 'rocm' is not one of auto, cpu, cuda"):
        images.build_args("rocm")


def test_the_dockerfile_strips_gpu_libraries_only_for_the_cpu_twin():
    lines = images.DOCKERFILE.read_text().splitlines()
    dockerfile = "\n".join(line for line in lines if not line.startswith("#"))
    assert "ARG BASE_IMAGE\n" in dockerfile  # make image names the base, after its packages
    assert "ARG KEEP_GPU_LIBRARIES=0" in dockerfile
    # One stage: the venv is one layer, made in the RUN that strips it, with no copy of it or
    # of the wheels anywhere in the build.
    assert dockerfile.count("FROM ") == 1 and "COPY --from" not in dockerfile
    assert '--find-links "${WHEELS_URL}"' in dockerfile
    assert 'if [ "${KEEP_GPU_LIBRARIES}" != 1 ]; then' in dockerfile
    assert "nvcr.io/nvidia/pytorch:25.12" not in dockerfile
    # torch's default (3, tear down without aborting the communicators) is not overridden.
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=" not in dockerfile
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in dockerfile
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in dockerfile
    # Nothing that changes between builds or releases sits below the install: the project's
    # version (an ARG in the install's cache key, a LABEL below it) and the copied files come
    # after it, so changing them rebuilds only the small layers above.
    install = dockerfile.index("pip install")
    assert "--trusted-host tmn-wheels" in dockerfile
    for later in ("ARG PROJECT_VERSION", "LABEL ", "COPY docker/entrypoint.sh", "COPY cluster/"):
        assert dockerfile.index(later) > install, later
    # The check that imports torch (tens of seconds) runs below what changes most: an edited
    # entrypoint or a new project version rebuilds only a label, an ENV and a COPY.
    check = dockerfile.index('RUN python3 -c "import torch')
    for later in ("ARG PROJECT_VERSION", "LABEL ", "COPY docker/entrypoint.sh"):
        assert dockerfile.index(later) > check, later


def test_the_base_brings_compilers_python_headers_and_rdma_libraries():
    # torch.compile needs a C compiler and Python's headers (triton's launcher), and a C++
    # compiler (inductor's CPU kernels); NCCL loads rdma-core's userspace libraries for IB/RoCE.
    # Both kinds share the base; its name follows its packages, so a machine holding a base
    # made from an older list makes the new one.
    for package in ("gcc", "g++", "python3-dev", "libibverbs1", "ibverbs-providers", "librdmacm1"):
        assert package in images.CPU_BASE_PACKAGES
    digest = hashlib.sha256(" ".join(images.CPU_BASE_PACKAGES).encode()).hexdigest()[:8]
    assert images.CPU_BASE_IMAGE == f"torch-multinode/debian-python:bookworm-{digest}"


NVIDIA_HINT = (
    "(try make image without BASE_IMAGE, the default build with the pinned torch 2.14.1, or a "
    "newer NVIDIA release)"
)


def test_a_base_with_an_older_torch_is_refused_naming_the_base_both_versions_and_the_way_out():
    nvidia = "nvcr.io/nvidia/pytorch:25.12-py3"
    refusal = images.torch_refusal("2.10.0a0+b558c986e8.nv25.12", nvidia)
    assert refusal.line() == (
        "Error: base nvcr.io/nvidia/pytorch:25.12-py3 carries torch 2.10.0a0+b558c986e8.nv25.12, "
        f"older than the 2.14 this project needs {NVIDIA_HINT}"
    )
    assert refusal.exit_code == 1
    assert images.torch_refusal("none", nvidia).line() == (
        f"Error: base nvcr.io/nvidia/pytorch:25.12-py3 brings no torch (its --version says "
        f"torch: none) {NVIDIA_HINT}"
    )
    # A pre-release of the minimum counts as the minimum (NVIDIA's '2.N.0a0' builds).
    assert images.torch_refusal("2.14.0a0+4c1f3b2.nv26.10", nvidia) is None
    assert images.torch_refusal("2.15.1", nvidia) is None


def test_the_pinned_wheels_must_have_installed_the_pinned_torch():
    assert images.torch_refusal("2.14.1+cu130", None) is None
    assert images.torch_refusal("2.14.1", None) is None
    assert images.torch_refusal("2.15.0+cu130", None).line() == (
        "Error: the image reports torch 2.15.0+cu130, not the pinned 2.14.1 its wheels should "
        "have installed (try make image again (docker/wheels may hold other wheels: delete it to "
        "refetch))"
    )
    old = images.torch_refusal("2.10.0+cu130", None).line()
    assert old.startswith(
        f"Error: base {images.CPU_BASE_IMAGE} carries torch 2.10.0+cu130, older "
        "than the 2.14 this project needs (try make image again"
    )


def test_the_label_step_records_the_torch_cuda_and_nccl_the_image_reported():
    stack = {"cuda": "13.0", "nccl": "2.30.7"}
    command, dockerfile = images.label_command(
        "sha256:abc", "tmn/train:x", "2.14.1+cu130", "f00d", stack=stack
    )
    assert command == [
        "docker",
        "build",
        "--quiet",
        "--label",
        "io.torch-multinode.torch=2.14.1+cu130",
        "--label",
        "io.torch-multinode.cuda=13.0",
        "--label",
        "io.torch-multinode.nccl=2.30.7",
        "--label",
        "io.torch-multinode.recipe=f00d",
        "-t",
        "tmn/train:x",
        "-",
    ]
    assert dockerfile == "FROM sha256:abc\n"
    assert TORCH_LABEL == "io.torch-multinode.torch"
    # built on a registry's image (BASE_IMAGE=), the base is recorded for nodes that pull it
    on_base, _ = images.label_command(
        "sha256:abc", "tmn/train:x", "2.14.1", "f00d", base_image="nvcr.io/nvidia/pytorch:25.12-py3"
    )
    assert on_base[-5:-3] == [
        "--label",
        "org.opencontainers.image.base.name=nvcr.io/nvidia/pytorch:25.12-py3",
    ]


@pytest.mark.sim
def test_image_reports_the_versions_inside(training_image):
    found = images.versions(training_image.tag)
    assert found["torch"].startswith(images.TORCH_VERSION)
    assert found["torchvision"].startswith(images.TORCHVISION_VERSION)
    assert re.fullmatch(r"\d+\.\d+\.\d+", found["tensorboard"]), found["tensorboard"]
    # No project code inside: the version is the one recorded when the image was built.
    assert found["torch-multinode"] == cluster.__version__
    assert found["python"].startswith(f"{images.CPU_BASE_PYTHON}.")
    assert re.fullmatch(r"\d+\.\d+\.\d+", found["nccl"]) and found["gpus"] == "0"
    # What only a GPU loads is gone from the twin; the label says which torch it carries, as
    # the image itself reported it.
    assert found["cudnn-engines"] == "absent" and found["triton"] == "none"
    assert training_image.torch == found["torch"]
    assert images.torch_label(training_image.tag) == found["torch"]
    # ... and its CUDA and NCCL, which each node's lock and run record read from the labels.
    assert images.stack_labels(training_image.tag) == {
        field: found[field] for field in ("torch", "cuda", "nccl")
    }
    # Its default command is the same report, --json the same as a mapping; anything else
    # runs as given.
    plain = docker("run", "--rm", training_image.tag).stdout
    assert plain.splitlines()[0] == f"python: {found['python']}"
    as_json = docker("run", "--rm", training_image.tag, "--version", "--json").stdout
    assert json.loads(as_json) == found
    imported = docker("run", "--rm", training_image.tag, "python3", "-c", "import tensorboard")
    assert imported.returncode == 0
    # The environment only: the project's code reaches the nodes at run time.
    code = docker(
        "run", "--rm", training_image.tag, "test", "-e", "/opt/torch-multinode", check=False
    )
    assert code.returncode == 1, code.stderr
    package = docker(
        "run", "--rm", training_image.tag, "python3", "-c", "import cluster", check=False
    )
    assert "No module named 'cluster'" in package.stderr, package.stderr


@pytest.mark.sim
def test_build_context_holds_only_the_environment(training_image, tmp_path):
    """The repository's .dockerignore lets in docker/'s build files and cluster/versions.py,
    nothing of the code a user edits."""
    context = tmp_path / "context"
    for name in (
        "cluster/__init__.py",
        "cluster/versions.py",
        "training/settings/config.py",
        "netcheck/cli.py",
        "pyproject.toml",
        ".venv/bin/python",
        "docker/Dockerfile",
        "docker/entrypoint.sh",
        "docker/wheels/torch-0-py3-none-any.whl",
        "docker/sim-node/Dockerfile",
    ):
        (context / name).parent.mkdir(parents=True, exist_ok=True)
        (context / name).write_text("")
    (context / ".dockerignore").write_text((REPO_ROOT / ".dockerignore").read_text())
    probe = tmp_path / "probe.Dockerfile"
    probe.write_text(
        f"FROM {images.CPU_BASE_IMAGE}\nCOPY . /context\n"
        "RUN cd /context && find . -type f > /files\n"
    )
    tag = f"{training_image.tag}-context-probe"
    docker("build", "--quiet", "-f", str(probe), "-t", tag, str(context))
    try:
        files = sorted(docker("run", "--rm", "--entrypoint", "cat", tag, "/files").stdout.split())
    finally:
        docker("rmi", tag, check=False)
    assert files == [
        "./cluster/versions.py",
        "./docker/Dockerfile",
        "./docker/entrypoint.sh",
    ]


@pytest.mark.sim
def test_editing_the_code_leaves_the_image_as_it_is(training_image, tmp_path):
    # What the image is made from is unchanged by an edit to the code, and changed by an edit
    # to what the build reads; the kind and the base count too.
    copy = scratch_checkout(tmp_path / "copy")
    made_from = images.recipe("cpu")
    assert images.recipe("cpu", root=copy) == made_from
    edit_line(copy / "training" / "settings" / "config.py", "# a one-line change")
    assert images.recipe("cpu", root=copy) == made_from
    assert images.recipe("cuda", root=copy) != made_from
    assert images.recipe("cpu", "nvcr.io/nvidia/pytorch:26.10-py3", root=copy) != made_from
    edit_line(copy / "docker" / "entrypoint.sh", "# a one-line change")
    assert images.recipe("cpu", root=copy) != made_from

    # The image the fixture built records that recipe, and building it again builds nothing:
    # the same image, said to be up to date.
    assert images.image_label(training_image.tag, images.RECIPE_LABEL) == made_from
    said: list[str] = []
    again = images.build("cpu", training_image.tag, progress=said.append)
    assert again.image_id == training_image.image_id and again.torch == training_image.torch
    assert said[-1] == (
        f"{training_image.tag} is up to date: built from the same Dockerfile, base and wheels."
    )
    assert not [line for line in said if line.startswith("  Step ")]


def test_the_wheels_are_served_on_loopback_for_the_builds_length_only(tmp_path):
    (tmp_path / "torch-0-py3-none-any.whl").write_bytes(b"wheel")
    with images.serve_wheels(tmp_path) as address, images.serve_wheels(tmp_path) as beside:
        # the same port each time, on a loopback address of each server's own
        assert ipaddress.ip_address(address).is_loopback and address != beside
        url = f"http://{address}:{images.WHEELS_PORT}/"
        page = urllib.request.urlopen(url, timeout=10).read().decode()
        assert 'href="torch-0-py3-none-any.whl"' in page
        assert urllib.request.urlopen(url + "torch-0-py3-none-any.whl", timeout=10).read() == (
            b"wheel"
        )
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=10)


@pytest.mark.sim
def test_rdma_libraries_load_in_the_cpu_twin(training_image):
    """rdma-core's userspace libraries, which NCCL's InfiniBand/RoCE transport opens. That
    torch.compile builds its kernels in this image (the base's g++ and Python's headers) is
    proven where users meet it: `make selftest`'s compile check on both simulated nodes, in
    these containers (tests/docker/test_selftest_cluster.py)."""
    script = (
        "import ctypes\n"
        "for name in ('libibverbs.so.1', 'librdmacm.so.1'):\n"
        "    ctypes.CDLL(name)\n"
        "print('loaded')\n"
    )
    proc = docker("run", "--rm", training_image.tag, "python3", "-c", script, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "loaded", proc.stderr[-3000:]


@pytest.mark.sim
def test_a_changed_entrypoint_rebuilds_only_the_layers_above_the_install(
    training_image, entrypoint_rebuild
):
    """Two builds through images.build (the fixture's, from the checkout, and one from a copy
    whose docker/entrypoint.sh has one more line): the torch install is the same layer, and
    only the steps above it were made anew. Nothing in a cache key changes between builds: the
    wheels' server took another address, not another URL."""
    tag = entrypoint_rebuild.tag
    assert entrypoint_rebuild.image_id != training_image.image_id
    assert not entrypoint_rebuild.up_to_date
    install, above = install_step(tag)
    first_install, first_above = install_step(training_image.tag)
    assert install.image_id == first_install.image_id  # the same 3.8 GB layer, not rebuilt
    assert install.size > 1_000_000_000
    new = {step.image_id for step in above} - {step.image_id for step in first_above}
    # what was made anew is small (py-spy's layer, 8 MB, above the install, was kept)
    assert new and sum(step.size for step in above if step.image_id in new) < 1_000_000, above
    layers = docker("image", "inspect", "--format", "{{json .RootFS.Layers}}", tag).stdout
    first = docker(
        "image", "inspect", "--format", "{{json .RootFS.Layers}}", training_image.tag
    ).stdout
    shared = [a == b for a, b in zip(json.loads(layers), json.loads(first), strict=False)]
    assert shared.count(True) >= 2 and shared[:2] == [True, True], shared  # base, venv
