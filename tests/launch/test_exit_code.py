"""make exits 2 whenever a recipe fails, whatever the launcher's code; `make train` and `make
selftest` therefore write that code (0, 1, 2, 130, 143) to EXIT_CODE (default
.runs/exit-code), where a script around make reads it."""

from __future__ import annotations

import pytest

from tests.conftest import make
from torch_multinode.cluster.errors import Terminated
from torch_multinode.launch import cli
from torch_multinode.launch.ending import EXIT_CODE_VARIABLE


def test_make_train_leaves_the_launchers_own_code_where_the_doc_says(tmp_path):
    code_file = tmp_path / "code"
    fails, works = tmp_path / "fails.py", tmp_path / "works.py"
    fails.write_text("raise SystemExit(3)\n")
    works.write_text("print('trained')\n")

    def train(*variables: str) -> tuple[int, str]:
        code_file.write_text("stale\n")  # each run replaces it, or removes it
        done = make("train", "NPROC=1", f"EXIT_CODE={code_file}", *variables, timeout=300)
        return done.returncode, code_file.read_text() if code_file.exists() else "missing"

    assert train(f"SCRIPT={fails}") == (2, "1\n")  # a failed job
    assert train("NPROC=x") == (2, "2\n")  # a bad argument (argparse's)
    assert train(f"SCRIPT={tmp_path / 'typo.py'}") == (2, "2\n")  # a bad input (UserError)
    assert train(f"SCRIPT={works}") == (0, "0\n")


@pytest.mark.parametrize(
    ("raised", "code"), [(Terminated(), 143), (KeyboardInterrupt(), 130), (RuntimeError(), 1)]
)
def test_an_interrupted_or_crashed_launcher_writes_its_code_too(
    tmp_path, monkeypatch, raised, code
):
    def run(args):
        raise raised

    monkeypatch.setattr(cli, "run", run)
    monkeypatch.setattr(cli, "stop_on_sigterm", lambda: None)
    monkeypatch.setenv(EXIT_CODE_VARIABLE, str(tmp_path / "deeper" / "code"))
    if code == 1:  # a bug keeps its traceback
        with pytest.raises(RuntimeError):
            cli.main([])
    else:
        assert cli.main([]) == code
    assert (tmp_path / "deeper" / "code").read_text() == f"{code}\n"


def test_without_the_variable_no_file_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(EXIT_CODE_VARIABLE, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert list(tmp_path.iterdir()) == []
