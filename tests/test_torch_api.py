"""Every torch name the project's code uses exists in the installed torch, and the installed torch
is the one the project declares as its minimum.

The code is read, not run: each module's imports of torch (`import torch`, `import
torch.distributed as dist`, `from torch import nn`, `from torch.cuda import amp`) bind names, and
every attribute chain read through one of those names (`dist.set_timeout`,
`torch.cuda.get_rng_state`) is looked up in the installed torch. A name that exists only in a
newer torch than the declared minimum fails here, on the tested torch, instead of on a node
whose image carries an older one (NVIDIA's pytorch:25.12 holds torch 2.10, without
`dist.set_timeout`).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import tomllib
from pathlib import Path

import pytest
import torch

from torch_multinode.cluster.versions import TORCH_MINIMUM, release, torch_meets_minimum

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("training", "launch", "netcheck", "cluster", "provision")


def torch_aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the torch module or object it is bound to, by the module's imports."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for name in node.names:
                if name.name == "torch" or name.name.startswith("torch."):
                    if name.asname:
                        aliases[name.asname] = name.name
                    else:  # `import torch.distributed` binds `torch`
                        aliases["torch"] = "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "torch" or node.module.startswith("torch."):
                for name in node.names:
                    aliases[name.asname or name.name] = f"{node.module}.{name.name}"
    return aliases


def _chain(node: ast.Attribute) -> list[str] | None:
    """`a.b.c` -> ['a', 'b', 'c']; None when the chain does not start at a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def torch_names_used(source: str) -> set[str]:
    """Dotted torch names a module's source reads: imported ones and attribute chains."""
    tree = ast.parse(source)
    aliases = torch_aliases(tree)
    used = set(aliases.values())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Del):
            chain = _chain(node)
            if chain and chain[0] in aliases:
                used.add(".".join([aliases[chain[0]], *chain[1:]]))
    return used


def missing_part(dotted: str) -> str | None:
    """The first part of `dotted` the installed torch lacks (None: it all exists). Attributes are
    followed through modules and classes; past a function or a value (a tensor's `.shape`, a
    returned object's methods) the chain is no longer torch's API and is not followed."""
    parts = dotted.split(".")
    current = importlib.import_module(parts[0])
    for depth, part in enumerate(parts[1:], start=1):
        if not (inspect.ismodule(current) or inspect.isclass(current)):
            return None
        if hasattr(current, part):
            current = getattr(current, part)
            continue
        if inspect.ismodule(current):
            try:  # a submodule its package does not import by itself
                current = importlib.import_module(".".join(parts[: depth + 1]))
                continue
            except ImportError:
                pass
        return ".".join(parts[: depth + 1])
    return None


def project_sources() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def test_every_torch_name_the_code_uses_exists_in_the_installed_torch():
    missing = {}
    for path in project_sources():
        for dotted in torch_names_used(path.read_text()):
            part = missing_part(dotted)
            if part is not None:
                missing.setdefault(part, []).append(str(path.relative_to(ROOT)))
    assert missing == {}, f"not in torch {torch.__version__}: {missing}"


def test_the_check_sees_the_calls_it_is_there_for():
    source = (
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch.cuda import get_rng_state\n"
        "def f(timeout):\n"
        "    dist.set_timeout(timeout)\n"
        "    dist.not_in_any_torch(1)\n"
        "    torch.cuda.is_bf16_supported(including_emulation=False)\n"
        "    torch.tensor([1.0]).cuda_only_method_name\n"
    )
    used = torch_names_used(source)
    assert {
        "torch.distributed.set_timeout",
        "torch.distributed.not_in_any_torch",
        "torch.cuda.is_bf16_supported",
        "torch.cuda.get_rng_state",
    } <= used
    assert [name for name in sorted(used) if missing_part(name)] == [
        "torch.distributed.not_in_any_torch"
    ]
    assert missing_part("torch.tensor.cuda_only_method_name") is None  # past a function
    assert missing_part("torch.nn.parallel.DistributedDataParallel.no_such") == (
        "torch.nn.parallel.DistributedDataParallel.no_such"
    )


def test_the_check_reads_every_package_and_the_trainers_collective_timeout():
    assert {path.relative_to(ROOT).parts[0] for path in project_sources()} == set(PACKAGES)
    trainer = torch_names_used((ROOT / "training" / "loop" / "trainer.py").read_text())
    assert "torch.distributed.set_timeout" in trainer


def _pinned_torch() -> tuple[int, ...]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [
        match.group(1)
        for requirement in project["dependencies"]
        if (match := re.fullmatch(r"torch==([\w.+]+)", requirement.replace(" ", "")))
    ]
    assert len(pins) == 1, f"pyproject.toml pins torch {len(pins)} times: {pins}"
    return release(pins[0])


def test_the_installed_torch_meets_the_declared_minimum():
    assert torch_meets_minimum(torch.__version__), (
        f"torch {torch.__version__} is older than the declared minimum {TORCH_MINIMUM}"
    )


def test_the_declared_minimum_is_the_minor_the_project_is_tested_on():
    # Lowering the minimum means testing on that torch first (and pinning it here).
    pinned = _pinned_torch()
    assert TORCH_MINIMUM == pinned[:2], (
        f"cluster.versions.TORCH_MINIMUM is {TORCH_MINIMUM} but pyproject.toml pins torch "
        f"{'.'.join(map(str, pinned))}"
    )
    assert release(torch.__version__)[:2] == pinned[:2]


@pytest.mark.parametrize("version", ["2.10.0a0+5e4b2c1", "2.13.1"])
def test_a_torch_older_than_the_tested_minor_is_refused(version):
    assert not torch_meets_minimum(version)
