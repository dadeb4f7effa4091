"""provision.dependencies: a project's requirements as a layer on the training image (issue 50),
what the image holds (provision.held_packages) and their resolution (provision.resolution), with
no Docker engine and no package index: the engine is a fake that answers `docker image inspect`,
the image's probe and the build, and pip is a fake that answers as pip does (its real lines,
measured with pip 23). Two checks run the real pip offline on wheels made here: that a
stand-in wins over the index's copy of the same version, and that a conflict reads as pip
writes it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from tests.conftest import VENV_BIN
from torch_multinode.bench.wheels import wheel
from torch_multinode.cluster.errors import UserError
from torch_multinode.provision import dependencies, held_packages, images, resolution, ship
from torch_multinode.provision.ship_progress import Shipment

BASE = "torch-multinode/train:latest"
WHERE = types.SimpleNamespace(training_image=BASE)  # an inventory, as far as the layer asks
BASE_ID = "sha256:" + "b" * 64
TAGS = [
    "cp311-cp311-manylinux_2_36_x86_64",
    "cp311-cp311-manylinux_2_17_x86_64",
    "cp311-abi3-manylinux_2_17_x86_64",
    "cp311-none-manylinux_2_17_x86_64",
    "py3-none-manylinux_2_17_x86_64",
    "py3-none-any",
]
INSTALLED = {
    "torch": "2.14.1",
    "torchvision": "0.29.1",
    "triton": "3.8.0",
    "nvidia-cublas": "13.1.1.3",
    "nvidia_nccl_cu13": "2.30.7",
    "cuda-bindings": "13.5.0",
    "numpy": "2.4.6",
    "PyYAML": "6.0.4",
}
PROBED = {"python": "3.11", "tags": TAGS, "installed": INSTALLED}
SOURCE = "requirements.txt"


def environment(where: str = f"the training image {BASE}") -> held_packages.Environment:
    return held_packages.environment_from(json.dumps(PROBED), where)


class FakeEngine:
    """This machine's Docker engine, as provision.dependencies and held_packages ask it: images
    by name or ID with their labels, the image's probe, `docker tag`, and builds (recorded, never
    run)."""

    def __init__(self) -> None:
        self.images: dict[str, tuple[str, dict[str, str]]] = {BASE: (BASE_ID, {})}
        self.calls: list[tuple[str, ...]] = []
        self.builds: list[tuple[str, str, list[str]]] = []

    def find(self, name: str) -> tuple[str, dict[str, str]] | None:
        if name in self.images:
            return self.images[name]
        return next((found for found in self.images.values() if found[0] == name), None)

    def docker(self, *args: str, check: bool = True, timeout=None, stdin=None):
        self.calls.append(args)
        if args[:2] == ("image", "inspect"):
            found = self.find(args[-1])
            if found is None:
                return subprocess.CompletedProcess(args, 1, "", f"Error: No such image: {args[-1]}")
            if "json .Config.Labels" in args[3]:  # the ID and the labels, tab between
                answer = f"{found[0]}\t{json.dumps(found[1] or None)}\n"
                return subprocess.CompletedProcess(args, 0, answer, "")
            return subprocess.CompletedProcess(args, 0, found[0] + "\n", "")
        if args[0] == "run":
            assert "--network" in args and args[args.index("--entrypoint") + 1] == "python3"
            return subprocess.CompletedProcess(args, 0, json.dumps(PROBED) + "\n", "")
        if args[0] == "tag":
            self.images[args[2]] = self.find(args[1])
            return subprocess.CompletedProcess(args, 0, "", "")
        raise AssertionError(f"unexpected docker {args}")

    def label(self, tag: str, name: str) -> str:
        return self.find(tag)[1].get(name, "")

    def build_from(self, arguments: list[str], tag: str, progress, context: Path) -> None:
        text = Path(arguments[arguments.index("-f") + 1]).read_text()
        labels = dict(
            arguments[i + 1].split("=", 1) for i, a in enumerate(arguments) if a == "--label"
        )
        self.builds.append((tag, text, arguments))
        progress("Step 1/2 : FROM " + BASE_ID)
        self.images[tag] = ("sha256:" + hashlib.sha256(tag.encode()).hexdigest(), labels)


@pytest.fixture
def engine(monkeypatch, tmp_path) -> FakeEngine:
    fake = FakeEngine()
    monkeypatch.setattr(held_packages, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(held_packages, "docker", fake.docker)  # the image's probe
    monkeypatch.setattr(dependencies, "docker", fake.docker)  # the layer's inspect and tag
    monkeypatch.setattr(images, "image_label", fake.label)
    monkeypatch.setattr(images, "build_from", fake.build_from)

    @contextlib.contextmanager
    def served(directory: Path):
        assert directory.is_dir()
        yield "127.0.0.9"

    monkeypatch.setattr(images, "serve_wheels", served)
    return fake


class FakePip:
    """`python -m pip` as provision.resolution runs it (run_pip): each call answered in turn by
    a function of its arguments, which may write wheels where pip would."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.calls: list[list[str]] = []
        self.constraints: list[str] = []

    def __call__(self, arguments: list[str], emit=None, what: str = "") -> tuple[int, str]:
        self.calls.append(arguments)
        if "-c" in arguments:
            self.constraints.append(Path(arguments[arguments.index("-c") + 1]).read_text())
        return self.answers.pop(0)(arguments)


