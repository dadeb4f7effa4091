"""The training config, fuzzed: any --config file and any flags end in a TrainConfig whose every
field has its declared type and passes check(), or in one UserError line (exit 2)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.strategies import (
    FUZZ,
    any_text,
    big_ints,
    dump,
    pathological_texts,
    text_edits,
    yaml_values,
)
from torch_multinode.cluster.errors import UserError
from torch_multinode.training.settings import config as config_module
from torch_multinode.training.settings.config import (
    TrainConfig,
    _field_type,
    _flag,
    _leaves,
    _sections,
)


def fields() -> list[tuple[str, dataclasses.Field, type, bool]]:
    """(section, field, type, optional) for every setting of TrainConfig."""
    return [
        (section, item, kind, optional)
        for section, section_type in _sections(TrainConfig)
        for item, kind, optional in _leaves(section_type)
    ]


FIELDS = fields()


def value_for(kind: type, item: dataclasses.Field) -> st.SearchStrategy:
    """Plausible values of the right type first, then anything."""
    if item.metadata["choices"]:
        right = st.sampled_from(item.metadata["choices"])
    elif kind is bool:
        right = st.booleans()
    elif kind is int:
        right = st.one_of(st.integers(-3, 100), big_ints)
    elif kind is float:
        right = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 10))
    else:
        right = any_text
    return st.one_of(right, right, st.none(), yaml_values)


@st.composite
def near_valid_configs(draw) -> dict:
    """A settings file of a few sections, each with a few settings, mostly of the right type;
    sometimes an unknown section or setting."""
    document: dict = {}
    for section, item, kind, _ in draw(st.lists(st.sampled_from(FIELDS), max_size=6)):
        document.setdefault(section, {})[item.name] = draw(value_for(kind, item))
    if draw(st.integers(0, 9)) == 0:
        document[draw(st.sampled_from(["optimizer", "", "run"]))] = draw(yaml_values)
    sections = sorted(name for name, values in document.items() if isinstance(values, dict))
    if sections and draw(st.integers(0, 9)) == 0:
        document[draw(st.sampled_from(sections))][draw(any_text)] = draw(yaml_values)
    return document


config_texts = st.one_of(
    st.text(max_size=300),
    pathological_texts,
    yaml_values.map(dump),
    near_valid_configs().map(dump),
    near_valid_configs().map(dump).flatmap(text_edits),
)


@st.composite
def flag_lists(draw) -> list[str]:
    """Flags of TrainConfig with values as a shell passes them (text), now and then a stray word."""
    argv: list[str] = []
    for _, item, kind, _ in draw(st.lists(st.sampled_from(FIELDS), max_size=5)):
        if kind is bool:
            argv.append(draw(st.sampled_from([_flag(item.name), "--no-" + _flag(item.name)[2:]])))
            continue
        argv.append(_flag(item.name))
        plausible = st.sampled_from(
            [
                "0",
                "1",
                "-1",
                "2",
                "0.5",
                "nan",
                "inf",
                "-inf",
                "1e400",
                "9" * 5000,
                "tiny",
                "cifar10",
                "",
            ]
        )
        argv.append(draw(st.one_of(plausible, any_text)))
    if draw(st.integers(0, 4)) == 0:
        argv.insert(draw(st.integers(0, len(argv))), draw(any_text))
    return argv


def parse_or_error(argv: list[str]) -> TrainConfig | None:
    try:
        config = config_module.parse(TrainConfig, argv, prog="fuzz")
        config_module.check(config)
    except UserError as error:
        line = error.line()
        assert line.startswith("Error: ") and "\n" not in line and "\r" not in line, line
        assert error.exit_code == 2
        return None
    return config


def assert_typed(config: TrainConfig) -> None:
    """Every field holds its declared type, a declared choice, and a finite number."""
    for section, item, kind, optional in FIELDS:
        value = getattr(getattr(config, section), item.name)
        if value is None:
            assert optional, f"{section}.{item.name} is None"
            continue
        assert isinstance(value, kind), f"{section}.{item.name} = {value!r}"
        assert kind is not int or not isinstance(value, bool), f"{section}.{item.name}"
        if item.metadata["choices"]:
            assert value in item.metadata["choices"]
        if kind is float:
            assert math.isfinite(value), f"{section}.{item.name} = {value!r}"
        if kind is str:
            assert "\x00" not in value
    assert config.optim.lr >= 0 and config.run.step_delay >= 0


def test_every_field_type_is_one_the_fuzzing_knows():
    assert {kind for _, _, kind, _ in FIELDS} == {str, int, float, bool}
    assert _field_type(int | None) == (int, True)


@FUZZ
@given(config_texts)
def test_arbitrary_config_files(tmp_path, text):
    path = tmp_path / "run.yml"
    path.write_text(text, encoding="utf-8")
    config = parse_or_error(["--config", str(path)])
    if config is not None:
        assert_typed(config)


@FUZZ
@given(st.binary(max_size=200))
def test_config_files_of_arbitrary_bytes(tmp_path, data):
    path = tmp_path / "run.yml"
    path.write_bytes(data)
    config = parse_or_error(["--config", str(path)])
    if config is not None:
        assert_typed(config)


@FUZZ
@given(flag_lists())
def test_arbitrary_flags(argv):
    config = parse_or_error(argv)
    if config is not None:
        assert_typed(config)


# --- what the fuzzing found, one example each --------------------------------------------------

FOUND = [
    # UnicodeDecodeError escaped read_text().
    (b"optim: {lr: \xff}", "config file {path} is not UTF-8 text: invalid start byte"),
    # PyYAML's message ran over several lines.
    (
        b"optim: {lr: [1}",
        "{path} is not valid YAML at line 1 column 15: expected ',' or ']', but got '}'",
    ),
    # Not YAMLError: RecursionError, and ValueError from int() and date().
    (b"[" * 2000, "{path} is nested too deeply to be a config file"),
    (
        b"run: {steps: " + b"1" * 5000 + b"}",
        "{path} holds a value YAML cannot read: Exceeds the "
        "limit (4300 digits) for integer string conversion: value has 5000 digits",
    ),
    (
        b"run: {out: 2024-02-30}",
        "{path} holds a value YAML cannot read: day is out of range for month",
    ),
    # float(int) overflows past 1e308.
    (
        b"optim: {lr: 1" + b"0" * 400 + b"}",
        "{path}: optim.lr: 1" + "0" * 76 + "... is too large for a float",
    ),
    # repr() of an int too long for decimal raised ValueError inside the error message.
    (
        b"run: {steps: -0x" + b"f" * 4000 + b"}",
        "--steps must be positive, got <int too long to show>",
    ),
    (b'run: {run_dir: "a\\0b"}', "{path}: run.run_dir: 'a\\x00b' holds a NUL character"),
    # Accepted, then failed on every rank: in the optimizer, in time.sleep, in manual_seed.
    (b"optim: {lr: .nan}", "--lr must be a finite number, got nan"),
    (b"run: {step_delay: .inf}", "--step-delay must be a finite number, got inf"),
    (b"optim: {lr: -0.1}", "--lr must be 0 or more, got -0.1"),
    (b"optim: {momentum: -1}", "--momentum must be 0 or more, got -1.0"),
    (b"run: {step_delay: -1}", "--step-delay must be 0 or more, got -1.0"),
    (
        b"run: {seed: 0x10000000000000000}",
        "--seed 18446744073709551616 is outside what torch.manual_seed takes (-2**63 to 2**64-1)",
    ),
]


@pytest.mark.parametrize("data, message", FOUND, ids=[f[1][:40] for f in FOUND])
def test_what_fuzzing_found_in_files_is_one_error_line(tmp_path, data, message):
    path = tmp_path / "run.yml"
    path.write_bytes(data)
    with pytest.raises(UserError) as caught:
        config_module.check(config_module.parse(TrainConfig, ["--config", str(path)]))
    assert str(caught.value) == message.replace("{path}", str(path))
    assert caught.value.exit_code == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "nan"], "--lr must be a finite number, got nan"),
        (["--noise", "inf"], "--noise must be a finite number, got inf"),
        (["--bucket-cap-mb", "inf"], "--bucket-cap-mb must be a finite number, got inf"),
        (["--weight-decay", "-1"], "--weight-decay must be 0 or more, got -1.0"),
    ],
)
def test_what_fuzzing_found_in_flags_is_one_error_line(argv, message):
    with pytest.raises(UserError) as caught:
        config_module.check(config_module.parse(TrainConfig, argv))
    assert str(caught.value) == message
