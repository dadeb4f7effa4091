"""The all-reduce levers: `--comm-hook auto` (training.distributed.levers), accumulation with no_sync, and the
scaling benchmark workload (training.fixtures.bench_scaling). Correctness only: speed is the benchmark's
business, so nothing here asserts a time."""

from __future__ import annotations

import json
import re
import textwrap

import pytest
import torch
import torch.nn.functional as F

from tests.training.conftest import TINY, run_command, run_main, torchrun_command
from torch_multinode.cluster.errors import UserError
from torch_multinode.training.distributed import levers, parallel
from torch_multinode.training.fixtures import bench_scaling
from torch_multinode.training.modeling.models import build_model
from torch_multinode.training.settings.config import DDPConfig

NUMBER = r"(\d[\d.e+-]*)"
AUTO_LINE = re.compile(
    rf"auto: s/optimizer-step none {NUMBER}, fp16 {NUMBER}, bf16 {NUMBER}, "
    rf"powersgd {NUMBER}(?: \(measured .+ ago, .+\))? -> (none|fp16|bf16|powersgd)"
)

# Run on 2 ranks: the auto probe on a model with BatchNorm and one bucket per parameter or so
# (PowerSGD's collectives of several buckets must stay in order on gloo, or the job hangs or
# aborts), then the same training with and without no_sync.
PROBE = textwrap.dedent(
    """
    import json

    import torch
    import torch.nn.functional as F
    from torch import nn

    from torch_multinode.training.distributed import levers, parallel
    from torch_multinode.training.settings.config import DDPConfig
    from torch_multinode.training.settings.console import emit  # one write per line: the ranks share the stream

    ACCUMULATE = 2


    def small_model():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
        )


    def stepper(rank):
        generator = torch.Generator().manual_seed(100 + rank)
        batches = [
            (torch.randn(4, 3, 8, 8, generator=generator),
             torch.randint(10, (4,), generator=generator))
            for _ in range(ACCUMULATE)
        ]
        position = [0]

        def micro_step(model):
            images, labels = batches[position[0] % ACCUMULATE]
            position[0] += 1
            (F.cross_entropy(model(images), labels) / ACCUMULATE).backward()

        return micro_step


    env = parallel.read_env()
    parallel.start(env)

    model = small_model()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    choice = levers.choose(
        model, env, DDPConfig(bucket_cap_mb=0.0005), stepper(env.rank), ACCUMULATE
    )
    after = model.state_dict()
    emit("PROBE " + json.dumps({
        "rank": env.rank,
        "hook": choice.hook,
        "timings": choice.timings,
        "state_unchanged": sorted(before) == sorted(after)
        and all(torch.equal(before[name], after[name]) for name in before),
        "grads_none": all(p.grad is None for p in model.parameters()),
    }))

    trained = {}
    for no_sync in (False, True):
        model = small_model()
        ddp = parallel.wrap_ddp(model, env, DDPConfig())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        levers.run_steps(
            ddp, stepper(env.rank), ACCUMULATE, 3, no_sync=no_sync, optimizer=optimizer
        )
        trained[no_sync] = {name: p.detach().clone() for name, p in model.named_parameters()}
        del ddp
    initial = dict(small_model().named_parameters())
    emit("ACCUMULATE " + json.dumps({
        "rank": env.rank,
        "difference": max((trained[True][n] - trained[False][n]).abs().max().item()
                          for n in initial),
        "moved": max((trained[True][n] - initial[n]).abs().max().item() for n in initial),
    }))
    parallel.stop(synchronize=True)
    """
)


def rows(stdout: str, prefix: str) -> list[dict]:
    return [
        json.loads(line[len(prefix) :]) for line in stdout.splitlines() if line.startswith(prefix)
    ]


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("levers")
    (directory / "levers_probe.py").write_text(PROBE)
    finished = run_command(torchrun_command("levers_probe"), directory, None, 180)
    assert finished.returncode == 0, finished.explain()
    return finished


