"""Reading an inventory, and where one is loaded (load, parse): a file read into the document
the checks run on, its YAML (each duplicate key refused, the rest still checked; errors with
line numbers), whether only Ansible resolves it (INI, group_vars/ and host_vars/, host ranges,
nested groups), the values ansible-core's inventory loader and variable manager give its hosts
(and the group whose variables set each cluster-wide one), and a host defined twice with
values that disagree (YAML groups, INI lines, files of a directory).

The inventory flows read -> check -> model: this module imports the checks
(cluster/inventory_validate.py, cluster/inventory_checks.py) and the model
(cluster/inventory.py), and nothing there imports it. Whoever loads an inventory imports this
module; whoever only needs a Host or an Inventory, the model alone.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from pathlib import Path

import yaml

from torch_multinode.cluster.errors import UserError, printable, shown
from torch_multinode.cluster.inventory import NODES_GROUP, Inventory
from torch_multinode.cluster.inventory_checks import (
    _ANSIBLE_MAGIC,
    CLUSTER_FIELDS,
    _known_fields,
    _Problems,
    _text,
    check_group,
)
from torch_multinode.cluster.inventory_validate import _validate


def load(path: str | os.PathLike | None, group: str = NODES_GROUP) -> Inventory:
    """Read and validate an inventory file; the nodes are the hosts of `group`. Raises
    UserError (InventoryErrors, all of them, where there are several) after checking it all."""
    check_group(group)
    if path is None or str(path).strip() == "":
        raise UserError(
            "no inventory given",
            hint="INVENTORY=path/to/inventory.yml (see inventory.example.yml), or "
            "'make sim-up' and INVENTORY=.sim/inventory.yml for the simulated cluster",
        )
    path = Path(path)
    if path.is_dir():
        # A directory, as Ansible takes one: every inventory file in it, with the group_vars/
        # and host_vars/ it holds.
        return _through_ansible(path, group)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(
            f"inventory {path} does not exist", hint="a path to an existing file"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"inventory {path} cannot be read: {exc}") from None
    except ValueError as exc:  # a NUL in the path, possible only from inside Python
        raise UserError(f"inventory {shown(str(path))} cannot be read: {exc}") from None
    # Only Ansible's own reading gives the values of an inventory with group_vars/ or
    # host_vars/ beside it, in INI, with a host range (node[01:04]) or groups inside the nodes
    # group. A plain YAML file reads the same either way, and reading it directly keeps its
    # errors precise (line numbers, duplicate keys).
    if any((path.parent / name).is_dir() for name in ("group_vars", "host_vars")):
        return _through_ansible(path, group)
    yaml_file = path.suffix.lower() in YAML_SUFFIXES
    problems = _Problems()  # a duplicate key is one of them: the rest is checked too
    try:
        data = _yaml(text, f"inventory {path}", problems)
    except UserError:
        if yaml_file:
            raise
        return _through_ansible(path, group)
    if (not isinstance(data, dict) and not yaml_file) or _needs_ansible(data, group):
        return _through_ansible(path, group, problems)
    _check_defined_once([(path, data)], f"inventory {path}", problems)
    return _validate(data, path, group, problems)


def _through_ansible(path: Path, group: str, problems: _Problems | None = None) -> Inventory:
    problems = problems if problems is not None else _Problems()
    _check_defined_once(_sources(path), f"inventory {path}", problems)
    origins: dict[str, str] = {}
    document = resolve_with_ansible(path, group, problems, origins)
    return _validate(document, path, group, problems, origins)


YAML_SUFFIXES = (".yml", ".yaml", ".json")


def parse(text: str, path: Path | str = "<inventory>", group: str = NODES_GROUP) -> Inventory:
    """An inventory in the plain YAML layout, from its text."""
    path = Path(path)
    problems = _Problems()
    data = _yaml(text, f"inventory {path}", problems)
    group = check_group(group)
    _check_defined_once([(path, data)], f"inventory {path}", problems)
    return _validate(data, path, group, problems)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys without a word; each duplicate is recorded here
    (`duplicates`), and the last value kept, as Ansible keeps it, so that the rest of the file
    is still checked in the same pass."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self.duplicates: list[_DuplicateKey] = []
        self._host_maps: set[int] = set()  # the mappings under a `hosts:` key

    def construct_mapping(self, node, deep: bool = False):
        seen: dict[object, int] = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                continue  # let SafeLoader report an unhashable key itself
            if key == "hosts" and isinstance(value_node, yaml.MappingNode):
                self._host_maps.add(id(value_node))
            line = key_node.start_mark.line + 1
            if key in seen:
                self.duplicates.append(
                    _DuplicateKey(key, seen[key], line, id(node) in self._host_maps)
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


class _DuplicateKey(Exception):
    def __init__(self, key, first_line, line, host=True):
        super().__init__(key)
        self.key, self.first_line, self.line, self.host = key, first_line, line, host

    def error(self, where: str) -> UserError:
        hint = (
            "giving each host a unique name"
            if self.host
            else "keeping one of them: Ansible reads the last, and so do the checks"
        )
        return UserError(
            f"{where}: line {self.line}: duplicate key {shown(self.key)} (first on line "
            f"{self.first_line})",
            hint=hint,
        )


def _needs_ansible(data, group: str = NODES_GROUP) -> bool:
    """Whether a YAML inventory has what only Ansible resolves: a host range in the group of
    the nodes, or groups nested in it; or, for a group other than the default, the group not
    directly under all.children (Ansible finds it wherever it is); or a group name Ansible
    reads with a warning (slurm-node), so that its warning is passed on as it reads it."""
    if not _PLAIN_GROUP.fullmatch(group):
        return True
    top = data.get("all") if isinstance(data, dict) else None
    children = top.get("children") if isinstance(top, dict) else None
    found = children.get(group) if isinstance(children, dict) else None
    if not isinstance(found, dict):
        return group != NODES_GROUP and isinstance(top, dict)
    hosts = found.get("hosts")
    if not isinstance(hosts, dict):
        hosts = {}
    return "children" in found or any(_HOST_RANGE.search(str(name)) for name in hosts)


# A group name Ansible reads without a word (its TRANSFORM_INVALID_GROUP_CHARS rule): a Python
# name. Others ('-', '.') it reads with a warning.
_PLAIN_GROUP = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Ansible's host range: node[01:04], node[a:c], node[0:10:2].
_HOST_RANGE = re.compile(r"\[[0-9A-Za-z]+:[0-9A-Za-z]+(:[0-9]+)?\]")


def _plain(value):
    """A value as plain Python types (Ansible tags its strings and numbers)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def resolve_with_ansible(
    path: Path,
    group: str = NODES_GROUP,
    problems: _Problems | None = None,
    origins: dict[str, str] | None = None,
) -> dict:
    """The inventory as ansible-playbook sees it (ansible-core's inventory loader and variable
    manager: YAML or INI, group_vars/ and host_vars/, ranges, nested groups), as a document in
    the plain layout: the hosts of `group` in order, each with every variable it resolves to,
    and the cluster-wide fields once (refused where two hosts disagree). Errors go into
    `problems` where given (raised with the others), else are raised here. `origins`, where
    given, receives the group whose variables set each cluster-wide value ('all' for all's
    own, [nodes:vars] gives 'nodes'), for the messages that name it."""
    where = f"inventory {path}"
    own_problems = problems is None
    problems = _Problems() if problems is None else problems
    resolved, setters = _ansible_hosts(path, group, where, problems)
    if not resolved:
        problems.fatal(
            UserError(
                f"{where}: no hosts in group '{group}' as Ansible reads it",
                hint=f"listing the nodes in a group named {group} (inventory.example.yml)",
            )
        )
    cluster = _cluster_wide(resolved, where, problems)
    hosts_doc = {
        name: {key: value for key, value in own.items() if key not in CLUSTER_FIELDS}
        for name, own in resolved.items()
    }
    hosts_doc = {
        name: {key: value for key, value in own.items() if key not in cluster}
        for name, own in hosts_doc.items()
    }
    if origins is not None:
        origins.update({key: setters.get(key, "all") for key in cluster})
    if own_problems:
        problems.raise_if_any()
    return {"all": {"vars": cluster, "children": {group: {"hosts": hosts_doc}}}}


