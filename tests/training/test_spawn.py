"""The default job started with mp.spawn, as the seed documents do it, ends with exactly the
parameters of the same job under torchrun."""

from __future__ import annotations

import sys

from tests.training.conftest import REFERENCE_STEPS, TINY, load_state, max_difference, run_command


def test_spawn_and_torchrun_end_with_equal_parameters(reference_ddp, tmp_path):
    out = tmp_path / "model.pt"
    command = [
        sys.executable,
        "-m",
        "torch_multinode.training.spawn",
        "--nprocs",
        "2",
        "--",
        *TINY,
        "--steps",
        str(REFERENCE_STEPS),
        "--out",
        str(out),
    ]
    run = run_command(command, tmp_path, None, 240)
    assert run.returncode == 0, run.explain()
    assert run.digests() == reference_ddp.finished.digests()
    assert max_difference(load_state(out), reference_ddp.state) == 0.0


def test_spawn_refuses_to_nest_under_torchrun(tmp_path):
    run = run_command(
        [sys.executable, "-m", "torch_multinode.training.spawn"], tmp_path, {"WORLD_SIZE": "2"}, 60
    )
    assert run.returncode == 2
    assert run.stderr == "Error: already under torchrun: run python -m training.ddp instead\n"


def test_the_image_sharing_strategy_is_applied_and_checked():
    import pytest
    import torch.multiprocessing

    from torch_multinode.cluster.errors import UserError
    from torch_multinode.training.loop.data import apply_sharing_strategy

    before = torch.multiprocessing.get_sharing_strategy()
    try:
        assert apply_sharing_strategy({"TMN_SHARING_STRATEGY": "file_system"}) == "file_system"
        assert torch.multiprocessing.get_sharing_strategy() == "file_system"
        assert apply_sharing_strategy({}) is None
        with pytest.raises(UserError, match="TMN_SHARING_STRATEGY='shm' is not one of"):
            apply_sharing_strategy({"TMN_SHARING_STRATEGY": "shm"})
    finally:
        torch.multiprocessing.set_sharing_strategy(before)
