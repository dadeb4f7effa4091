"""The training image's CPU twin: built from docker/Dockerfile, it says what it holds, and a
change to one Python file rebuilds only the layers of the project's code."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib

import pytest

import cluster
from cluster import images
from cluster.sim import REPO_ROOT, docker


def test_image_pins_follow_the_project_pins():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert f"torch=={images.TORCH_VERSION}" in project["dependencies"]
    assert f"torchvision=={images.TORCHVISION_VERSION}" in project["dependencies"]


def test_build_arguments_choose_the_base():
    cuda = images.build_args("cuda")
    assert f"BASE_IMAGE={images.CUDA_BASE_IMAGE}" in cuda and not any("WHEELS=" in a for a in cuda)
    cpu = images.build_args("cpu")
    assert f"BASE_IMAGE={images.CPU_BASE_IMAGE}" in cpu and "WHEELS=docker/wheels" in cpu


@pytest.mark.sim
def test_image_reports_the_versions_inside(training_image):
    found = images.versions(training_image.tag)
    assert found["torch"].startswith(images.TORCH_VERSION)
    assert found["torchvision"].startswith(images.TORCHVISION_VERSION)
    assert found["torch-multinode"] == cluster.__version__
    assert found["python"].startswith("3.11.")
    assert re.fullmatch(r"\d+\.\d+\.\d+", found["nccl"]) and found["gpus"] == "0"
    # Its default command is the same report; anything else runs as given.
    plain = docker("run", "--rm", training_image.tag).stdout
    assert plain.splitlines()[0] == f"python: {found['python']}"
    ran = docker("run", "--rm", training_image.tag, "python3", "-c", "import training.ddp")
    assert ran.returncode == 0


def _layers(tag: str) -> list[str]:
    return json.loads(docker("image", "inspect", "--format", "{{json .RootFS.Layers}}", tag).stdout)


@pytest.mark.sim
def test_changing_one_python_file_rebuilds_only_the_code_layers(training_image, tmp_path):
    context = tmp_path / "context"
    context.mkdir()
    for name in ("pyproject.toml", ".dockerignore", "cluster", "netcheck", "training", "docker"):
        source = REPO_ROOT / name
        if source.is_dir():
            # Hard links: the 3 GB of wheels cost nothing to "copy".
            subprocess.run(["cp", "-al", str(source), str(context / name)], check=True)
        else:
            shutil.copy2(source, context / name)
    changed = context / "training" / "config.py"
    text = changed.read_text()
    changed.unlink()  # break the hard link before writing
    changed.write_text(text + "\n# a one-line change\n")

    tag = f"{training_image.tag}-rebuilt"
    proc = subprocess.run(
        ["docker", "build", *images.build_args("cpu"), "-f", str(context / "docker" / "Dockerfile"),
         "-t", tag, str(context)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    try:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        steps = re.split(r"^Step \d+/\d+ : ", proc.stdout, flags=re.M)[1:]
        first_code = next(i for i, step in enumerate(steps) if step.startswith("COPY training/"))
        for step in steps[:first_code]:
            if step.startswith(("FROM", "ARG")):
                continue
            assert "Using cache" in step, f"rebuilt: {step.splitlines()[0]}"
        assert "Using cache" not in steps[first_code]
        before, after = _layers(training_image.tag), _layers(tag)
        assert len(before) == len(after)
        differing = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
        # The code layer, and WORKDIR's, which sits on top of it: nothing below them.
        assert differing and differing[0] >= len(after) - 2, differing
    finally:
        docker("rmi", tag, check=False)