def _ansible_hosts(
    path: Path, group: str, where: str, problems: _Problems
) -> tuple[dict[str, dict], dict[str, str]]:
    """The hosts of `group` as ansible-core resolves them, in order, each with its variables
    (Ansible's magic ones left out), and the group whose variables set each of the first
    host's (_group_setters). Ansible's own warnings are added to `problems`; a file it cannot
    read ends the pass."""
    saved = {key: os.environ.get(key) for key in _ANSIBLE_SETTINGS}
    os.environ.update(_ANSIBLE_SETTINGS)
    try:
        from ansible.errors import AnsibleError
        from ansible.inventory.manager import InventoryManager
        from ansible.parsing.dataloader import DataLoader
        from ansible.vars.manager import VariableManager

        loader = DataLoader()
        said = io.StringIO()  # Ansible's own warnings: the reason goes into our one line
        try:
            with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
                manager = InventoryManager(loader=loader, sources=[str(path)])
            variables = VariableManager(loader=loader, inventory=manager)
            nodes = manager.groups.get(group)
            hosts = nodes.get_hosts() if nodes is not None else []
            resolved = {
                host.name: {
                    key: _plain(value)
                    for key, value in variables.get_vars(host=host, include_hostvars=False).items()
                    if key not in _ANSIBLE_MAGIC
                }
                for host in hosts
            }
            with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
                setters = _group_setters(loader, str(path), hosts[0]) if hosts else {}
            odd = sorted(name for name in manager.groups if not _PLAIN_GROUP.fullmatch(name))
            problems.warnings += [
                f"Warning: {where}: Ansible: {warning}"
                + (f" (groups {', '.join(odd)})" if odd and "group names" in warning else "")
                for warning in _warnings(said)
            ]
        except AnsibleError:
            reasons = re.findall(
                r"Failed to parse inventory with '\w+' plugin: (?:Failed to parse inventory: )?(.+)",
                said.getvalue(),
            )
            problems.fatal(
                UserError(
                    f"{where}: Ansible cannot read it as YAML or INI"
                    + (f": {reasons[-1]}" if reasons else ""),
                    hint=f"the layout of inventory.example.yml, or an INI inventory with a "
                    f"[{group}] group",
                )
            )
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return resolved, setters