@pytest.mark.extended
def test_auto_says_in_one_line_what_it_measured_and_every_rank_chooses_the_same(probe_run):
    lines = [line for line in probe_run.stdout.splitlines() if line.startswith("auto:")]
    assert len(lines) == 1, probe_run.explain()
    shown = AUTO_LINE.fullmatch(lines[0])
    assert shown, lines[0]
    results = sorted(rows(probe_run.stdout, "PROBE "), key=lambda row: row["rank"])
    assert [row["rank"] for row in results] == [0, 1]
    # Both ranks hold the same (slowest-rank) timings and the same choice: the fastest of them.
    assert results[0]["timings"] == results[1]["timings"]
    assert results[0]["hook"] == results[1]["hook"] == shown.group(5)
    timings = results[0]["timings"]
    assert list(timings) == ["none", "fp16", "bf16", "powersgd"]
    assert all(seconds > 0 for seconds in timings.values())
    assert timings[shown.group(5)] == min(timings.values())
    for index, hook in enumerate(timings, start=1):
        assert float(shown.group(index)) == pytest.approx(timings[hook], rel=5e-3)


@pytest.mark.extended
def test_probing_leaves_parameters_buffers_and_gradients_as_they_were(probe_run):
    results = rows(probe_run.stdout, "PROBE ")
    assert len(results) == 2
    for row in results:
        assert row["state_unchanged"] is True, row  # parameters and BatchNorm statistics
        assert row["grads_none"] is True, row


@pytest.mark.extended
def test_accumulating_with_no_sync_equals_syncing_every_micro_batch(probe_run):
    results = rows(probe_run.stdout, "ACCUMULATE ")
    assert sorted(row["rank"] for row in results) == [0, 1]
    for row in results:
        assert row["difference"] < 1e-6, row
        assert row["moved"] > 1e-3, row  # the three optimizer steps did train


def test_one_process_auto_means_none_and_measures_nothing(capsys):
    def micro_step(_model):
        raise AssertionError("nothing to measure with one process")

    choice = levers.choose(build_model("tiny", 10), parallel.DistEnv(), DDPConfig(), micro_step)
    assert choice.hook == "none" and choice.timings == {}
    assert (
        capsys.readouterr().out == "auto: 1 process, no gradient all-reduce to speed up -> none\n"
    )


def test_auto_is_a_choice_to_make_before_wrapping_not_a_hook():
    env = parallel.DistEnv(launched=True, backend="gloo")
    with pytest.raises(ValueError, match="comm hook 'auto' is not one of none, fp16, bf16"):
        parallel.wrap_ddp(build_model("tiny", 10), env, DDPConfig(comm_hook="auto"))


def test_the_cache_gives_back_only_a_recent_measurement_of_the_same_setup(tmp_path):
    key = {"model": "resnet18", "world_size": 2, "batch": 32, "accumulate": 1, "hosts": ["a", "b"]}
    cache = levers.Cache(tmp_path / "run" / levers.CACHE_FILE, key, max_age=3600)
    timings = {"none": 1.5, "fp16": 1.25, "bf16": 1.3, "powersgd": 1.75}
    assert levers.cached(cache, levers.CANDIDATES, now=1000.0) is None  # no file yet
    levers.remember(cache, timings, now=1000.0)
    assert levers.cached(cache, levers.CANDIDATES, now=1600.0) == {
        "measured_at": 1000.0,
        "timings": timings,
    }
    assert levers.cached(cache, levers.CANDIDATES, now=1000.0 + 3601) is None  # too old
    other = levers.Cache(cache.path, {**key, "hosts": ["a", "c"]}, max_age=3600)
    assert levers.cached(other, levers.CANDIDATES, now=1600.0) is None  # another setup
    assert levers.cached(cache, (*levers.CANDIDATES, "int8"), now=1600.0) is None
    levers.remember(other, {**timings, "none": 0.5}, now=1100.0)  # both setups kept
    assert levers.cached(cache, levers.CANDIDATES, now=1600.0)["timings"] == timings
    assert levers.cached(other, levers.CANDIDATES, now=1600.0)["timings"]["none"] == 0.5
    cache.path.write_text("{not json")
    assert levers.cached(cache, levers.CANDIDATES, now=1600.0) is None
    levers.remember(cache, timings, now=1200.0)  # a broken file is replaced
    assert levers.cached(cache, levers.CANDIDATES, now=1600.0)["measured_at"] == 1200.0


