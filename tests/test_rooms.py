"""The rooms' import rules (CONTRIBUTING.md, "Layout"): what each room may import, read from
the source of every module, what runs on a node (cluster.sync.NODE_SIDE) and that it travels
there whole, and no import circle among modules at import time."""

from __future__ import annotations

import ast
import os
from pathlib import Path

from torch_multinode.cluster import sync
from torch_multinode.launch import staging

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "torch_multinode"
ROOMS = ("cluster", "provision", "sim", "netcheck", "launch", "training", "bench")
# Each room may import itself and these (bench, a tool over all of them, may import anything);
# a room's cli.py is the edge of the commands it fronts (`cluster image`, `cluster ship`, ...;
# `train`, which builds and ships a project's dependency layer: provision.dependencies).
EDGES = {"cluster.cli": {"provision"}, "launch.cli": {"provision"}}
MAY_IMPORT = {
    "cluster": set(),
    "provision": {"cluster"},
    "sim": {"cluster", "provision"},
    "netcheck": {"cluster"},
    "launch": {"cluster", "netcheck", "training"},
    "training": {"cluster"},
    "bench": set(ROOMS),
}
# Modules that run on the controller only: never sent to a node.
CONTROLLER_ONLY = (
    "cluster/inventory.py",
    "cluster/remote.py",
    "cluster/sync.py",
    "cluster/execution.py",
    "cluster/cli.py",
    "netcheck/preflight.py",
    "netcheck/attempts.py",
    "netcheck/stages.py",
    "netcheck/cli.py",
)
CONTROLLER_ROOMS = ("launch", "provision", "sim", "bench", "tests", "torch_multinode")