def _option(arguments: list[str], name: str) -> Path:
    return Path(arguments[arguments.index(name) + 1])


def saving(*wheels: tuple[str, str]):
    """A pip download that succeeds, saving these (name, version) wheels into its --dest."""

    def answer(arguments: list[str]) -> tuple[int, str]:
        assert arguments[0] == "download"
        for name, version in wheels:
            wheel(_option(arguments, "--dest"), name, version)
        return 0, "Successfully downloaded\n"

    return answer


def failing(output: str):
    return lambda arguments: (1, output)


def never(*args, **kwargs):
    raise AssertionError("nothing may be downloaded or built")


# -- what is held, and the refusal -----------------------------------------------------------


def test_torch_torchvision_triton_and_the_cuda_libraries_are_the_constraints():
    held = held_packages.constraints(environment())
    assert held.splitlines() == [
        "cuda-bindings==13.5.0",
        "nvidia-cublas==13.1.1.3",
        "nvidia_nccl_cu13==2.30.7",
        "torch==2.14.1",
        "torchvision==0.29.1",
        "triton==3.8.0",
    ]
    assert "numpy" not in held and "PyYAML" not in held  # kept, but a requirement may move them


@pytest.mark.parametrize(
    "requirement, name, have",
    [
        ("torch==2.13.0", "torch", "2.14.1"),
        ("torchvision<0.20", "torchvision", "0.29.1"),
        ("nvidia-cublas==12.0.0", "nvidia-cublas", "13.1.1.3"),
        ("Triton>=4", "triton", "3.8.0"),
    ],
)
def test_a_requirement_that_would_replace_a_held_package_is_refused_in_one_line_before_anything(
    engine, monkeypatch, requirement, name, have
):
    monkeypatch.setattr(resolution, "run_pip", never)
    with pytest.raises(UserError) as refused:
        dependencies.prepare_layer(BASE, ["omegaconf", requirement], SOURCE, print)
    assert refused.value.line() == (
        f"Error: {SOURCE}: {requirement}, which would replace the {name} {have} of the training "
        f"image {BASE} (try leaving {name} out of {SOURCE}, or a range that holds {have}: jobs "
        "run with the torch, torchvision and CUDA libraries of the environment they run in)"
    )
    assert "\n" not in refused.value.line()
    assert engine.builds == [] and not any(call[0] == "build" for call in engine.calls)


def test_a_requirement_that_agrees_with_the_held_versions_is_no_refusal():
    found = held_packages.refusal(
        ["torch>=2.14", "torchvision==0.29.*", "torch==2.0; python_version < '3'", "tqdm"],
        SOURCE,
        environment(),
    )
    assert found is None


def test_a_dependency_that_needs_another_torch_is_refused_naming_it_before_any_build(engine):
    # pip 23's own words for `torchaudio==2.0.1` against the image's torch (measured here)
    said = (
        "ERROR: Cannot install torchaudio==2.0.1 because these package versions have "
        "conflicting dependencies.\n\nThe conflict is caused by:\n"
        "    The user requested torch>=2.0\n"
        "    torchaudio 2.0.1 depends on torch==2.0.0\n"
        "    The user requested (constraint) torch==2.14.1\n\n"
        "To fix this you could try to:\n1. loosen the range of package versions you've specified\n"
    )
    pip = FakePip(failing(said))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(resolution, "run_pip", pip)
        with pytest.raises(UserError) as refused:
            dependencies.prepare_layer(BASE, ["torch>=2.0", "torchaudio==2.0.1"], SOURCE, print)
    assert refused.value.line() == (
        f"Error: {SOURCE}: torchaudio 2.0.1 depends on torch==2.0.0, which would replace the "
        f"torch 2.14.1 of the training image {BASE} (try another version of torchaudio in "
        f"{SOURCE}, one that takes torch 2.14.1: jobs run with the torch, torchvision and CUDA "
        "libraries of the environment they run in)"
    )
    assert len(pip.calls) == 1 and engine.builds == []


