"""A project's requirements on the launcher's side (issue 50): which file is read
(requirements.txt, pyproject.toml, REQUIREMENTS=path, REQUIREMENTS=none), what a line may be,
the image a job in containers then runs in and its check on the nodes, host mode's check of
each node's training_python, a local job's import path and first line, and the run's record.
No Docker engine, no package index: provision.dependencies is stood in for where it would
build (its own tests: tests/cluster/test_dependencies.py)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.helpers import inventory, node
from torch_multinode.cluster import sync
from torch_multinode.cluster.errors import UserError
from torch_multinode.launch import cli, image_check, local, record, recorder, requirements, staging
from torch_multinode.launch.spec import JobSpec
from torch_multinode.provision import dependencies

PYPROJECT = """\
[project]
name = "myproj"
version = "0.1"
dependencies = ["omegaconf>=2.3", "tqdm"]
"""


def _cluster(**fields):
    return inventory({"node1": node(1), "node2": node(2)}, **fields)


# -- which requirements ------------------------------------------------------------------------


def test_requirements_txt_at_the_projects_root_is_read_as_pip_reads_it(tmp_path):
    (tmp_path / "requirements.txt").write_text(
        "# the project's packages\n"
        "omegaconf>=2.3  # configs\n"
        "\n"
        "tqdm \\\n"
        "  ==4.70.1 --hash=sha256:abc\n"
        "-r more.txt\n"
        "requests; python_version >= '3.8'\n"
    )
    (tmp_path / "more.txt").write_text("rich\n")
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)  # requirements.txt wins
    found = requirements.requirements(tmp_path)
    assert found == requirements.Requirements(
        "requirements.txt",
        ("omegaconf>=2.3", "tqdm   ==4.70.1", "rich", "requests; python_version >= '3.8'"),
    )


def test_pyproject_dependencies_when_there_is_no_requirements_txt(tmp_path):
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    assert requirements.requirements(tmp_path) == requirements.Requirements(
        "pyproject.toml", ("omegaconf>=2.3", "tqdm")
    )
    (tmp_path / "pyproject.toml").write_text("[tool.ruff]\nline-length = 100\n")
    assert requirements.requirements(tmp_path) is None  # a pyproject.toml without dependencies


def test_the_knob_names_another_file_or_none(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "requirements.txt").write_text("tqdm\n")
    (tmp_path / "deps").mkdir()
    (tmp_path / "deps" / "train.txt").write_text("omegaconf\n")
    (tmp_path / "deps" / "pyproject.toml").write_text(PYPROJECT)
    assert requirements.requirements(tmp_path, "deps/train.txt") == requirements.Requirements(
        "deps/train.txt", ("omegaconf",)
    )
    assert requirements.requirements(tmp_path, "deps/pyproject.toml").lines == (
        "omegaconf>=2.3",
        "tqdm",
    )
    assert requirements.requirements(tmp_path, "none") is None
    with pytest.raises(UserError) as missing:
        requirements.requirements(tmp_path, "nowhere.txt")
    assert missing.value.line() == (
        "Error: REQUIREMENTS=nowhere.txt is not a file (try a requirements file, a "
        "pyproject.toml, or REQUIREMENTS=none)"
    )


def test_no_project_or_this_projects_own_packages_have_no_requirements(tmp_path):
    assert requirements.requirements(None) is None
    assert (
        requirements.requirements(sync.TOOL_ROOT) is None
    )  # its pyproject.toml is the controller's
    assert requirements.requirements(tmp_path) is None  # nothing there
    (tmp_path / "requirements.txt").write_text("# nothing yet\n")
    assert requirements.requirements(tmp_path) is None


@pytest.mark.parametrize(
    "line, said",
    [
        ("-e .", "'-e .' is a pip option, not a requirement the layer installs"),
        ("--index-url https://x", "'--index-url https://x' is a pip option"),
        ("mylib @ file:///home/me/mylib", "names a URL"),
        ("omegaconf >>= 2", "'omegaconf >>= 2' is not a requirement"),
    ],
)
def test_a_line_the_layer_cannot_install_is_refused_naming_it(tmp_path, line, said):
    (tmp_path / "requirements.txt").write_text(f"tqdm\n{line}\n")
    with pytest.raises(UserError) as refused:
        requirements.requirements(tmp_path)
    assert refused.value.line().startswith("Error: requirements.txt line 2: ")
    assert said in refused.value.line()


def test_the_plan_carries_the_requirements_and_the_job_runs_in_the_layer_given(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "requirements.txt").write_text("tqdm\n")
    cluster = _cluster()
    project = staging.plan(cluster, tmp_path / "train.py", None)
    assert project.requirements == requirements.Requirements("requirements.txt", ("tqdm",))
    assert staging.job_image(cluster, project) == cluster.training_image
    assert staging.job_image(cluster, None) == cluster.training_image
    layered = staging.Project(project.trees, project.workdir, project.script, image="deps:1")
    assert staging.job_image(cluster, layered) == "deps:1"
    assert staging.plan(cluster, tmp_path / "train.py", None, given_requirements="none") == (
        staging.Project(project.trees, project.workdir, project.script)
    )


def test_a_node_whose_copy_of_the_layer_differs_is_told_to_run_make_train_again():
    cluster = _cluster()
    host = cluster.hosts[1]
    wanted, other = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    said = image_check.image_mismatch(host, cluster, wanted, f"{other} torch=2.14.1", "deps:1")
    assert said == (
        f"on node2: the project's image deps:1 is {other[7:19]}, not this machine's "
        f"{wanted[7:19]} (try make train again: it ships deps:1 to the nodes before the job)"
    )
    assert (
        image_check.image_mismatch(host, cluster, wanted, f"{wanted} torch=2.14.1", "deps:1")
        is None
    )
    # The training image itself: as before.
    assert "(try make ship INVENTORY=" in image_check.image_mismatch(
        host, cluster, wanted, f"{other} torch=2.14.1"
    )


# -- host mode ---------------------------------------------------------------------------------


def _on_this_python(wanted: requirements.Requirements) -> str:
    command = requirements.requirements_check_command(sys.executable, wanted)
    return subprocess.run(
        ["sh", "-c", command], capture_output=True, text=True, timeout=60, check=False
    ).stdout


def test_host_mode_names_the_node_whose_python_lacks_a_requirement():
    host = _cluster(launch_mode="host").hosts[0]
    held = requirements.Requirements("requirements.txt", ("pyyaml>=5", "packaging"))
    assert requirements.requirements_missing(host, held, _on_this_python(held)) is None
    lacking = requirements.Requirements("requirements.txt", ("pyyaml>=5", "no-such-package-tmn>=1"))
    assert requirements.requirements_missing(host, lacking, _on_this_python(lacking)) == (
        "on node1: python3 lacks no-such-package-tmn, which requirements.txt asks for "
        "(no-such-package-tmn>=1) (try pip install -r requirements.txt with python3 on node1: in "
        "host mode jobs run each node's own Python, which the launcher never changes)"
    )
    old = requirements.Requirements("requirements.txt", ("pyyaml<1",))
    assert requirements.requirements_missing(host, old, _on_this_python(old)).startswith(
        "on node1: python3 holds pyyaml "
    )
    assert "cannot ask python3" in requirements.requirements_missing(
        host, old, "bash: no such file"
    )


# -- a local job -------------------------------------------------------------------------------


def test_a_local_jobs_dependencies_come_right_after_its_project_on_the_import_path(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    site = tmp_path / "cache" / "abc" / "site"
    spec = JobSpec(script=script, dependencies=str(site))
    env, _ = local.environment(spec, 0, {})
    # then our sitecustomize's directory, last (launch.stragglers.watched: a script of the user's)
    ours = REPO_ROOT / "training" / "distributed" / "site"
    assert env["PYTHONPATH"] == f"{tmp_path}:{site}:{ours}"
    assert local.environment_note(spec) == f"environment {sys.prefix} + {site}"
    plain = JobSpec(script=script)
    assert local.environment(plain, 0, {})[0]["PYTHONPATH"] == f"{tmp_path}:{ours}"
    assert local.environment_note(plain) == f"environment {sys.prefix}"


def _args(**fields) -> argparse.Namespace:
    return argparse.Namespace(**{"rerun_of": None, "requirements": None, **fields})


def test_the_launcher_makes_them_ready_where_the_job_runs(monkeypatch, capsys):
    calls = []
    made = dependencies.Dependencies("requirements.txt", ("tqdm",), "d", ("tqdm==4.70.1",))

    def ready() -> None:  # the layer made ready on the nodes, by the job before it checks them
        calls.append(("ready",))

    monkeypatch.setattr(
        dependencies, "for_this_machine", lambda *a: calls.append(("here", *a)) or made
    )
    monkeypatch.setattr(
        dependencies,
        "begin_for_inventory",
        lambda *a: calls.append(("nodes", *a)) or (made, ready),
    )
    wanted = requirements.Requirements("requirements.txt", ("tqdm",))
    assert cli._dependencies(_args(), None, wanted) == (made, None)
    assert cli._dependencies(_args(), _cluster(), wanted) == (made, ready)
    assert [call[0] for call in calls] == ["here", "nodes"]  # the nodes' half left to the job
    assert calls[0][1:3] == (("tqdm",), "requirements.txt") and calls[0][4] is None
    assert cli._dependencies(_args(), _cluster(), None) == (None, None)
    # Host mode: nothing made; said.
    assert cli._dependencies(_args(), _cluster(launch_mode="host"), wanted) == (None, None)
    assert capsys.readouterr().out.splitlines()[-1] == (
        "[launcher] launch_mode: host: requirements.txt is not installed by the launcher; each "
        "node's training_python must hold it (checked on every node before the job starts)"
    )
    # A rerun: the recorded requirements, and the record itself (its layer is taken again).
    recorded = {"source": "requirements.txt", "requirements": ["tqdm==4.70.0"], "image": None}
    rerun = _args(rerun_of=({"dependencies": recorded}, Path(".runs/x")))
    cli._dependencies(rerun, _cluster(), wanted)
    assert calls[-1][2:] == (("tqdm==4.70.0",), "requirements.txt", calls[-1][4], recorded, ())


def test_the_record_keeps_the_dependencies_and_names_the_layer_as_the_image(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kept = dependencies.Dependencies(
        "requirements.txt",
        ("tqdm",),
        "d" * 64,
        ("tqdm==4.70.1",),
        "torch-multinode/deps:dddd",
        "sha256:" + "e" * 64,
        "torch-multinode/train:latest",
        "sha256:" + "b" * 64,
    ).record()
    spec = JobSpec(log_dir=tmp_path / ".runs" / "tmn-x", run_id="tmn-x")
    begun = record.begin(spec, ["--script", "t.py"], None, tmp_path, None, kept)
    assert begun["dependencies"] == kept
    written = json.loads((tmp_path / ".runs" / "tmn-x" / record.RECORD).read_text())
    assert written["dependencies"]["resolved"] == ["tqdm==4.70.1"]
    assert written["dependencies"]["image"]["tag"] == "torch-multinode/deps:dddd"
    monkeypatch.setattr(image_check, "local_image_id", lambda image: f"id-of-{image}")
    assert recorder._image(_cluster(), "torch-multinode/deps:dddd") == {
        "name": "torch-multinode/deps:dddd",
        "id": "id-of-torch-multinode/deps:dddd",
    }
    assert recorder._image(_cluster())["name"] == "torch-multinode/train:latest"


def test_the_job_makes_the_layer_ready_on_the_nodes_before_it_checks_their_images(monkeypatch):
    """The layer's second half (begin_for_inventory's `ready`) runs once the job has connected
    and sent the project, and before the controller's image ID is read or any node prepared."""
    from torch_multinode.launch import prepare

    order: list[str] = []
    cluster = _cluster(launch_mode="container")
    project = staging.Project(
        (), "/work", None, image="deps:abc", image_ready=lambda: order.append("ready")
    )
    monkeypatch.setattr(prepare.lock, "load", lambda path: None)
    monkeypatch.setattr(
        image_check, "local_image_id", lambda image: order.append(f"id of {image}") or "sha256:e"
    )

    def prepare_node(remote, host, *rest):
        order.append(f"prepare {host.name}")
        return {}, []

    monkeypatch.setattr(prepare, "prepare_node", prepare_node)
    prepare.prepare_nodes(
        {host.name: None for host in cluster.hosts},
        cluster,
        JobSpec(script=Path("train.py")),
        project,
        "gloo",
        print,
        lambda work: [work(host) for host in cluster.hosts],
    )
    assert order == ["ready", "id of deps:abc", "prepare node1", "prepare node2"]
