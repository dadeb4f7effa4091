"""The rooms' import rules (CONTRIBUTING.md, "Layout"): what each room may import, read from
the source of every module, and no import circle among modules at import time."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "torch_multinode"
ROOMS = ("cluster", "provision", "sim", "netcheck", "launch", "training", "bench")
# Each room may import itself and these (bench, a tool over all of them, may import anything);
# a room's cli.py is the edge of the commands it fronts (`cluster image`, `cluster ship`, ...).
EDGES = {"cluster.cli": {"provision"}}
MAY_IMPORT = {
    "cluster": set(),
    "provision": {"cluster"},
    "sim": {"cluster", "provision"},
    "netcheck": {"cluster"},
    "launch": {"cluster", "netcheck", "training"},
    "training": {"cluster"},
    "bench": set(ROOMS),
}
# What travels to the nodes imports, of cluster/, only these stdlib-only modules.
NODE_SIDE_CLUSTER = {"errors", "jobenv", "nccl_transport", "versions"}
NODE_SIDE = [
    ("training", None),
    ("netcheck", "collective"),
    ("netcheck", "sockprobe"),
    ("netcheck", "softprobe"),
]


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


def test_what_runs_on_a_node_imports_only_the_node_side_of_cluster():
    modules = _modules()
    broken = []
    for module, path in modules.items():
        parts = module.split(".")
        if not any(
            parts[0] == room and (leaf is None or parts[-1] == leaf) for room, leaf in NODE_SIDE
        ):
            continue
        for name in _imports(path, modules, at_import_time=False):
            pieces = name.split(".")
            if pieces[0] == "cluster" and (len(pieces) < 2 or pieces[1] not in NODE_SIDE_CLUSTER):
                broken.append(f"{module} imports {name}")
            if pieces[0] not in ("cluster", "training", "netcheck"):
                broken.append(f"{module} imports {name}")
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
    runs = {"launch.job", "launch.slurm", "launch.local"}  # one run of each backend
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