# -- the resolution ----------------------------------------------------------------------------


def test_the_download_is_for_the_images_own_python_and_platforms_against_its_stand_ins(engine):
    pip = FakePip(saving(("omegaconf", "2.4.0"), ("tqdm", "4.70.1")))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(resolution, "run_pip", pip)
        found = resolution.resolve(
            ["omegaconf", "tqdm"], SOURCE, environment(), held_packages.CACHE / "x", print
        )
    assert found == ("omegaconf==2.4.0", "tqdm==4.70.1")
    (arguments,) = pip.calls
    assert arguments[:1] == ["download"] and "--only-binary=:all:" in arguments
    assert [arguments[i + 1] for i, a in enumerate(arguments) if a == "--platform"] == [
        "manylinux_2_36_x86_64",
        "manylinux_2_17_x86_64",
    ]
    assert _option(arguments, "--python-version") == Path("3.11")
    assert (_option(arguments, "--abi"), _option(arguments, "--implementation")) == (
        Path("cp311"),
        Path("cp"),
    )
    # Every distribution of the image has a stand-in among the find-links, pinned: the held
    # ones by the constraints, the others to keep the image's version unless a requirement
    # needs another.
    links = [Path(arguments[i + 1]) for i, a in enumerate(arguments) if a == "--find-links"]
    stand_ins = sorted(path.name for path in links[0].iterdir())
    assert "torch-2.14.1+tmnheld-py3-none-any.whl" in stand_ins and len(stand_ins) == 8
    assert pip.constraints[0].splitlines()[-2:] == ["numpy==2.4.6", "PyYAML==6.0.4"]
    assert held_packages.constraints(environment()) in pip.constraints[0]
    # Resolved once: the same directory answers from its cache.
    again = resolution.resolve(["x"], SOURCE, environment(), held_packages.CACHE / "x", never)
    assert again == found


def test_a_stand_in_the_resolution_took_is_not_what_the_layer_adds(engine):
    pip = FakePip(saving(("omegaconf", "2.4.0"), ("PyYAML", "6.0.4+tmnheld")))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(resolution, "run_pip", pip)
        found = resolution.resolve(
            ["omegaconf"], SOURCE, environment(), held_packages.CACHE / "y", print
        )
    assert found == ("omegaconf==2.4.0",)
    assert sorted(p.name for p in (held_packages.CACHE / "y" / "wheels").iterdir()) == [
        "omegaconf-2.4.0-py3-none-any.whl"
    ]


def test_a_requirement_that_needs_another_version_of_a_kept_package_lets_its_pin_go(engine):
    said = (
        "The conflict is caused by:\n    foo 1.0 depends on numpy>=99\n"
        "    The user requested (constraint) numpy==2.4.6\n\n"
    )
    lines: list[str] = []
    pip = FakePip(failing(said), saving(("foo", "1.0"), ("numpy", "99.0")))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(resolution, "run_pip", pip)
        found = resolution.resolve(
            ["foo"], SOURCE, environment(), held_packages.CACHE / "z", lines.append
        )
    assert found == ("foo==1.0", "numpy==99.0")
    assert "numpy==2.4.6" in pip.constraints[0] and "numpy==" not in pip.constraints[1]
    assert "torch==2.14.1" in pip.constraints[1]  # the held ones never let go
    assert any("needs another version of numpy" in line for line in lines)


