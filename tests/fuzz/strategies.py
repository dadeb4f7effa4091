"""Inputs for the fuzz tests: arbitrary text and YAML, and mutations of valid inventories.

Every address in the valid inventory is from the documentation ranges (RFC 5737), and no test
lets a call get as far as using one: see guard.py.
"""

from __future__ import annotations

import copy

import yaml
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Deterministic in CI (derandomize, no example database) and bounded, so the whole directory
# runs in about a minute on two cores.
FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,  # tmp_path and the seams are the same per example
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)

COMPUTE_SUBNET = "192.0.2.0/24"  # TEST-NET-1
VALID_INVENTORY = {
    "all": {
        "vars": {"compute_subnet": COMPUTE_SUBNET, "rendezvous_port": 29500},
        "children": {
            "nodes": {
                "hosts": {
                    "node1": {
                        "ansible_host": "198.51.100.11",  # TEST-NET-2
                        "compute_ip": "192.0.2.11",
                        "compute_interface": "eth1",
                        "gpus": 0,
                    },
                    "node2": {
                        "ansible_host": "198.51.100.12",
                        "compute_ip": "192.0.2.12",
                        "compute_interface": "eth1",
                        "gpus": 1,
                    },
                }
            }
        },
    }
}
HOST_FIELDS = (
    "ansible_host",
    "compute_ip",
    "compute_interface",
    "gpus",
    "ansible_port",
    "ansible_user",
    "ansible_ssh_private_key_file",
    "training_python",
    "cuda_visible_devices",
)
CLUSTER_FIELDS = (
    "compute_subnet",
    "rendezvous_port",
    "launch_mode",
    "training_image",
    "container_memlock",
    "ssh_known_hosts_file",
    "ansible_ssh_common_args",
    "ansible_host_key_checking",
    "checkpoint_root",
    "data_root",
    "workdir_root",
    "container_mounts",
)

# Strings that broke, or nearly broke, the loader: kept in every run's mix.
TRICKY_STRINGS = (
    "",
    " ",
    "\n",
    "eth1\n",
    "pc1\n",
    "a\x00b",
    "\x1b[31m",
    "²",
    "0,²",
    "٣",
    "1_0",
    "0x10",
    "~",
    "~nobody/key",
    "unlimited",
    "host",
    "container",
    "192.0.2.300",
    "192.0.2.11/24",
    "192.0.2.11 ",
    "10.0.0.0/8",
    "0.0.0.0/0",
    "192.0.2.0/33",
    "::1",
    "é" * 8,
    "a" * 300,
    "-rm",
    "$(reboot)",
    "; rm -rf /",
    "'",
    '"',
    "\\",
    "null",
    "~/.ssh/id_ed25519",
)

# Text as YAML or a command line can carry it: any code point but surrogates.
any_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)


class HugeInt:
    """An int of more decimal digits than Python will print (YAML writes it in hex). Held in
    this wrapper so that Hypothesis can show a failing example: repr() of the int itself fails."""

    def __init__(self, sign: int = 1):
        self.value = sign * 16**3700

    def __repr__(self) -> str:
        return f"HugeInt({'-' if self.value < 0 else ''}16**3700)"


big_ints = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 65535, 65536, 2**63, 1024, 1025]),
    st.builds(HugeInt, st.sampled_from([1, -1])),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    big_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    any_text,
    st.sampled_from(TRICKY_STRINGS),
)
yaml_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(
            st.one_of(any_text, st.integers(), st.sampled_from(HOST_FIELDS)), children, max_size=4
        ),
    ),
    max_leaves=12,
)

ipv4_like = st.one_of(
    st.builds("192.0.2.{}".format, st.integers(-1, 300)),
    st.builds("{}.{}.{}.{}".format, *[st.integers(0, 255)] * 4),
    st.sampled_from(TRICKY_STRINGS),
    st.integers(0, 2**32),
)
subnet_like = st.one_of(
    st.builds("192.0.2.0/{}".format, st.integers(-1, 40)),
    st.builds("{}/{}".format, ipv4_like, st.integers(0, 32)),
    st.sampled_from(TRICKY_STRINGS),
)
port_like = st.one_of(
    st.integers(-2, 70000), st.sampled_from(["22", "0x16", 22.0, True]), big_ints, any_text
)
label_like = st.one_of(
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9-]{0,70}", fullmatch=True),
    any_text,
    st.sampled_from(["node1", "NODE1", "node2", "pc1\n", "-a", "a-", "a_b", "a" * 64]),
)
path_like = st.one_of(
    st.sampled_from(
        [
            "/var/lib/torch-multinode/data",
            "/data",
            "/",
            "//data",
            "/data/",
            "/data/./x",
            "/a/../b",
            "data",
            "/a:b",
            "/a,b",
            "/a b",
            "/a\n",
            "",
        ]
    ),
    st.builds("/{}".format, any_text),
    st.from_regex(r"(/[a-z0-9._-]{1,8}){1,3}", fullmatch=True),
)
FIELD_VALUES = {
    "ansible_host": st.one_of(ipv4_like, any_text),
    "compute_ip": ipv4_like,
    "compute_interface": st.one_of(
        st.sampled_from(["eth1", "enp3s0", "x" * 15, "x" * 16, ".", "é" * 8]), any_text
    ),
    "gpus": port_like,
    "ansible_port": port_like,
    "rendezvous_port": port_like,
    "compute_subnet": subnet_like,
    "cuda_visible_devices": st.one_of(
        st.lists(st.one_of(st.integers(-1, 2000), any_text), max_size=4),
        st.builds(",".join, st.lists(st.sampled_from(["0", "1", "2", " 3", "²", "", "x"]))),
        big_ints,
    ),
    "launch_mode": st.sampled_from(["container", "host", "Host", "", None]),
    "container_memlock": st.one_of(st.sampled_from(["unlimited", "8m"]), big_ints),
    "ansible_ssh_common_args": st.sampled_from(
        [
            "-o StrictHostKeyChecking=yes",
            "-o StrictHostKeyChecking=no",
            "-o ControlMaster=auto",
            "-o UserKnownHostsFile=/dev/null",
        ]
    ),
    "ansible_host_key_checking": st.sampled_from([True, False, "false", "yes", 0]),
    "checkpoint_root": path_like,
    "data_root": path_like,
    "workdir_root": path_like,
    "container_mounts": st.lists(
        st.one_of(path_like, path_like.map("{}:ro".format), path_like.map("{}:rw".format)),
        max_size=3,
    ),
}


