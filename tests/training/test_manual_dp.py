"""Hand-written data parallelism (broadcast, partition, averaged gradients) equals DDP."""

from __future__ import annotations

import pytest

from tests.training.conftest import REFERENCE_STEPS, TINY, load_state, max_difference


@pytest.mark.extended
def test_manual_data_parallel_ends_with_ddps_parameters(torchrun, tmp_path, reference_ddp):
    out = tmp_path / "manual.pt"
    run = torchrun("training.manual_dp", *TINY, "--steps", str(REFERENCE_STEPS), "--out", str(out))
    assert run.returncode == 0, run.explain()
    digests = run.digests()
    assert sorted(digests) == [0, 1] and digests[0] == digests[1], run.explain()
    # Dividing before summing, as DDP does, makes two ranks agree with DDP bit for bit.
    assert digests == reference_ddp.finished.digests()
    assert max_difference(load_state(out), reference_ddp.state) == 0.0
