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
import importlib, traceback
failed = 0
for module in {modules!r}:
    try:
        importlib.import_module(module)
    except Exception:
        failed += 1
        print(f"{{module}} needs a controller-only package:", file=sys.stderr)
        traceback.print_exc(limit=-3)
sys.exit(1 if failed else 0)
"""


def _import(*modules: str) -> subprocess.CompletedProcess:
    """`modules` imported one after another in one fresh interpreter that refuses the
    controller's packages (one torch import for all of them, not one each)."""
    code = BLOCKER.format(blocked=set(CONTROLLER_ONLY), modules=list(modules))
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)


def test_every_node_module_imports_without_controller_packages():
    result = _import(*NODE_MODULES)
    assert result.returncode == 0, result.stderr[-4000:]


def test_the_blocker_refuses_what_it_should():
    result = _import("torch_multinode.training.ddp", "torch_multinode.cluster.remote")
    assert result.returncode != 0, result.stderr
    # The refused module is named, and only it: the one before it imported.
    assert "torch_multinode.cluster.remote needs a controller-only package" in result.stderr
    assert "training.ddp needs" not in result.stderr and "paramiko" in result.stderr
