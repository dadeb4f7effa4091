"""The inventory loader, fuzzed: any text ends in a valid Inventory or in one UserError whose
line names the inventory; nothing else escapes. An accepted inventory holds only values the
callers can use as they are (no newline in a name, no NUL in a path, ports in range, ...)."""

from __future__ import annotations

import ipaddress
import posixpath

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.strategies import (
    FIELD_VALUES,
    FUZZ,
    VALID_INVENTORY,
    HugeInt,
    any_text,
    dump,
    inventory_texts,
    near_valid_inventories,
    yaml_values,
)
from torch_multinode.cluster import inventory, inventory_checks, inventory_read, inventory_validate
from torch_multinode.cluster.errors import UserError


def parse_or_error(text: str) -> inventory.Inventory | None:
    """The loader's contract: an Inventory, or a UserError of one line, exit code 2."""
    try:
        return inventory_read.parse(text, "fuzz.yml")
    except UserError as error:
        line = error.line()
        assert line.startswith("Error: inventory fuzz.yml"), line
        assert "\n" not in line and "\r" not in line, line
        assert error.exit_code == 2
        return None


def _usable(word: str) -> bool:
    return word != "" and not any(c.isspace() or not c.isprintable() for c in word)


def assert_usable(loaded: inventory.Inventory) -> None:
    """What every caller of an accepted inventory relies on without checking again."""
    assert loaded.hosts, "an inventory without hosts was accepted"
    assert 1 <= loaded.rendezvous_port <= 65535
    assert loaded.launch_mode in inventory.LAUNCH_MODES
    assert _usable(loaded.training_image)
    assert loaded.container_memlock == "unlimited" or loaded.container_memlock.isdigit()
    names = [h.name.lower() for h in loaded.hosts]
    assert len(set(names)) == len(names)
    assert len({h.compute_ip for h in loaded.hosts}) == len(loaded.hosts)
    for host in loaded.hosts:
        assert inventory_validate._LABEL.fullmatch(host.name), host.name
        assert isinstance(host.compute_ip, ipaddress.IPv4Address)
        assert host.compute_ip in loaded.compute_subnet
        # `auto`: None, found on the node (cluster.autodetect) before anything uses it
        assert (host.compute_interface is None) == ("compute_interface" in host.auto)
        assert (host.gpus is None) == ("gpus" in host.auto)
        if host.compute_interface is not None:
            assert _usable(host.compute_interface) and "/" not in host.compute_interface
            assert ":" not in host.compute_interface
            assert len(host.compute_interface.encode()) <= 15
        assert host.gpus is None or 0 <= host.gpus <= inventory_checks.MAX_GPUS
        assert _usable(host.ssh_address) and 1 <= host.ssh_port <= 65535
        assert host.ssh_user is None or _usable(host.ssh_user)
        assert _usable(host.python)
        assert host.ssh_key is None or str(host.ssh_key).isprintable()
        if host.visible_gpus is not None:
            assert all(0 <= index < inventory_checks.MAX_GPUS for index in host.visible_gpus)
            assert len(set(host.visible_gpus)) == len(host.visible_gpus)
    assert loaded.known_hosts is None or str(loaded.known_hosts).isprintable()
    # Node directories reach `docker run -v PATH:PATH[:ro]` and `mkdir -p` as they are.
    roots = [loaded.checkpoint_root, loaded.data_root, loaded.workdir_root]
    directories = roots + [mount.path for mount in loaded.container_mounts]
    for directory in directories:
        assert _usable(directory) and ":" not in directory and "," not in directory, directory
        assert directory.startswith("/") and not directory.startswith("//"), directory
        assert directory != "/" and posixpath.normpath(directory) == directory, directory
    assert len(set(directories)) == len(directories), directories
    assert all(isinstance(mount.read_only, bool) for mount in loaded.container_mounts)
    # What `cluster check` prints must be printable too (an int too long to print was not).
    for host in loaded.hosts:
        assert str(host.gpus).isdigit() and str(host.visible_gpus)


def test_the_valid_inventory_of_the_fuzz_tests_is_valid():
    loaded = parse_or_error(dump(VALID_INVENTORY))
    assert loaded is not None and [h.name for h in loaded.hosts] == ["node1", "node2"]
    assert_usable(loaded)