def _cluster_wide(resolved: dict[str, dict], where: str, problems: _Problems) -> dict:
    """The cluster-wide fields, once: each the same on every host (a host that differs, or
    lacks it, is refused), and the variables the project does not read that every host has
    alike (a typo in one is then said once, not per host)."""
    cluster: dict = {}
    first_name = next(iter(resolved))
    for field in CLUSTER_FIELDS:
        values = {name: own[field] for name, own in resolved.items() if field in own}
        if not values:
            continue
        distinct = {repr(value) for value in values.values()}
        if len(distinct) > 1 or len(values) != len(resolved):
            other = next(n for n in resolved if repr(values.get(n)) != repr(values.get(first_name)))
            here, there = (
                shown(values[name]) if name in values else "unset" for name in (other, first_name)
            )
            problems.add(
                UserError(
                    f"{where}: host '{printable(other)}': field '{field}' is cluster-wide: "
                    f"the same on every node ({here} here, {there} on '{printable(first_name)}')",
                    hint="setting it once, for all (group_vars/all.yml or all.vars)",
                )
            )
            continue
        cluster[field] = values[first_name]
    # A variable the project does not read, the same on every host (set for a group, or in
    # group_vars/all.yml), is one cluster-wide value: a typo in it is reported once, not per host.
    for key, value in next(iter(resolved.values())).items():
        if (
            key not in CLUSTER_FIELDS
            and isinstance(key, str)
            and key not in _known_fields()
            and all(key in own and repr(own[key]) == repr(value) for own in resolved.values())
        ):
            cluster[key] = value
    return cluster


def _warnings(said: io.StringIO) -> list[str]:
    """Ansible's own warnings in what it printed while reading, one line each (it wraps long
    ones), in order and each once: what ansible-playbook says of the same inventory, such as
    "Invalid characters were found in group names but not replaced" for slurm-node."""
    found: list[str] = []
    warning = False  # whether the line above belongs to a warning
    for line in said.getvalue().splitlines():
        if line.startswith("[WARNING]:"):
            found.append(line.removeprefix("[WARNING]:").strip())
            warning = True
        elif warning and line.strip() and not line.startswith("["):
            found[-1] += " " + line.strip()  # the wrapped rest of the warning above
        else:
            warning = False  # a blank line, or another kind of message ([DEPRECATION ...])
    return list(dict.fromkeys(found))


def _group_setters(loader, source: str, host) -> dict[str, str]:
    """Each variable a group of `host` sets, with the name of the group whose value it gets:
    of the groups that set it (in the inventory, [G:vars] or vars:, or in group_vars/G.yml),
    the last in Ansible's order of precedence ('all' first, the deepest last)."""
    from ansible.inventory.helpers import sort_groups
    from ansible.vars.plugins import get_vars_from_inventory_sources

    setters: dict[str, str] = {}
    for found in sort_groups(host.get_groups()):
        own = {
            **found.get_vars(),
            **get_vars_from_inventory_sources(loader, [source], [found], "task"),
        }
        setters.update({str(name): found.name for name in own})
    return setters


# Read by ansible-core when it is first imported: only the inventory formats a user writes by
# hand (no executable inventory script runs), and a file it cannot parse is an error.
_ANSIBLE_SETTINGS = {
    "ANSIBLE_INVENTORY_ENABLED": "yaml,ini",
    "ANSIBLE_INVENTORY_UNPARSED_FAILED": "True",
    "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "True",
    "ANSIBLE_LOCALHOST_WARNING": "False",
}


