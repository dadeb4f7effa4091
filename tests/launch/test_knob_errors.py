"""Issue 49, the first hour: errors name what the user typed. A flag `make` sets from a knob is
named as both (`NPROC=0 (--nproc-per-node)`), the Makefile and cluster.errors.KNOBS agreeing
on every pair; a hint names a command that runs here (`.venv/bin/train --help`, not `train
--help`); an unknown option, the launcher's or a workload's, gets the one it is within a typo
of; a SCRIPT= that does not compile says Python's own SyntaxError and line, and a directory
says it is one."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, make, run_cli
from torch_multinode.cluster import errors
from torch_multinode.cluster.errors import KNOBS, UserError
from torch_multinode.launch import checks

# --- the knobs ---------------------------------------------------------------------------------


# A recipe's command that runs one of the project's CLIs.
OUR_CLI = re.compile(r"\$\(BIN\)/(?:train|cluster|netcheck|bench|python -m torch_multinode)\b")


def _makefile_pairs() -> set[tuple[str, str]]:
    """(flag, knob) for every flag a recipe hands one of our CLIs with a knob's value or on a
    knob's say: `$(if $(strip $(NPROC)),--nproc-per-node $(NPROC))`, `-i "$(INVENTORY)"`,
    `$(if $(filter 1 yes true,$(FRESH)),--fresh)`."""
    text = (REPO_ROOT / "Makefile").read_text().replace("\\\n", " ")
    commands = [
        line for line in text.splitlines() if line.startswith("\t") and OUR_CLI.search(line)
    ]
    flag = r"(-{1,2}[A-Za-z][\w-]*)"
    pairs = set()
    for pattern in (
        rf"\$\(if \$\((?:strip |filter [^,]*,)\$\((\w+)\)\),\s*{flag}",
        rf"\$\(if \$\((\w+)\),\s*{flag}",
        rf"{flag} [\"']?\$\((?:or \$\(strip \$\()?(\w+)\)",
    ):
        for first, second in re.findall(pattern, "\n".join(commands)):
            flag_found, knob = (first, second) if first.startswith("-") else (second, first)
            pairs.add((flag_found, knob))
    return pairs


def _parsers() -> list[argparse.ArgumentParser]:
    """Every CLI a recipe runs, and their subcommands."""
    from torch_multinode.bench import cli as bench_cli
    from torch_multinode.cluster import cli as cluster_cli
    from torch_multinode.launch import options as launch_options
    from torch_multinode.launch import runs
    from torch_multinode.netcheck import cli as netcheck_cli
    from torch_multinode.sim import cli as sim_cli

    found = []
    todo = [
        launch_options.parser(),
        cluster_cli._parser(),
        netcheck_cli.parser(),
        sim_cli._parser(),
        runs._parser(),
        bench_cli.parser(),
    ]
    while todo:
        parser = todo.pop()
        found.append(parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += list(action.choices.values())
    return found


def test_the_makefile_and_the_knobs_agree_on_every_flag():
    """KNOBS is the one place a knob meets its flag: every flag a recipe passes for a knob is
    there under that knob (a short one by its long name), and nothing else is."""
    long_names = {}
    for parser in _parsers():
        for action in parser._actions:
            longs = [o for o in action.option_strings if o.startswith("--")]
            for option in action.option_strings:
                if longs:
                    long_names[option] = longs[0]
    pairs = {(long_names.get(flag, flag), knob) for flag, knob in _makefile_pairs()}
    assert ("--nproc-per-node", "NPROC") in pairs and ("--inventory", "INVENTORY") in pairs
    assert pairs == set(KNOBS.items())
    assert {flag for flag, _ in pairs} <= set(long_names)  # each one a flag a CLI takes


def test_make_train_names_the_knob_and_the_flag(tmp_path):
    """`make train NPROC=0`: the knob as typed and the flag it became; the launcher's code
    (bad input) in EXIT_CODE, as ever."""
    code = tmp_path / "exit-code"
    done = make("train", "NPROC=0", f"EXIT_CODE={code}", timeout=120)
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.splitlines()[0] == (
        "Error: NPROC=0 (--nproc-per-node): 0 is below 1 (try .venv/bin/train --help)"
    )
    assert code.read_text().strip() == "2"


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["--nproc-per-node", "0"],
            "Error: NPROC=0 (--nproc-per-node): 0 is below 1 (try .venv/bin/train --help)",
        ),
        (
            ["--stall", "soon"],
            "Error: STALL=soon (--stall): 'soon' is not a number of seconds (try .venv/bin/train "
            "--help)",
        ),
        (
            ["--on-hang", "pause"],
            "Error: ON_HANG=pause (--on-hang): invalid choice: 'pause' (choose from 'stop', "
            "'wait') (try .venv/bin/train --help)",
        ),
        # Not a knob: the flag alone, as argparse names it.
        (
            ["--rendezvous-timeout", "0"],
            "Error: argument --rendezvous-timeout: 0 is below 1 (try .venv/bin/train --help)",
        ),
        (
            ["--script", "a.py", "--module", "training.ddp"],
            "Error: MODULE (--module): not allowed with SCRIPT (--script) (try .venv/bin/train "
            "--help)",
        ),
        (
            ["--restart-wiat", "5"],
            "Error: unknown option --restart-wiat (did you mean --restart-wait?)",
        ),
        (["--bogus"], "Error: unknown option --bogus (try .venv/bin/train --help)"),
        (
            ["--", "--stesp", "5"],
            "Error: unknown option --stesp (did you mean --steps?)",
        ),
    ],
)
def test_the_launchers_errors_name_what_was_typed(argv, line):
    done = run_cli("train", *argv, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", line + "\n")


def test_every_clis_hint_names_a_command_that_runs_here():
    """A subcommand's, and `python -m`'s: the venv's own, by its path."""
    done = run_cli("cluster", "check", "--inventry", "x.yml")
    assert done.stderr == "Error: unknown option --inventry (did you mean --inventory?)\n"
    done = run_cli("cluster", "image", "--kind", "tpu")
    assert done.stderr == (
        "Error: KIND=tpu (--kind): invalid choice: 'tpu' (choose from 'auto', 'cpu', 'cuda') "
        "(try .venv/bin/cluster image --help)\n"
    )
    done = run_cli("netcheck", "--bogus")
    assert done.stderr == "Error: unknown option --bogus (try .venv/bin/netcheck --help)\n"
    done = run_cli("python", "-m", "torch_multinode.launch.runs", "--bogus")
    assert done.stderr == (
        "Error: unknown option --bogus (try .venv/bin/python -m torch_multinode.launch.runs "
        "--help)\n"
    )
    done = run_cli("python", "-m", "torch_multinode.sim.cli", "up", "--nodes", "x")
    assert done.stderr == (
        "Error: NNODES=x (--nodes): invalid int value: 'x' (try .venv/bin/python -m "
        "torch_multinode.sim.cli up --help)\n"
    )
    for hinted in ("bin/train --help", "bin/python -m torch_multinode.sim.cli up --help"):
        assert os.access(REPO_ROOT / ".venv" / hinted.split()[0], os.X_OK)