@FUZZ
@given(any_text | st.text(max_size=600))
def test_arbitrary_text(text):
    loaded = parse_or_error(text)
    if loaded is not None:
        assert_usable(loaded)


@FUZZ
@given(yaml_values)
def test_arbitrary_yaml_structures(value):
    loaded = parse_or_error(dump(value))
    assert loaded is None  # no random structure has the inventory's layout


@FUZZ
@given(near_valid_inventories())
def test_near_valid_inventories(document):
    loaded = parse_or_error(dump(document))
    if loaded is not None:
        assert_usable(loaded)


STORAGE_FIELDS = (*inventory_checks.STORAGE_ROOTS, "container_mounts")


@FUZZ
@given(st.fixed_dictionaries({}, optional={field: FIELD_VALUES[field] for field in STORAGE_FIELDS}))
def test_storage_directories(fields):
    """The node directories alone, so that valid and nearly valid paths come up often."""
    document = yaml.safe_load(dump(VALID_INVENTORY))
    document["all"]["vars"].update(fields)
    loaded = parse_or_error(dump(document))
    if loaded is not None:
        assert_usable(loaded)


@FUZZ
@given(inventory_texts)
def test_edited_inventory_text(text):
    loaded = parse_or_error(text)
    if loaded is not None:
        assert_usable(loaded)


@FUZZ
@given(st.binary(max_size=300))
def test_files_of_arbitrary_bytes(tmp_path, data):
    path = tmp_path / "inventory.yml"
    path.write_bytes(data)
    try:
        loaded = inventory_read.load(path)
    except UserError as error:
        assert error.line().startswith(f"Error: inventory {path}"), error.line()
        assert "\n" not in error.line()
    else:
        assert_usable(loaded)


# --- what the fuzzing found, one example each --------------------------------------------------


def _with_host(**fields) -> str:
    document = yaml.safe_load(dump(VALID_INVENTORY))
    document["all"]["children"]["nodes"]["hosts"]["node2"].update(fields)
    return dump(document)


def _error(text: str) -> str:
    with pytest.raises(UserError) as caught:
        inventory_read.parse(text, "inv.yml")
    return caught.value.line()