def _yaml(text: str, where: str, problems: _Problems | None = None):
    """The YAML document of `text`. A key given twice in one mapping is an error: added to
    `problems` where given (the last value kept, as Ansible keeps it, and the rest checked in
    the same pass), else raised."""
    try:
        loader = _UniqueKeyLoader(text)
        try:
            document = loader.get_single_data()
        finally:
            loader.dispose()
        duplicates = sorted(loader.duplicates, key=lambda found: found.line)
        if duplicates:
            if problems is None:
                raise duplicates[0]
            for duplicate in duplicates:
                problems.add(duplicate.error(where))
        return document
    except _DuplicateKey as dup:
        raise dup.error(where) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{where} is not valid YAML{at}: {problem}") from None
    except RecursionError:
        # PyYAML composes nested collections recursively: a few hundred '[' exhaust the stack.
        raise UserError(f"{where} is nested too deeply to be an inventory") from None
    except ValueError as exc:
        # What SafeLoader's constructors let through: a date like 2024-02-30, or an integer of
        # more digits than Python converts (its message goes on to suggest a Python setting).
        reason = str(exc).split(";")[0]
        raise UserError(f"{where} holds a value YAML cannot read: {reason}") from None


def _sources(path: Path) -> list[tuple[Path, object]]:
    """The inventory files Ansible reads for `path` (the file, or each file of a directory but
    group_vars/ and host_vars/), each with its YAML mapping, or its text where it holds none
    (then INI)."""
    files = (
        [path]
        if not path.is_dir()
        else sorted(f for f in path.iterdir() if f.is_file() and not f.name.startswith("."))
    )
    found: list[tuple[Path, object]] = []
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        try:
            document = yaml.safe_load(text)
        except (yaml.YAMLError, ValueError, RecursionError):
            document = None
        found.append((file, document if isinstance(document, dict) else text))
    return found


def _check_defined_once(sources, where: str, problems: _Problems) -> None:
    """A host given values in two places (two groups, two lines of an INI file, two files)
    where they disagree: Ansible keeps one of them without a word, so it is refused, naming
    both places."""
    seen: dict[str, list[tuple[str, dict]]] = {}
    several = len(sources) > 1
    for file, document in sources:
        definitions = (
            _yaml_definitions(document)
            if isinstance(document, dict)
            else _ini_definitions(document)
            if isinstance(document, str)
            else ()
        )
        for name, place, values in definitions:
            place = f"{file.name} {place}" if several else place
            for other_place, other in seen.get(name, []):
                for field, value in values.items():
                    if field in other and repr(other[field]) != repr(value):
                        problems.add(
                            UserError(
                                f"{where}: host '{printable(name)}': field "
                                f"'{printable(str(field))}': defined twice, "
                                f"{shown(other[field])} {other_place} and {shown(value)} {place}",
                                hint="giving the host's values once, and its name alone in its "
                                "other groups",
                            )
                        )
            seen.setdefault(name, []).append((place, values))


def _yaml_definitions(document: dict):
    """(host, "group 'G'", values) for each host given values in a YAML inventory."""

    def walk(group, body, depth=0):
        if not isinstance(body, dict) or depth > 50:
            return
        hosts = body.get("hosts")
        if isinstance(hosts, dict):
            for name, values in hosts.items():
                if isinstance(values, dict) and values:
                    yield _text(name), f"in group '{printable(_text(group))}'", values
        children = body.get("children")
        if isinstance(children, dict):
            for child, child_body in children.items():
                yield from walk(child, child_body, depth + 1)

    for group, body in document.items():
        yield from walk(group, body)


_INI_SECTION = re.compile(r"\[([^:\]\s]+)(?::(\w+))?\]\s*(?:[#;].*)?")


def _ini_definitions(text: str):
    """(host, "line N (group 'G')", values) for each INI host line that gives values, its
    range expanded as Ansible expands it."""
    group, kind = "ungrouped", "hosts"
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        section = _INI_SECTION.fullmatch(line)
        if section:
            group, kind = section.group(1), section.group(2) or "hosts"
            continue
        if kind != "hosts":
            continue
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        if len(tokens) < 2 or not all("=" in token for token in tokens[1:]):
            continue
        values = dict(token.split("=", 1) for token in tokens[1:])
        for name in _expanded(tokens[0]):
            yield name, f"on line {number} (group '{printable(group)}')", values


def _expanded(pattern: str) -> list[str]:
    if pattern.count(":") == 1 and not _HOST_RANGE.search(pattern):
        pattern = pattern.split(":")[0]  # host:port
    if not _HOST_RANGE.search(pattern):
        return [pattern]
    try:
        from ansible.plugins.inventory import expand_hostname_range

        return list(expand_hostname_range(pattern))
    except Exception:  # noqa: BLE001 - Ansible reports a bad range itself
        return [pattern]