def test_powersgd_warms_up_until_it_has_compressed_once():
    # It compresses from its 3rd all-reduce: one per micro-batch without no_sync, one per
    # optimizer step with it.
    assert levers.warmup_steps("powersgd", accumulate=2, no_sync=False, minimum=1) == 2
    assert levers.warmup_steps("powersgd", accumulate=2, no_sync=True, minimum=1) == 3
    assert levers.warmup_steps("powersgd", accumulate=2, no_sync=True, minimum=5) == 5
    assert levers.warmup_steps("fp16", accumulate=2, no_sync=True, minimum=1) == 1


def test_powersgd_never_goes_with_fp16s_loss_scaling(monkeypatch, tmp_path):
    """fp16's loss scale overflows now and then by design; PowerSGD's error feedback would keep
    inf - inf from that step on, and every step after it would be skipped: asked for by name
    the pair is one error line, and auto leaves PowerSGD out under fp16."""
    from torch_multinode.training import ddp
    from torch_multinode.training.loop.numerics import Numerics
    from torch_multinode.training.settings import config as config_module
    from torch_multinode.training.settings.config import TrainConfig

    argv = ["--precision", "fp16", "--comm-hook", "powersgd"]
    with pytest.raises(UserError) as caught:
        config_module.check(config_module.parse(TrainConfig, argv))
    assert caught.value.line() == (
        "Error: --comm-hook powersgd cannot go with --precision fp16: an overflowing step "
        "leaves NaN in PowerSGD's error feedback, and every step after it is skipped (try "
        "--precision bf16 (no loss scaling), or --comm-hook fp16 or bf16)"
    )
    config_module.check(config_module.parse(TrainConfig, ["--precision", "bf16", *argv[2:]]))

    offered = []
    monkeypatch.setattr(
        ddp.levers,
        "choose",
        lambda *args, candidates, **kwargs: (
            offered.append(candidates) or levers.Choice("none", {}, "")
        ),
    )
    monkeypatch.setattr(ddp, "first_batch", lambda *args: (torch.zeros(2, 3, 8, 8), None))
    monkeypatch.setattr(ddp.levers, "node_names", lambda env: ["node1", "node2"])
    config = config_module.parse(TrainConfig, ["--run-dir", str(tmp_path)])
    env = parallel.DistEnv(rank=0, world_size=2, launched=True)
    for numerics in (
        Numerics(torch.float16, True, True, "fp16"),
        Numerics(None, False, False, "fp32"),
    ):
        ddp.choose_comm_hook(config, env, torch.nn.Linear(2, 2), None, 2, numerics)
    assert offered == [("none", "fp16", "bf16"), levers.CANDIDATES]


@pytest.mark.extended
def test_the_auto_probe_in_the_ddp_workload_leaves_no_trace_and_is_reused(torchrun, tmp_path):
    run_dir = tmp_path / "run"
    arguments = [*TINY, "--steps", "4", "--comm-hook", "auto", "--run-dir", str(run_dir)]
    first = torchrun("training.ddp", *arguments)
    assert first.returncode == 0, first.explain()
    lines = first.lines("auto: ")
    assert len(lines) == 1 and AUTO_LINE.fullmatch(lines[0]) and "measured" not in lines[0]
    chosen = AUTO_LINE.fullmatch(lines[0]).group(5)
    digests = first.digests()
    assert sorted(digests) == [0, 1] and digests[0] == digests[1]
    assert "steps          4" in first.stdout
    # The same setup again: the measurement is reused, so this run goes straight to the chosen
    # hook; ending bit-identical shows the first run's probing changed nothing it trained.
    second = torchrun("training.ddp", *arguments)
    assert second.returncode == 0, second.explain()
    lines = second.lines("auto: ")
    assert len(lines) == 1 and AUTO_LINE.fullmatch(lines[0]), lines
    assert re.search(r"\(measured \d+ s ago, .*levers\.json\) -> " + chosen + "$", lines[0])
    assert second.digests() == digests