HOST = "Error: inventory inv.yml: host 'node2': field"
FOUND = [
    # `$` matches before a final newline: these passed as valid before fullmatch.
    (
        "host name ending in a newline",
        dump(VALID_INVENTORY).replace("  node2:", '  "node2\\n":'),
        "Error: inventory inv.yml: host 'node2\\n': name is not a valid RFC 1123 hostname label "
        "(letters, digits and '-', 1-63 characters, no '-' at either end)",
    ),
    (
        "interface name ending in a newline",
        _with_host(compute_interface="eth1\n"),
        f"{HOST} 'compute_interface': 'eth1\\n' is not a network interface name",
    ),
    (
        "interface name with a NUL",
        _with_host(compute_interface="eth\x00"),
        f"{HOST} 'compute_interface': 'eth\\x00' is not a network interface name",
    ),
    (
        "interface name of 16 bytes in 8 characters",
        _with_host(compute_interface="é" * 8),
        f"{HOST} 'compute_interface': '{'é' * 8}' is not a network interface name",
    ),
    # Control characters went into SSH, shell commands and the terminal.
    (
        "SSH address with a NUL",
        _with_host(ansible_host="198.51.100.12\x00"),
        f"{HOST} 'ansible_host': '198.51.100.12\\x00' is not a host address",
    ),
    (
        "SSH address with a terminal escape",
        _with_host(ansible_host="\x1b[31m"),
        f"{HOST} 'ansible_host': '\\x1b[31m' is not a host address",
    ),
    (
        "user name with a space",
        _with_host(ansible_user="train er"),
        f"{HOST} 'ansible_user': 'train er' is not a user name",
    ),
    (
        "interpreter path with a NUL",
        _with_host(training_python="/usr/bin/python3\x00"),
        f"{HOST} 'training_python': '/usr/bin/python3\\x00' is not a program path",
    ),
    (
        "image name with a NUL",
        dump(VALID_INVENTORY).replace("rendezvous_port: 29500", 'training_image: "t\\0"'),
        "Error: inventory inv.yml: cluster field 'training_image': 't\\x00' is not an image name",
    ),
    # A list became the path "['a']"; a NUL made Path.exists() raise ValueError in cluster.remote.
    (
        "key file given as a list",
        _with_host(ansible_ssh_private_key_file=["a"]),
        f"{HOST} 'ansible_ssh_private_key_file': ['a'] is not a file path",
    ),
    (
        "key file path with a NUL",
        _with_host(ansible_ssh_private_key_file="key\x00"),
        f"{HOST} 'ansible_ssh_private_key_file': 'key\\x00' is not a file path",
    ),
    # str.isdigit() says yes to '²', int() says no: a ValueError escaped.
    (
        "GPU index written as a superscript",
        _with_host(cuda_visible_devices="0,²"),
        f"{HOST} 'cuda_visible_devices': '0,²' is not a list of GPU indices (try a form like 0,2)",
    ),
    (
        "GPU index of 5000 digits",
        _with_host(cuda_visible_devices="9" * 5000),
        f"{HOST} 'cuda_visible_devices': '{'9' * 76}... names a GPU beyond what one node holds "
        "(indices 0-1023)",
    ),
    # A hex int has no digit limit: accepted, then `cluster check` could not print it.
    (
        "GPU count too long to print",
        dump(VALID_INVENTORY).replace("gpus: 1", "gpus: 0x" + "f" * 4000),
        f"{HOST} 'gpus': <int too long to show> is more than one node holds (at most 1024)",
    ),
    (
        "GPU selection given as an int too long to print",
        _with_host(cuda_visible_devices=HugeInt()),
        f"{HOST} 'cuda_visible_devices': <int too long to show> names a GPU beyond what one node "
        "holds (indices 0-1023)",
    ),
    (
        "memlock beyond 64 bits",
        dump(VALID_INVENTORY).replace(
            "rendezvous_port: 29500", "container_memlock: 0x1" + "0" * 16
        ),
        "Error: inventory inv.yml: cluster field 'container_memlock': 18446744073709551616 is "
        "neither 'unlimited' nor a number of bytes (0 to 2**63-1)",
    ),
    # Exceptions PyYAML raises that are not YAMLError.
    (
        "nesting deeper than the stack",
        "[" * 2000,
        "Error: inventory inv.yml is nested too deeply to be an inventory",
    ),
    (
        "decimal int of 5000 digits",
        "all: " + "1" * 5000,
        "Error: inventory inv.yml holds a value YAML cannot read: Exceeds the limit (4300 digits) "
        "for integer string conversion: value has 5000 digits",
    ),
    (
        "date that does not exist",
        "all: 2024-02-30",
        "Error: inventory inv.yml holds a value YAML cannot read: day is out of range for month",
    ),
]


@pytest.mark.parametrize("text, line", [f[1:] for f in FOUND], ids=[f[0] for f in FOUND])
def test_what_fuzzing_found_is_one_error_line(text, line):
    assert _error(text) == line


def test_ssh_options_of_any_type_are_read_for_host_key_switches_without_a_crash():
    """The host-key check reads these as text; str() of an int too long to convert raises."""
    for value in (HugeInt(), ["-o", "X=y"], 3):
        loaded = inventory_read.parse(_with_host(ansible_ssh_common_args=value), "inv.yml")
        assert loaded.hosts[1].name == "node2"
    assert "turns off SSH host-key checking" in _error(
        _with_host(ansible_ssh_common_args=["-o", "StrictHostKeyChecking=no"])
    )


def test_a_nul_in_the_inventory_path_is_an_error_line():
    with pytest.raises(UserError) as caught:
        inventory_read.load("inv\x00.yml")
    assert caught.value.line() == (
        "Error: inventory 'inv\\x00.yml' cannot be read: embedded null byte"
    )


def test_a_gpu_list_on_the_command_line_takes_ascii_digits_only():
    assert inventory_checks.parse_gpu_list("0, 2") == (0, 2)
    assert inventory_checks.parse_gpu_list("007") == (7,)
    for bad in ("²", "٣", "0,1x"):
        with pytest.raises(UserError) as caught:
            inventory_checks.parse_gpu_list(bad)
        assert caught.value.line() == (
            f"Error: GPUS: {bad!r} is not a list of GPU indices (try a form like 0,2)"
        )
