"""The default job started with mp.spawn, as the seed documents do it, ends with exactly the
parameters of the same job under torchrun."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from tests.training.conftest import REFERENCE_STEPS, TINY, load_state, max_difference, run_command
from torch_multinode.training.distributed import parallel


@pytest.mark.extended
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


def test_a_store_port_comes_from_below_the_ephemeral_range_and_is_free(monkeypatch):
    """CI once saw a local torchrun's store time out: its port, picked by binding port 0, came
    from the ephemeral range and was taken as some connection's source port before the store
    bound it. A port below that range is never handed out that way."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    # A port taken by a listener here is skipped: only candidates that bind are returned.
    taken = []
    for _ in range(20):
        port = parallel.free_loopback_port()
        assert 20000 <= port < low, (port, low)
        listener = socket.socket()
        listener.bind(("127.0.0.1", port))  # free when returned
        taken.append(listener)
    try:
        held = {listener.getsockname()[1] for listener in taken}
        monkeypatch.setattr(
            parallel._PORT_CHOICE,
            "shuffle",
            lambda ports: ports.sort(key=held.__contains__, reverse=True),
        )
        assert parallel.free_loopback_port() not in held
    finally:
        for listener in taken:
            listener.close()