BENCH_KEYS = {"lever", "rep", "seconds_per_step", "samples_per_second", "world_size"} | {
    "accumulate",
    "batch",
    "hook",
    "no_sync",
}


@pytest.mark.extended
def test_bench_scaling_emits_a_row_per_lever_on_two_ranks(torchrun):
    run = torchrun(
        "training.fixtures.bench_scaling",
        "--image-size",
        "16",
        "--batch",
        "4",
        "--reps",
        "1",
        "--measure",
        "1",
        "--bench",
    )
    assert run.returncode == 0, run.explain()
    found = rows(run.stdout, "BENCH ")
    selection = [row for row in found if row["lever"] == "auto-selection"]
    assert len(selection) == 1 and found[0] is selection[0]
    assert set(selection[0]) == {"lever", "seconds", "timings", "chosen"}
    assert list(selection[0]["timings"]) == ["none", "fp16", "bf16", "powersgd"]
    assert selection[0]["chosen"] in selection[0]["timings"] and selection[0]["seconds"] > 0
    measured = {row["lever"]: row for row in found if row is not selection[0]}
    assert list(measured) == ["none", "fp16", "bf16", "powersgd", "no_sync", "auto"]
    for lever, row in measured.items():
        assert set(row) == BENCH_KEYS and row["rep"] == 1, row
        assert (row["world_size"], row["accumulate"], row["batch"]) == (2, 2, 4)
        assert row["samples_per_second"] == pytest.approx(2 * 4 * 2 / row["seconds_per_step"])
        expected = {"no_sync": ("none", True), "auto": (selection[0]["chosen"], True)}
        assert (row["hook"], row["no_sync"]) == expected.get(lever, (lever, False))
    assert len(run.lines("auto: s/optimizer-step")) == 1


@pytest.mark.extended
def test_bench_scaling_on_one_rank_is_a_baseline_without_ddp(torchrun):
    run = torchrun(
        "training.fixtures.bench_scaling",
        "--image-size",
        "16",
        "--batch",
        "4",
        "--reps",
        "2",
        "--measure",
        "1",
        "--bench",
        nproc=1,
    )
    assert run.returncode == 0, run.explain()
    found = rows(run.stdout, "BENCH ")
    assert [(row["lever"], row["rep"]) for row in found] == [("baseline", 1), ("baseline", 2)]
    for row in found:
        assert (row["world_size"], row["hook"], row["no_sync"]) == (1, None, False)
        assert row["samples_per_second"] == pytest.approx(4 * 2 / row["seconds_per_step"])
    assert "1 thread(s) per rank" in run.stdout


def test_bench_scaling_lever_lists(monkeypatch, capsys):
    assert bench_scaling.parse_levers("fp16, no_sync,fp16", 2) == ["fp16", "no_sync"]
    assert bench_scaling.parse_levers("none,auto", 1) == ["baseline"]
    with pytest.raises(UserError, match="baseline is the one-process series"):
        bench_scaling.parse_levers("baseline", 2)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    code, _, err = run_main(bench_scaling.main, ["--levers", "fp16,int8"], capsys)
    assert code == 2
    assert err == (
        "Error: --levers 'fp16,int8': int8 is not one of none, fp16, bf16, powersgd, no_sync, "
        "auto, baseline\n"
    )


def test_naive_accumulation_all_reduces_every_micro_batch_and_no_sync_only_the_last():
    # Counted with a stand-in for DDP: the number of backward passes outside no_sync.
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)
            self.syncing, self.synced = True, 0

        def forward(self, inputs):
            self.synced += self.syncing
            return self.linear(inputs)

        def no_sync(self):
            import contextlib

            @contextlib.contextmanager
            def skipping():
                self.syncing = False
                try:
                    yield
                finally:
                    self.syncing = True

            return skipping()

    def micro_step(model):
        F.mse_loss(model(torch.ones(1, 2)), torch.zeros(1, 2)).backward()

    for no_sync, expected in ((False, 12), (True, 3)):
        model = Counting()
        levers.run_steps(model, micro_step, 4, 3, no_sync=no_sync)
        assert model.synced == expected
        assert all(p.grad is not None for p in model.parameters())