def _modules() -> dict[str, Path]:
    found = {}
    for room in ROOMS:
        for path in sorted((REPO / room).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    assert {"cluster.inventory", "launch.cli", "training.ddp"} <= set(found)  # it reads the rooms
    return found


def _type_only(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test)


def _imports(path: Path, modules: dict[str, Path], at_import_time: bool) -> set[str]:
    """The torch_multinode modules (names without the package prefix) that the module at `path`
    imports: all of them, or only those imported when it is (not in a function or class, not
    under `if TYPE_CHECKING`)."""
    tree = ast.parse(path.read_text())
    if at_import_time:
        nodes = [
            node
            for statement in tree.body
            if not isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and not _type_only(statement)
            for node in ast.walk(statement)
        ]
    else:
        nodes = list(ast.walk(tree))
    prefix, names = PACKAGE + ".", set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found = {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from package import module` imports the module; `from module import name`, it
            found = {
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}".removeprefix(prefix) in modules
                else node.module
                for alias in node.names
            }
        else:
            continue
        names |= {name.removeprefix(prefix) for name in found if name.startswith(prefix)}
    return names


def test_each_room_imports_only_what_its_rule_allows():
    modules = _modules()
    broken = []
    for module, path in modules.items():
        room = module.split(".")[0]
        allowed = {room} | MAY_IMPORT[room] | EDGES.get(module, set())
        for name in _imports(path, modules, at_import_time=False):
            if name.split(".")[0] not in allowed:
                broken.append(f"{module} imports {name}")
    assert broken == []


def _node_side(modules: dict[str, Path]) -> set[str]:
    """The modules that run on a node, as cluster.sync.NODE_SIDE lists them (a room's package
    itself travels with any of its modules)."""
    found = set()
    for module in modules:
        room, *rest = module.split(".")
        listed = sync.NODE_SIDE.get(room, ())
        if listed is None or (not rest and room in sync.NODE_SIDE) or (rest and rest[0] in listed):
            found.add(module)
    return found


def test_node_side_lists_modules_that_exist():
    modules = _modules()
    listed = {f"{room}.{name}" for room, names in sync.NODE_SIDE.items() if names for name in names}
    assert listed and listed <= set(modules)
    assert {"training.ddp", "netcheck.collective", "cluster.errors"} <= _node_side(modules)


def test_what_runs_on_a_node_imports_only_what_runs_on_a_node():
    modules = _modules()
    node_side = _node_side(modules)
    broken = [
        f"{module} imports {name}"
        for module in sorted(node_side)
        for name in sorted(_imports(modules[module], modules, at_import_time=False))
        if name not in node_side
    ]
    assert broken == []


def test_everything_a_node_imports_travels_and_nothing_of_the_controller_does():
    """From the source: every torch_multinode module that the node-side modules import, at
    any depth and wherever in them, and the packages holding each, is in the tool tree."""
    modules = _modules()
    needed, pending = set(), sorted(_node_side(modules))
    while pending:
        module = pending.pop()
        if module in needed:
            continue
        needed.add(module)
        parts = module.split(".")
        # Their __init__.py; the sitecustomize's directory is an import path entry of its own
        # (staging.SITE_PATH), not a package.
        parents = [".".join(parts[:i]) for i in range(1, len(parts))]
        pending += [parent for parent in parents if parent != staging.SITE_PATH.replace("/", ".")]
        pending += sorted(_imports(modules[module], modules, at_import_time=False) & set(modules))
    files = set(sync.tool_tree().files)
    wanted = {modules[module].relative_to(REPO).as_posix() for module in needed}
    assert {"netcheck/bandwidth.py", "cluster/__init__.py"} <= wanted  # it follows imports
    assert sorted(wanted - files) == []
    assert sorted(files & set(CONTROLLER_ONLY)) == []
    assert sorted(f for f in files if f.split("/")[0] in CONTROLLER_ROOMS) == []
    assert sorted(f for f in files if f.endswith(".py")) == sorted(wanted)


def _sent_as_source() -> list[str]:
    """The modules netcheck sends to a node as source, `python -c`, read from its
    `HERE / "NAME.py"` (netcheck.attempts): they run with no package around them."""
    tree = ast.parse((REPO / "netcheck" / "attempts.py").read_text())
    return sorted(
        f"netcheck.{node.right.value.removesuffix('.py')}"
        for node in ast.walk(tree)
        if isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Div)
        and isinstance(node.right, ast.Constant)
        and str(node.right.value).endswith(".py")
    )


def test_the_probes_sent_as_source_import_nothing_of_ours_when_they_start():
    modules = _modules()
    probes = _sent_as_source()
    assert probes == ["netcheck.sockprobe", "netcheck.softprobe"]
    broken = [
        f"{probe} imports {name}"
        for probe in probes
        for name in sorted(_imports(modules[probe], modules, at_import_time=True))
    ]
    assert broken == []


def test_no_import_circle_at_import_time():
    modules = _modules()
    graph = {
        module: {name for name in _imports(path, modules, at_import_time=True) if name in modules}
        for module, path in modules.items()
    }
    state, circles = {}, []

    def visit(node, trail):
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                circles.append(" -> ".join([*trail[trail.index(target) :], target]))
            elif target not in state:
                visit(target, [*trail, target])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []


def test_the_watchers_and_the_stop_see_the_running_job_not_the_launcher():
    # launch.running's RunningJob is all they share with a run (CONTRIBUTING.md, "Layout").
    modules = _modules()
    for module in ("launch.stop", "launch.watch"):
        imported = _imports(modules[module], modules, at_import_time=False)
        assert "launch.running" in imported
        assert not imported & {"launch.job", "launch.slurm", "launch.backends"}, module


def test_only_the_cli_and_the_backends_pick_a_way_to_run_a_job():
    modules = _modules()
    # one run of each backend (launch.over_ssh and launch.replicated, FT=1's: the SSH ways of
    # launch.job's run)
    runs = {"launch.job", "launch.over_ssh", "launch.replicated", "launch.slurm", "launch.local"}
    picking = sorted(
        module
        for module, path in modules.items()
        if module.startswith("launch.")
        and module not in runs
        and _imports(path, modules, at_import_time=False) & {"launch.job", "launch.slurm"}
    )
    assert picking == ["launch.backends"]


# SSH trust has one owner (cluster/trust.py): the known_hosts default, the OpenSSH and Ansible
# options, paramiko's host-key setup. Nothing else in the product spells them.
TRUST_WORDS = ("StrictHostKeyChecking", "UserKnownHostsFile", "load_host_keys")


def test_only_cluster_trust_spells_the_ssh_trust_options():
    modules = _modules()
    spelled = {
        word: sorted(
            str(path.relative_to(REPO)) for path in modules.values() if word in path.read_text()
        )
        for word in TRUST_WORDS
    }
    assert spelled == {word: ["cluster/trust.py"] for word in TRUST_WORDS}


def test_every_room_is_a_subpackage_through_a_relative_symlink():
    """torch_multinode/<room> -> ../<room> for every room, beside a plain __init__.py: the
    layout Python, the editable install, mypy and editors all follow (issue 53)."""
    package = REPO / PACKAGE
    found = {entry.name for entry in package.iterdir() if entry.name != "__pycache__"}
    assert found == {"__init__.py", *ROOMS}
    for room in ROOMS:
        link = package / room
        assert link.is_symlink() and os.readlink(link) == f"../{room}", link
    tree = ast.parse((package / "__init__.py").read_text())
    assigned = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    assert "__path__" not in assigned  # no import-time trick that tools cannot follow