def test_a_command_is_named_from_here_or_whole(tmp_path, monkeypatch):
    bin_dir = Path(sys.executable).parent
    monkeypatch.chdir(bin_dir.parent.parent)
    assert errors.command("train") == f"{bin_dir.parent.name}/{bin_dir.name}/train"  # .venv/bin
    monkeypatch.chdir(tmp_path)
    assert errors.command("cluster check") == f"{bin_dir}/cluster check"
    assert errors.command("no-such-program") == "no-such-program"  # not ours: as it is


def test_unknown_options_are_offered_the_closest_one_only_where_there_is_one():
    parser = errors.ArgumentParser(prog="x")
    parser.add_argument("--steps")
    parser.add_argument("--restart-wait")
    parser.add_argument("--secret-hook", help=argparse.SUPPRESS)
    said = errors.usage_error(parser, "unrecognized arguments: --stesp 5 --lrr=1", "x --help")
    assert (
        said.line() == "Error: unknown option --stesp (did you mean --steps?); unknown option --lrr"
    )
    said = errors.usage_error(parser, "unrecognized arguments: --secret-hok", "x --help")
    assert said.line() == "Error: unknown option --secret-hok (try x --help)"  # hidden: not offered
    said = errors.usage_error(parser, "unrecognized arguments: a b", "x --help")
    assert said.line() == "Error: unrecognized arguments: a b (try x --help)"


# --- the workloads' arguments, checked on the controller ---------------------------------------


@pytest.mark.parametrize(
    "module, argv, line",
    [
        ("training.ddp", ["--stesp", "5"], "Error: unknown option --stesp (did you mean --steps?)"),
        (
            "training.fsdp",
            ["--layrs", "2"],
            "Error: unknown option --layrs (did you mean --layers?)",
        ),
        (
            "training.pipeline",
            ["--micro-batches", "2"],
            "Error: unknown option --micro-batches (did you mean --microbatches?)",
        ),
        # A bad value: the workload's own --help, as the launcher prints it.
        (
            "training.ddp",
            ["--steps", "x"],
            "Error: argument --steps: invalid int value: 'x' (try {bin}/train --module "
            "training.ddp -- --help)",
        ),
    ],
)
def test_a_workloads_unknown_option_names_the_one_meant(module, argv, line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the hint's command, named whole
    with pytest.raises(UserError) as raised:
        checks.workload_arguments(module, argv)
    assert raised.value.line() == line.format(bin=Path(sys.executable).parent)


# --- SCRIPT= -------------------------------------------------------------------------------------


def test_a_script_that_does_not_compile_says_pythons_error_and_line(tmp_path):
    broken = tmp_path / "train.py"
    broken.write_text("import os\n\ndef main(:\n    pass\n")
    with pytest.raises(UserError) as raised:
        checks.script_compiles(broken)
    assert re.fullmatch(
        rf"Error: script {re.escape(str(broken))}: SyntaxError at line 3: [^()]+",
        raised.value.line(),
    ), raised.value.line()
    broken.write_text("if True:\n    x = 1\n      y = 2\n")
    with pytest.raises(UserError) as raised:
        checks.script_compiles(broken)
    assert raised.value.line() == (
        f"Error: script {broken}: IndentationError at line 3: unexpected indent"
    )


@pytest.mark.parametrize(
    "inside, hint",
    [
        (["train.py", "model.py"], "SCRIPT={dir}/train.py"),
        (["main.py", "util.py"], "SCRIPT={dir}/main.py"),
        (["run_me.py", "__init__.py"], "SCRIPT={dir}/run_me.py"),
        (["a.py", "b.py"], "a .py file inside it"),
        ([], "a .py file inside it"),
    ],
)
def test_a_directory_as_script_says_so_naming_the_script_inside(tmp_path, inside, hint):
    project = tmp_path / "proj"
    project.mkdir()
    for name in inside:
        (project / name).write_text("x = 1\n")
    with pytest.raises(UserError) as raised:
        checks.script_file(project)
    assert raised.value.line() == (
        f"Error: script {project} is a directory (try {hint.format(dir=project)})"
    )


def test_the_launcher_says_a_directory_is_one(tmp_path):
    (tmp_path / "train.py").write_text("x = 1\n")
    done = run_cli("train", "--script", str(tmp_path), timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"Error: script {tmp_path} is a directory (try SCRIPT={tmp_path / 'train.py'})\n"
    )
