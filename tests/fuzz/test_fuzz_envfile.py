"""The netcheck env file the launcher reads next to the inventory, fuzzed: any content ends in
the node -> variables mapping or in one UserError line; nothing else escapes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.strategies import FUZZ, any_text, pathological_texts, text_edits
from torch_multinode.cluster.errors import UserError
from torch_multinode.netcheck import envfile

VALID = {
    "nodes": {
        "node1": {
            "NCCL_SOCKET_IFNAME": "=eth1",
            "GLOO_SOCKET_IFNAME": "eth1",
            "NCCL_IB_DISABLE": "1",
        },
        "node2": {"NCCL_SOCKET_IFNAME": "=eth1", "GLOO_SOCKET_IFNAME": "eth1"},
    },
    "written_at": "2025-01-01T12:00:00+00:00",
}

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), any_text),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(any_text, children, max_size=4)
    ),
    max_leaves=10,
)


@st.composite
def near_valid_documents(draw) -> dict:
    document = json.loads(json.dumps(VALID))
    nodes = document["nodes"]
    for _ in range(draw(st.integers(1, 3))):
        node = draw(st.sampled_from(sorted(nodes)))
        if not isinstance(nodes.get(node), dict):
            continue
        where = draw(st.sampled_from(["variable", "name", "node", "nodes"]))
        if where == "variable":
            nodes[node][draw(st.one_of(any_text, st.just("GLOO_SOCKET_IFNAME")))] = draw(
                st.one_of(any_text, json_values)
            )
        elif where == "name":
            nodes[draw(any_text)] = nodes.pop(node)
        elif where == "node":
            nodes[node] = draw(json_values)
        else:
            document["nodes"] = draw(json_values)
            break
    return document


env_texts = st.one_of(
    st.text(max_size=300),
    pathological_texts,
    json_values.map(json.dumps),
    near_valid_documents().map(json.dumps),
    near_valid_documents().map(json.dumps).flatmap(text_edits),
)


def load_or_error(path) -> dict | None:
    try:
        loaded = envfile.load(path)
    except UserError as error:
        line = error.line()
        assert line.startswith(f"Error: the netcheck env file {path} "), line
        assert "\n" not in line and "\r" not in line, line
        return None
    for name, variables in loaded.items():
        assert isinstance(name, str) and name.isprintable() and name
        for key, value in variables.items():
            assert key and "=" not in key and key.isprintable() and value.isprintable()
    return loaded


def test_the_valid_document_is_valid(tmp_path):
    path = tmp_path / "netcheck-env.json"
    path.write_text(json.dumps(VALID))
    assert load_or_error(path) == VALID["nodes"]


@FUZZ
@given(env_texts)
def test_arbitrary_env_files(tmp_path, text):
    path = tmp_path / "netcheck-env.json"
    path.write_text(text, encoding="utf-8")
    load_or_error(path)


@FUZZ
@given(st.binary(max_size=200))
def test_env_files_of_arbitrary_bytes(tmp_path, data):
    path = tmp_path / "netcheck-env.json"
    path.write_bytes(data)
    load_or_error(path)


# --- what the fuzzing found, one example each --------------------------------------------------


@pytest.mark.parametrize(
    "text, reason",
    [
        # json.loads raises these, and load() caught only JSONDecodeError.
        ("[" * 100_000, "cannot be read: nested too deeply"),
        (
            '{"nodes": {"node1": {"X": ' + "1" * 5000 + "}}}",
            "cannot be read: Exceeds the limit (4300 digits) for integer string conversion: value "
            "has 5000 digits",
        ),
        # A NUL or newline went on into the job's environment on the node.
        (
            '{"nodes": {"node1": {"GLOO_SOCKET_IFNAME": "eth1\\u0000"}}}',
            "has no valid 'nodes' mapping of name -> variables",
        ),
        (
            '{"nodes": {"node1\\n": {"GLOO_SOCKET_IFNAME": "eth1"}}}',
            "has no valid 'nodes' mapping of name -> variables",
        ),
        (
            '{"nodes": {"node1": {"A=B": "eth1"}}}',
            "has no valid 'nodes' mapping of name -> variables",
        ),
    ],
)
def test_what_fuzzing_found_is_one_error_line(tmp_path, text, reason):
    path = tmp_path / "netcheck-env.json"
    path.write_text(text)
    with pytest.raises(UserError) as caught:
        envfile.load(path)
    assert caught.value.line() == (
        f"Error: the netcheck env file {path} {reason} (try 'make netcheck' again to rewrite it)"
    )
