"""Every module a node runs imports with what the training image holds, and nothing else.

The image carries torch, torchvision, pyyaml and TensorBoard; the controller's packages (fabric,
paramiko, invoke, ansible) are not in it. A workload that reaches one of them through an import
chain dies on every node with ModuleNotFoundError, which only the container tests would see,
minutes into the run. Here it is caught in a second, in a fresh interpreter that refuses them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONTROLLER_ONLY = ("fabric", "paramiko", "invoke", "ansible", "ansible_collections")
# What runs on a node: the workloads (MODULE=training.<name>) and netcheck's node-side probes.
NODE_MODULES = (
    "torch_multinode.training.ddp",
    "torch_multinode.training.fsdp",
    "torch_multinode.training.spawn",
    "torch_multinode.training.model_parallel",
    "torch_multinode.training.pipeline",
    "torch_multinode.training.manual_dp",
    "torch_multinode.training.dp_vs_ddp",
    "torch_multinode.training.comm_demo",
    "torch_multinode.training.fixtures.init_methods",
    "torch_multinode.training.fixtures.bench_scaling",
    "torch_multinode.training.legacy",
    "torch_multinode.netcheck.collective",
    "torch_multinode.netcheck.sockprobe",
    "torch_multinode.netcheck.softprobe",
)

BLOCKER = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not in the training image)")
        return None
sys.meta_path.insert(0, Refuse())
import importlib
importlib.import_module({module!r})
"""


@pytest.mark.parametrize("module", NODE_MODULES)
def test_node_module_imports_without_controller_packages(module):
    code = BLOCKER.format(blocked=set(CONTROLLER_ONLY), module=module)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, (
        f"{module} needs a controller-only package:\n{result.stderr[-2000:]}"
    )


def test_the_blocker_refuses_what_it_should():
    code = BLOCKER.format(blocked=set(CONTROLLER_ONLY), module="torch_multinode.cluster.remote")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode != 0 and "paramiko" in result.stderr
