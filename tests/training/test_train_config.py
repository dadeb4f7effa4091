"""The typed config: CLI over file over defaults, --help, and bad input as one `Error:` line."""

from __future__ import annotations

import re

import pytest

from tests.training.conftest import run_main
from torch_multinode.cluster.errors import UserError
from torch_multinode.training import ddp
from torch_multinode.training.settings.config import TrainConfig, parse

TORCHRUN_OF_4 = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "1",
}


def test_flags_override_the_file_which_overrides_the_defaults(tmp_path):
    settings = tmp_path / "run.yml"
    settings.write_text(
        "optim: {lr: 0.5, momentum: 0.0}\nmodel: {model: tiny}\nddp: {static_graph: true}\n"
    )
    config = parse(TrainConfig, ["--config", str(settings), "--lr", "0.25", "--no-static-graph"])
    assert config.optim.lr == 0.25  # flag over file
    assert config.optim.momentum == 0.0  # file over default
    assert config.model.model == "tiny"
    assert config.ddp.static_graph is False  # a boolean flag can switch the file's value off
    assert config.optim.global_batch_size == 64  # default
    assert config.checkpoint.resume is None  # unset means: decide from the directory


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("optim: {learning_rate: 1}", "unknown setting optim.learning_rate"),
        ("optimizer: {lr: 1}", "unknown section 'optimizer'"),
        ("optim: {lr: fast}", "optim.lr must be float, got 'fast'"),
        ("run: {steps: true}", "run.steps must be int, got True"),
        ("model: {model: vgg}", "model.model is 'vgg', not one of tiny, resnet18, resnet50"),
        ("- lr", "must hold a mapping of sections, got list"),
    ],
)
def test_bad_config_files_name_the_setting(tmp_path, text, message):
    settings = tmp_path / "bad.yml"
    settings.write_text(text)
    with pytest.raises(UserError) as error:
        parse(TrainConfig, ["--config", str(settings)])
    assert str(error.value) == f"{settings}: {message}" or str(error.value).endswith(message)


def test_help_documents_every_field_and_the_precedence(capsys):
    code, out, _ = run_main(ddp.main, ["--help"], capsys)
    assert code == 0
    assert "precedence: flags > --config YAML file" in out
    assert "--global-batch-size N" in out and "(default: 64)" in out
    assert "--comm-hook {none,fp16,bf16,powersgd,auto}" in out
    assert "--resume, --no-resume" in out
    for section in ("data:", "model:", "optim:", "ddp:", "checkpoint:", "run:"):
        assert f"\n{section}\n" in out
    # Test hooks are accepted but not offered to users.
    assert "test hook" not in out and "--step-delay" not in out and "--stop-after-step N" not in out
    config = parse(TrainConfig, ["--step-delay", "0.5", "--stop-after-step", "3"])
    assert (config.run.step_delay, config.checkpoint.stop_after_step) == (0.5, 3)


@pytest.mark.parametrize(
    ("argv", "environ", "line"),
    [
        (
            ["--global-batch-size", "30"],
            TORCHRUN_OF_4,
            "Error: global batch 30 is not divisible by world size 4 (try --global-batch-size 28)",
        ),
        (
            ["--precision", "bf16"],
            {},
            "Error: --precision bf16 needs a GPU; this run is on CPU (try --precision fp32)",
        ),
        (["--sync-bn"], {}, "Error: --sync-bn needs GPUs: torch's SyncBatchNorm only runs on CUDA"),
        (["--steps", "0"], {}, "Error: --steps must be positive, got 0"),
        # argparse's own wording (its quoting of choices varies between Python versions)
        (
            ["--model", "vgg"],
            {},
            re.compile(
                r"Error: argument --model: invalid choice: 'vgg' "
                r"\(choose from .*tiny.*\) \(try --help\)"
            ),
        ),
        (["--dataset", "cifar10"], {}, "Error: --dataset cifar10 needs --data-dir"),
        (
            ["--dataset", "cifar10", "--data-dir", "/nonexistent"],
            {},
            "Error: --data-dir /nonexistent is not a directory on this node",
        ),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(monkeypatch, capsys, argv, environ, line):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    code, out, err = run_main(ddp.main, argv, capsys)
    assert code == 2
    if isinstance(line, re.Pattern):
        assert line.fullmatch(err.rstrip("\n")) and err.count("\n") == 1, err
    else:
        assert err == line + "\n"
    assert "Traceback" not in out + err