def field_values(field: str) -> st.SearchStrategy:
    return st.one_of(FIELD_VALUES.get(field, st.nothing()), scalars, yaml_values)


@st.composite
def near_valid_inventories(draw) -> dict:
    """The valid inventory with one to four things changed: a field set to a plausible or a
    wrong value or removed, a host renamed, added or dropped, a level replaced."""
    document = copy.deepcopy(VALID_INVENTORY)
    top = document["all"]
    nodes = top["children"]["nodes"]
    hosts = nodes["hosts"]
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["set", "set", "set", "delete", "rename", "add", "level"]))
        names = list(hosts) if isinstance(hosts, dict) else []
        if action in ("set", "delete"):
            where = draw(st.sampled_from(["cluster", "group", *(["host"] if names else [])]))
            fields = HOST_FIELDS + CLUSTER_FIELDS + ("unknown_key",)
            field = draw(st.sampled_from(fields))
            if where == "cluster":
                target = top.setdefault("vars", {})
            elif where == "group":
                target = nodes.setdefault("vars", {})
            else:
                target = hosts[draw(st.sampled_from(names))]
            if not isinstance(target, dict):
                continue
            if action == "delete":
                target.pop(field, None)
            else:
                target[field] = draw(field_values(field))
        elif action == "rename" and names:
            old = draw(st.sampled_from(names))
            new = draw(st.one_of(label_like, st.integers(), st.none(), st.booleans()))
            hosts[new] = hosts.pop(old)
        elif action == "add" and isinstance(hosts, dict):
            copied = copy.deepcopy(hosts[names[0]]) if names else {}
            hosts[draw(label_like)] = copied
        elif action == "level":
            level = draw(st.sampled_from(["all", "vars", "children", "nodes", "hosts", "host"]))
            value = draw(yaml_values)
            if level == "all":
                document["all"] = value
            elif level in ("vars", "children"):
                top[level] = value
            elif level == "nodes":
                top["children"]["nodes"] = value
            elif level == "hosts":
                nodes["hosts"] = value
            elif names:
                hosts[draw(st.sampled_from(names))] = value
    return document


class _Dumper(yaml.SafeDumper):
    """Writes a HugeInt in hex, as YAML allows: such a value must reach the loader."""


def _represent_huge(dumper: yaml.SafeDumper, huge: HugeInt):
    sign = "-" if huge.value < 0 else ""
    return dumper.represent_scalar("tag:yaml.org,2002:int", f"{sign}0x{abs(huge.value):x}")


_Dumper.add_representer(HugeInt, _represent_huge)


def dump(document) -> str:
    """YAML as a person would write it (block style, unicode kept)."""
    return yaml.dump(document, Dumper=_Dumper, allow_unicode=True, sort_keys=False)


INSERTS = ("\n", ":", "- ", "{", "[", "&a ", "*a", "\t", " ", '"', "!!", "%", "? ", "\\")


@st.composite
def text_edits(draw, text: str) -> str:
    """A few character-level edits of a text: deletions, duplications, insertions."""
    for _ in range(draw(st.integers(1, 3))):
        if not text:
            break
        start = draw(st.integers(0, len(text) - 1))
        end = draw(st.integers(start, min(len(text), start + 12)))
        kind = draw(st.sampled_from(["delete", "duplicate", "insert"]))
        if kind == "delete":
            text = text[:start] + text[end:]
        elif kind == "duplicate":
            text = text[:end] + text[start:end] + text[end:]
        else:
            text = text[:start] + draw(st.sampled_from(INSERTS)) + text[start:]
    return text


def _pathological(kind: int) -> str:
    """Texts that break parsers in other ways than by syntax: nesting deeper than the stack,
    numbers longer than int() converts, a date that does not exist."""
    return [
        "[" * 2000,
        "{a: " * 700,
        "- " * 1500 + "x",
        "all: " + "1" * 5000,
        '{"nodes": ' + "9" * 5000 + "}",
        "[" * 100_000,
        "all: 2024-02-30",
        "\ufeffall: {vars: {compute_subnet: 192.0.2.0/24}}",
    ][kind]


# Built, not listed: Hypothesis shows a strategy's values, and these are long.
pathological_texts = st.builds(_pathological, st.integers(0, 7))

inventory_texts = st.one_of(
    any_text,
    pathological_texts,
    st.text(max_size=400),
    yaml_values.map(dump),
    near_valid_inventories().map(dump),
    near_valid_inventories().map(dump).flatmap(text_edits),
)