def test_a_requirement_published_only_as_source_is_built_into_a_wheel_here(engine):
    missing = (
        "ERROR: Could not find a version that satisfies the requirement "
        "antlr4-python3-runtime==4.9.* (from omegaconf) (from versions: 4.11.0, 4.13.2)\n"
        "ERROR: No matching distribution found for antlr4-python3-runtime==4.9.*\n"
    )

    def build(arguments: list[str]) -> tuple[int, str]:
        assert arguments[:2] == ["wheel", "--no-deps"] and arguments[-1] == (
            "antlr4-python3-runtime==4.9.*"
        )
        wheel(_option(arguments, "--wheel-dir"), "antlr4-python3-runtime", "4.9.3")
        return 0, "Successfully built antlr4-python3-runtime\n"

    def download(arguments: list[str]) -> tuple[int, str]:
        links = [Path(arguments[i + 1]) for i, a in enumerate(arguments) if a == "--find-links"]
        (built,) = [p for p in links[1].iterdir()]  # the wheel made here is offered to pip
        shutil.copy(built, _option(arguments, "--dest"))
        wheel(_option(arguments, "--dest"), "omegaconf", "2.3.0")
        return 0, ""

    lines: list[str] = []
    pip = FakePip(failing(missing), build, download)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(resolution, "run_pip", pip)
        found = resolution.resolve(
            ["omegaconf==2.3.0"], SOURCE, environment(), held_packages.CACHE / "s", lines.append
        )
    assert found == ("antlr4-python3-runtime==4.9.3", "omegaconf==2.3.0")
    assert any("has no wheel on the package index: building one here" in line for line in lines)


def test_a_wheel_built_here_for_another_platform_than_the_images_is_refused(engine, tmp_path):
    missing = "Could not find a version that satisfies the requirement fastthing==1.0\n"

    def build(arguments: list[str]) -> tuple[int, str]:
        made = _option(arguments, "--wheel-dir") / "fastthing-1.0-cp312-cp312-linux_aarch64.whl"
        made.write_bytes(b"")
        return 0, ""

    pip = FakePip(failing(missing), build)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(resolution, "run_pip", pip)
        with pytest.raises(UserError) as refused:
            resolution.resolve(
                ["fastthing==1.0"], SOURCE, environment(), held_packages.CACHE / "f", print
            )
    assert str(refused.value) == (
        f"{SOURCE}: fastthing==1.0 has no wheel for the training image {BASE} (Python 3.11, "
        "manylinux_2_36_x86_64), and the one built here is for cp312-cp312-linux_aarch64"
    )


def test_the_real_pip_takes_a_stand_in_over_the_same_version_and_says_a_conflict_as_parsed(
    tmp_path, monkeypatch
):
    """Offline, on wheels made here: the index's numpy 2.4.6 and the image's stand-in of it;
    pip takes the stand-in. A package needing torch<2 against the held torch: pip's own lines
    read as one cause naming it."""
    index, stand_ins, dest = tmp_path / "index", tmp_path / "stand-ins", tmp_path / "dest"
    for directory in (index, stand_ins, dest):
        directory.mkdir()
    wheel(index, "numpy", "2.4.6")
    wheel(index, "needs-old-torch", "1.0", ("torch<2",))
    resolution.write_stand_in(stand_ins, "numpy", resolution.stand_in_version("2.4.6"))
    resolution.write_stand_in(stand_ins, "torch", resolution.stand_in_version("2.14.1"))
    pins = tmp_path / "constraints.txt"
    pins.write_text("torch==2.14.1\nnumpy==2.4.6\n")
    for name in ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)

    def pip(*wanted: str) -> tuple[int, str]:
        base = [str(VENV_BIN / "python"), "-m", "pip", "download", "--no-index", "--dest"]
        links = ["--find-links", str(index), "--find-links", str(stand_ins)]
        done = subprocess.run(
            [*base, str(dest), *links, "-c", str(pins), *wanted],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        return done.returncode, done.stdout + done.stderr

    code, output = pip("numpy")
    assert code == 0, output
    assert [p.name for p in dest.iterdir()] == ["numpy-2.4.6+tmnheld-py3-none-any.whl"]
    code, output = pip("needs-old-torch")
    assert code != 0
    causes = resolution.conflict(output)
    assert [(c.text, c.name, c.constraint, c.requester) for c in causes][0] == (
        "needs-old-torch 1.0 depends on torch<2",
        "torch",
        False,
        "needs-old-torch",
    )
    assert any(c.constraint and c.name == "torch" for c in causes)


# -- the tag, the Dockerfile, the build ------------------------------------------------------


def test_the_tag_is_the_digest_of_the_requirements_the_base_and_the_constraints():
    held = held_packages.constraints(environment())
    tag = dependencies.layer_tag(dependencies.layer_digest(["omegaconf", "tqdm"], BASE_ID, held))
    assert tag == dependencies.layer_tag(
        dependencies.layer_digest(["omegaconf", "tqdm"], BASE_ID, held)
    )
    assert tag.startswith("torch-multinode/deps:") and len(tag.split(":")[1]) == 20
    others = {
        dependencies.layer_tag(dependencies.layer_digest(lines, base, constraints))
        for lines, base, constraints in (
            (["omegaconf"], BASE_ID, held),
            (["omegaconf", "tqdm==4.70.1"], BASE_ID, held),
            (["omegaconf", "tqdm"], "sha256:" + "c" * 64, held),
            (["omegaconf", "tqdm"], BASE_ID, held.replace("2.14.1", "2.14.2")),
        )
    }
    assert tag not in others and len(others) == 4


def test_the_layers_dockerfile_is_one_run_on_the_base_for_the_legacy_builder():
    text = dependencies.dockerfile(BASE_ID, ["omegaconf==2.4.0", "tqdm==4.70.1"])
    instructions = [line.split()[0] for line in text.splitlines() if line and line[0].isalpha()]
    assert instructions == ["FROM", "RUN"]  # one layer
    assert f"FROM {BASE_ID}\n" in text
    for buildkit_only in ("--mount", "<<", "# syntax", "--link", "--chmod"):
        assert buildkit_only not in text
    assert "--no-index --no-deps" in text and f"--find-links {images.WHEELS_URL}" in text
    assert "printf '%s\\n' omegaconf==2.4.0 tqdm==4.70.1 > " + dependencies.LIST_PATH in text
    hadolint = VENV_BIN / "hadolint"
    if hadolint.exists():  # the linter `make lint` runs on our Dockerfiles
        linted = subprocess.run(
            [str(hadolint), "-"], input=text, capture_output=True, text=True, timeout=60
        )
        assert linted.returncode == 0, linted.stdout + linted.stderr


def test_a_new_requirement_builds_one_layer_once_with_its_labels_and_then_nothing(engine):
    pip = FakePip(saving(("omegaconf", "2.4.0"), ("tqdm", "4.70.1")))
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(resolution, "run_pip", pip)
        made = dependencies.prepare_layer(BASE, ["omegaconf", "tqdm"], SOURCE, lines.append)
    (built,) = engine.builds
    tag, text, arguments = built
    assert made.built and made.image == tag and made.base_id == BASE_ID
    assert made.packages == ("omegaconf==2.4.0", "tqdm==4.70.1")
    assert f"FROM {BASE_ID}" in text
    assert arguments[arguments.index("--add-host") + 1] == "tmn-wheels:127.0.0.9"
    assert arguments[arguments.index("--network") + 1] == "host"
    assert engine.label(tag, dependencies.DIGEST_LABEL) == made.digest
    assert engine.label(tag, dependencies.RESOLVED_LABEL) == "omegaconf==2.4.0 tqdm==4.70.1"
    assert any(line.startswith(f"dependencies: building {tag}, one layer on ") for line in lines)
    # The same requirements again: nothing resolved, nothing built, and said so.
    lines.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(resolution, "run_pip", never)
        again = dependencies.prepare_layer(BASE, ["omegaconf", "tqdm"], SOURCE, lines.append)
    assert (again.image, again.built, again.packages) == (tag, False, made.packages)
    assert lines == [
        f"dependencies: {tag} holds {SOURCE}'s 2 package(s) on {BASE} already: nothing to build"
    ]
    assert len(engine.builds) == 1
    # One requirement changed: a new tag, built once more on the same base.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(resolution, "run_pip", FakePip(saving(("omegaconf", "2.4.0"))))
        changed = dependencies.prepare_layer(BASE, ["omegaconf"], SOURCE, print)
    assert changed.image != tag and len(engine.builds) == 2
    assert f"FROM {BASE_ID}" in engine.builds[1][1]


def test_requirements_the_image_already_meets_need_no_layer(engine):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(resolution, "run_pip", FakePip(saving(("numpy", "2.4.6+tmnheld"))))
        made = dependencies.prepare_layer(BASE, ["numpy"], SOURCE, print)
    assert (made.image, made.packages) == (None, ())
    assert engine.builds == []


def test_a_training_image_missing_here_is_one_error_line(engine):
    del engine.images[BASE]
    with pytest.raises(UserError) as missing:
        dependencies.prepare_layer(BASE, ["tqdm"], SOURCE, print)
    assert missing.value.line().startswith(
        f"Error: the training image {BASE} is not on this machine, so {SOURCE} cannot be put on it"
    )


def test_the_images_probe_is_asked_once_per_image_id(engine):
    first = held_packages.probe_image(BASE, BASE_ID)
    assert held_packages.probe_image(BASE, BASE_ID) == first
    assert [call[0] for call in engine.calls].count("run") == 1
    assert first.platforms[0] == "manylinux_2_36_x86_64" and first.abi == "cp311"


def test_a_layer_every_node_holds_ships_nothing_and_says_so(monkeypatch):
    """A layer found ready here (a later run's case) is looked for on the nodes in a thread,
    while the launcher goes on: the first half returns before the nodes have answered, and the
    second ships nothing with their answer, once however often it is called."""
    made = dependencies.Dependencies(
        SOURCE,
        ("tqdm",),
        "d" * 64,
        ("tqdm==4.70.1",),
        "torch-multinode/deps:abc",
        "sha256:" + "e" * 64,
    )
    monkeypatch.setattr(dependencies, "prepare_layer", lambda *args: made)
    answer = {"node1": ("sha256:" + "e" * 64, "x86_64"), "node2": ("sha256:" + "e" * 64, "x86_64")}
    asked, go = threading.Event(), threading.Event()

    def node_images(inventory, image):
        assert image == "torch-multinode/deps:abc"
        asked.set()
        assert go.wait(10)
        return answer

    shipped: list[str] = []

    def shipping(inventory, image, via="auto", emit=print, known_id=None, looked=None):
        assert known_id == "sha256:" + "e" * 64  # the ID just read: no second look
        assert looked is answer  # the thread's answer: the nodes asked once
        shipped.append(image)
        return Shipment(image, "sha256:" + "e" * 64, "", already=["node1", "node2"])

    monkeypatch.setattr(ship, "node_images", node_images)
    monkeypatch.setattr(ship, "ship", shipping)
    lines: list[str] = []
    found, ready = dependencies.begin_for_inventory(WHERE, ["tqdm"], SOURCE, lines.append)
    assert found is made and asked.wait(10) and shipped == []  # the nodes not yet answered
    go.set()
    ready()
    ready()
    assert shipped == ["torch-multinode/deps:abc"]
    assert lines == [
        "dependencies: every node holds torch-multinode/deps:abc (eeeeeeeeeeee) already: "
        "nothing to ship"
    ]


def test_a_look_that_fails_is_said_where_the_layer_is_wanted_each_time(monkeypatch):
    made = dependencies.Dependencies(
        SOURCE, ("tqdm",), "d" * 64, ("tqdm==4.70.1",), "deps:abc", "sha256:" + "e" * 64
    )
    monkeypatch.setattr(dependencies, "prepare_layer", lambda *args: made)
    failure = UserError("node2 did not answer over SSH", hint="make netcheck", exit_code=1)

    def node_images(inventory, image):
        raise failure

    monkeypatch.setattr(ship, "node_images", node_images)
    _, ready = dependencies.begin_for_inventory(WHERE, ["tqdm"], SOURCE, print)
    for _ in range(2):  # a restart's second call says the same
        with pytest.raises(UserError) as raised:
            ready()
        assert raised.value is failure


def test_a_rerun_takes_the_recorded_layer_where_this_machine_still_has_it(engine, monkeypatch):
    monkeypatch.setattr(resolution, "run_pip", never)
    recorded_id = "sha256:" + "f" * 64
    engine.images["some-other-name:1"] = (recorded_id, {})
    recorded = {
        "source": SOURCE,
        "requirements": ["tqdm"],
        "digest": "a" * 64,
        "resolved": ["tqdm==4.70.1"],
        "image": {"tag": "torch-multinode/deps:aaaa", "id": recorded_id, "base": BASE},
        "directory": None,
    }
    lines: list[str] = []
    made = dependencies.prepare_layer(BASE, ["tqdm"], SOURCE, lines.append, recorded)
    assert (made.image, made.image_id, made.packages) == (
        "torch-multinode/deps:aaaa",
        recorded_id,
        ("tqdm==4.70.1",),
    )
    assert engine.find("torch-multinode/deps:aaaa")[0] == recorded_id  # under its tag again
    assert lines == [
        f"dependencies: the run's own layer torch-multinode/deps:aaaa ({recorded_id[7:19]}): "
        "nothing to build"
    ]
    assert not any(call[0] == "run" for call in engine.calls)  # not even the probe


def test_the_record_names_the_requirements_what_they_resolved_to_and_the_layer():
    made = dependencies.Dependencies(
        SOURCE,
        ("omegaconf",),
        "d" * 64,
        ("omegaconf==2.4.0",),
        "torch-multinode/deps:dddd",
        "sha256:" + "e" * 64,
        BASE,
        BASE_ID,
    )
    assert made.record() == {
        "source": SOURCE,
        "requirements": ["omegaconf"],
        "digest": "d" * 64,
        "resolved": ["omegaconf==2.4.0"],
        "image": {
            "tag": "torch-multinode/deps:dddd",
            "id": "sha256:" + "e" * 64,
            "base": BASE,
            "base_id": BASE_ID,
        },
        "directory": None,
    }


# -- this machine ------------------------------------------------------------------------------


def test_a_local_job_gets_the_packages_in_a_directory_of_its_own_never_in_this_environment(
    engine, monkeypatch
):
    here = held_packages.environment_from(json.dumps(PROBED), f"this machine's {sys.prefix}")
    monkeypatch.setattr(held_packages, "probe_here", lambda: here)

    def install(arguments: list[str]) -> tuple[int, str]:
        assert arguments[:1] == ["install"] and "--no-deps" in arguments
        assert "--no-index" in arguments
        target = _option(arguments, "--target")
        assert target.parent.parent == held_packages.CACHE
        (target / "tqdm").mkdir()
        return 0, ""

    pip = FakePip(saving(("tqdm", "4.70.1")), install)
    monkeypatch.setattr(resolution, "run_pip", pip)
    made = dependencies.for_this_machine(["tqdm"], SOURCE, print)
    assert made.directory == held_packages.CACHE / made.digest / dependencies.SITE
    assert (made.directory / "tqdm").is_dir() and made.packages == ("tqdm==4.70.1",)
    assert made.record()["directory"] == str(made.directory) and made.record()["image"] is None
    # Again: found, nothing installed.
    monkeypatch.setattr(resolution, "run_pip", never)
    lines: list[str] = []
    again = dependencies.for_this_machine(["tqdm"], SOURCE, lines.append)
    assert again.directory == made.directory and "nothing to install" in lines[0]
    # torch held here too, refused before anything.
    with pytest.raises(UserError, match=r"torch==2\.0, which would replace the torch 2\.14\.1"):
        dependencies.for_this_machine(["torch==2.0"], SOURCE, print)


def test_the_layer_goes_to_the_jobs_nodes_then_to_its_spares_as_far_as_they_answer(
    engine, monkeypatch
):
    from tests.helpers import inventory, node

    cluster = inventory({"node1": node(1), "node2": node(2), "node3": node(3)})
    job, spares = cluster.first(2), cluster.hosts[2:]
    shipped: list[tuple[str, ...]] = []
    ids: list[str | None] = []

    def shipping(where, image, via="auto", emit=print, known_id=None, looked=None):
        assert looked is None  # a layer built here is not looked for before it is shipped
        ids.append(known_id)
        shipped.append(tuple(host.name for host in where.hosts))
        if where.hosts[0].name == "node3":
            raise UserError("node3 did not answer over SSH", hint="make netcheck", exit_code=1)
        return Shipment(image, "sha256:" + "e" * 64, "registry", received={"node1": 9})

    monkeypatch.setattr(ship, "ship", shipping)
    monkeypatch.setattr(resolution, "run_pip", FakePip(saving(("tqdm", "4.70.1"))))
    lines: list[str] = []
    made, ready = dependencies.begin_for_inventory(
        job, ["tqdm"], SOURCE, lines.append, None, spares
    )
    ready()
    assert shipped == [("node1", "node2"), ("node3",)]
    assert ids == [made.image_id, made.image_id] and made.image_id  # read once, here
    assert lines[-1] == (
        f"dependencies: the spare node(s) node3 did not take {made.image}: node3 did not answer "
        "over SSH"
    )


def test_a_held_package_in_what_pip_resolved_is_refused_all_the_same(engine):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(resolution, "run_pip", FakePip(saving(("torch", "2.14.2"), ("tqdm", "1.0"))))
        with pytest.raises(UserError, match=r"torch==2\.14\.2 \(resolved\), which would replace"):
            resolution.resolve(["tqdm"], SOURCE, environment(), held_packages.CACHE / "h", print)
    assert not (held_packages.CACHE / "h").exists()  # nothing kept of it
