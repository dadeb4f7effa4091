"""make bench's detector section (issue 55): training.ddp with the straggler detector on and
off, side by side, and a user's script with the launcher's measure of its waits on and off; their
ratios against the 1 % target in the report. The torchrun runs are faked here; `bench --only
detector` runs them for real (docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from torch_multinode.bench import cli, detector, measure, report, waits_cost


def spread(*values: float) -> dict:
    return measure.Series(list(values)).as_dict()


def section(step_on=(0.0504, 0.0506, 0.0500), step_off=(0.0500, 0.0500, 0.0500)) -> dict:
    return {
        "machine": "2 cores (x86_64), CPU only, gloo over loopback, Python 3.11.2",
        "nproc": 2,
        "target": detector.DETECTOR_TARGET,
        "workload": ["-m", "torch_multinode.training.ddp", "--model", "tiny"],
        "settings": dict(detector.SETTINGS),
        "load_before": 1.5,
        "load_after": 1.7,
        "step_seconds_on": spread(*step_on),
        "step_seconds_off": spread(*step_off),
        "step_ratio": measure.ratio_series(list(step_on), list(step_off)).as_dict(),
        "fastest_step_ratio": spread(1.0, 1.002, 1.004),
        "log_every": 10,
        "own_time_us": spread(4.1, 4.0, 4.3),
        "gather_us": spread(120.0, 118.0, 130.0),
        "work_us_per_step": spread(16.1, 15.8, 17.3),
        "work_ratio": spread(1.00032, 1.00032, 1.00035),
        "waits": waits_section(),
        "waits_us_per_step": 5.6,
        "total_work_ratio": spread(1.0005, 1.0005, 1.0006),
    }


def waits_section(cost=(3.0, 2.5, 3.5)) -> dict:
    found = {
        "workload": ["-m", "torch_multinode.training.ddp", "--model", "tiny"],
        "collectives": 2000,
        "rounds": 5,
        "nccl_timing": False,
        "target": detector.DETECTOR_TARGET,
        "step_seconds_on": spread(0.0502, 0.0503, 0.0500),
        "step_seconds_off": spread(0.0500, 0.0500, 0.0500),
        "step_ratio": spread(1.004, 1.006, 1.0),
        "collectives_per_step": spread(1.4, 1.4, 1.4),
        "work_ratio": spread(*(1 + us * 1.4 / 1e6 / 0.05 for us in cost)),
    }
    for kind, extra in (("blocking", 0.0), ("async", 1.0)):
        found[f"{kind}_us_on"] = spread(*(40 + us + extra for us in cost))
        found[f"{kind}_us_off"] = spread(40.0, 40.0, 40.0)
        found[f"{kind}_cost_us"] = spread(*(us + extra for us in cost))
    return found


def data(**sections) -> dict:
    return {"command": "make bench", "date": "2026-11-30T15:00", "minutes": 3.0, "reps": 3,
            "cluster": None, **sections}  # fmt: skip


def test_the_two_settings_differ_only_in_the_factor_and_alternate(monkeypatch):
    runs: list[tuple[str, str]] = []
    rates = {"1.5": iter([495, 250, 500]), "0": iter([500, 500, 500])}

    def torchrun(target, setting, scratch, what, nproc):
        if target[0].endswith("work.py"):  # the detector's work alone
            assert target[1:] == [str(detector.CYCLES_QUICK), str(detector.ROUNDS_QUICK)]
            assert "OwnTime()" in Path(target[0]).read_text()
            runs.append(("work", setting))
            return 'BENCH {"own_time_us": 5.0, "gather_us": 150.0}\n'
        factor = target[target.index("--slow-rank-factor") + 1]
        runs.append((factor, setting))
        assert target[:2] == ["-m", "torch_multinode.training.ddp"] and nproc == 2
        step = f"step 10/20  x  {next(rates[factor])} samples/s/rank  y\n"
        return "batch    32 per rank x 2 ranks\n" + step * 3

    monkeypatch.setattr(detector, "torchrun", torchrun)
    monkeypatch.setattr(detector, "gpus", lambda: 0)
    asked = []

    def measure_waits(reps, progress, gpu_count, nproc, quick=False):
        asked.append((reps, gpu_count, nproc, quick))
        measured = waits_section()
        del measured["target"]  # the detector's section adds its target
        return measured

    monkeypatch.setattr(detector.waits_cost, "measure_waits", measure_waits)
    said: list[str] = []
    found = detector.measure_detector(3, said.append, quick=True)
    assert asked == [(3, 0, 2, True)] and found["waits"] == waits_section()
    # off first in the first rep, then on first: the Flight Recorder on in every run
    assert runs == [("0", "on"), ("1.5", "on"), ("1.5", "on"), ("0", "on"), ("0", "on"),
                    ("1.5", "on")] + [("work", "on")] * 3  # fmt: skip
    assert found["step_ratio"]["values"] == pytest.approx([500 / 495, 2.0, 1.0])
    assert found["settings"] == {"on": "1.5", "off": "0"}
    # 5 us of timing a step and a 150 us gather every 10 steps: 20 us on a 64 ms step
    assert found["work_us_per_step"]["values"] == pytest.approx([20.0] * 3)
    assert found["work_ratio"]["values"] == pytest.approx([1 + 20e-6 / 0.064] * 3)
    assert said[-2] == "detector: its own work, rep 3/3: 5.0 us of timing a step, 150 us a gather"
    assert said[0].startswith("detector: s per DDP step, rep 1/3: on 0.0646 s, off 0.0640 s")
    # Our workload's whole detector: that work, and its measure of waits, 4.0 us an
    # asynchronous collective (the median) times 1.4 a step.
    assert found["waits_us_per_step"] == pytest.approx(5.6)
    assert found["total_work_ratio"]["values"] == pytest.approx([1 + 25.6e-6 / 0.064] * 3)


def test_the_report_sets_the_step_ratio_against_the_1_percent_target(tmp_path):
    found = report.figures(data(detector=section()))
    assert found["detector_step"] == pytest.approx(1.008)
    assert report.meets("detector_step", 1.004) == "meets"
    assert report.meets("detector_step", 1.012) == "MISSES"
    report.write(data(detector=section()), tmp_path)
    text = (tmp_path / "bench.md").read_text()
    assert "| 1.008 | <= 1.01 | meets |" in text
    assert "## 17. The straggler detector's cost (this machine, no cluster)" in text
    assert "with `--slow-rank-factor 1.5` (on, the default" in text and "`0` (off" in text
    assert "- on / off: 1.008 (1.000 to 1.012, n=3); +0.8 % of step time: meets the target" in text
    assert "| 1.000 | <= 1.01 | meets |" in text  # the work and the measure of waits
    assert found["detector_work"] == pytest.approx(1.0005)
    assert (
        "Our workload's whole detector (its own work, and the measure of its waits it starts "
        "with it: 5.6 us a step, the asynchronous cost above times the step's collectives), "
        "over the step off: 1.0005 (1.0005 to 1.0006, n=3); " in " ".join(text.split())
    )
    assert "us a step timing it, 120 (118 to 130, n=3) us a gather; per step 16.1" in text
    assert "- (the step off + that work) / the step off: 1.0003 (1.0003 to 1.0004" in text
    assert json.loads((tmp_path / "bench.json").read_text())["figures"]["detector_step"] == (
        pytest.approx(1.008)
    )
    # one setting's runs spread wider than on from off: not judged, and said in its words
    noisy = section(step_on=(0.0550, 0.0700, 0.0560), step_off=(0.0500, 0.0650, 0.0500))
    report.write(data(detector=noisy), tmp_path)
    text = (tmp_path / "bench.md").read_text()
    assert "| too noisy to judge |" in text
    assert "- too noisy to judge: the runs with the detector on alone range from" in text


def test_only_detector_brings_up_no_cluster(tmp_path, monkeypatch):
    touched: list[str] = []
    monkeypatch.setattr(cli.engine, "require_engine", lambda: touched.append("engine"))
    monkeypatch.setattr(cli.sim, "up", lambda *a, **k: touched.append("up"))
    asked = []

    def measure_detector(reps, progress, quick=False):
        asked.append((reps, quick))
        return section()

    monkeypatch.setattr(cli.detector, "measure_detector", measure_detector)
    assert cli.main(["--only", "detector", "--reps", "2", "--out", str(tmp_path)]) == 0
    assert touched == [] and asked == [(2, False)]
    assert "## 17. The straggler detector's cost" in (tmp_path / "bench.md").read_text()


def test_the_measure_of_waits_is_on_only_through_the_sitecustomize_and_must_leave_totals(
    monkeypatch,
):
    """A user's script with the measure on gets the sitecustomize's directory last on its
    PYTHONPATH (nothing else differs), and its ranks' totals must be there afterwards; off, none.
    The worst case's cost per collective (one rank) times the collectives a step issued, over
    the step off."""
    runs: list[tuple[str, tuple, dict]] = []
    rates = iter([500, 500, 400, 500])  # rep 1: off, then on; rep 2: on, then off

    def torchrun(target, setting, scratch, what, nproc, python_path=(), overrides=None):
        on = bool(python_path)
        kind = "ddp" if target[0] == "-m" else "plain"
        # the Flight Recorder on in every run; the worst case in a world of one rank
        assert setting == "on" and nproc == (2 if kind == "ddp" else 1)
        runs.append((kind, tuple(python_path), dict(overrides or {})))
        if on:  # what the sitecustomize's measure leaves: 30 steps, 45 collectives
            for rank in (0, 1):
                (scratch / f"pace-rank-{rank}.json").write_text(
                    json.dumps({"rank": rank, "wall": 9.0, "waited": 3.0, "collectives": 45})
                )
        if kind == "plain":
            assert "import torch_multinode" not in Path(target[0]).read_text()
            blocking, asynchronous = (42.0, 50.0) if on else (40.0, 40.0)
            row = {
                "count": 200,
                "blocking": [blocking * 1e-6 * 200, 1.0],
                "async": [1.0, asynchronous * 1e-6 * 200],
            }
            return "BENCH " + json.dumps(row) + "\n"
        assert target[target.index("--slow-rank-factor") + 1] == "0"
        step = f"step 10/30  x  {next(rates)} samples/s/rank  y\n"
        return "batch    32 per rank x 2 ranks\n" + step * 3

    monkeypatch.setattr(waits_cost, "torchrun", torchrun)
    said: list[str] = []
    found = waits_cost.measure_waits(2, said.append, gpu_count=0, nproc=2, quick=True)
    site = str(REPO_ROOT / "training" / "distributed" / "site")
    assert [kind for kind, _, _ in runs] == ["ddp"] * 4 + ["plain"] * 4
    assert [path for _, path, _ in runs] == [(), (site,), (site,), ()] * 2
    assert all(overrides == {} for _, _, overrides in runs)  # no GPU: no NCCL timing
    assert found["step_ratio"]["values"] == pytest.approx([1.0, 500 / 400])
    # each kind's fastest round, on - off
    assert found["blocking_cost_us"]["values"] == pytest.approx([2.0, 2.0])
    assert found["async_cost_us"]["values"] == pytest.approx([10.0, 10.0])
    assert found["collectives_per_step"]["values"] == pytest.approx([1.5, 1.5])
    # DDP's are asynchronous: 10 us x 1.5 collectives on a step of 64 ms (off, both reps)
    assert found["work_ratio"]["values"] == pytest.approx([1 + 15e-6 / 0.064] * 2)
    assert said[0] == "waits: s per DDP step, rep 1/2: on 0.0640 s, off 0.0640 s, on/off 1.000"

    # A run with the measure on that leaves no totals: the settings would differ in nothing.
    def silent(target, setting, scratch, what, nproc, python_path=(), overrides=None):
        return "batch    32 per rank x 2 ranks\n" + "step 10/30  x  500 samples/s/rank  y\n" * 3

    monkeypatch.setattr(waits_cost, "torchrun", silent)
    with pytest.raises(RuntimeError, match="left 0 ranks' totals: the sitecustomize in .* did "
                       "not start"):  # fmt: skip
        waits_cost.measure_waits(1, said.append, gpu_count=0, nproc=2, quick=True)


def test_on_gpus_the_measure_runs_with_nccls_timing_as_the_launcher_sets_it(monkeypatch):
    seen: list[dict] = []

    def torchrun(target, setting, scratch, what, nproc, python_path=(), overrides=None):
        seen.append(dict(overrides or {}))
        if python_path:
            (scratch / "pace-rank-0.json").write_text(json.dumps({"collectives": 30}))
        if target[0] != "-m":
            return 'BENCH {"count": 10, "blocking": [0.001], "async": [0.001]}\n'
        return "batch    32 per rank x 1 ranks\n" + "step 10/30  x  500 samples/s/rank  y\n" * 3

    monkeypatch.setattr(waits_cost, "torchrun", torchrun)
    found = waits_cost.measure_waits(1, lambda _: None, gpu_count=1, nproc=1, quick=True)
    assert found["nccl_timing"] is True
    assert seen == [{}, {"TORCH_NCCL_ENABLE_TIMING": "1"}] * 2  # off first, then on


def test_the_report_sets_a_users_script_with_the_measure_against_the_target(tmp_path):
    found = report.figures(data(detector=section()))
    assert found["waits_step"] == pytest.approx(1.004)
    assert found["waits_work"] == pytest.approx(1 + 3.0 * 1.4 / 1e6 / 0.05)
    report.write(data(detector=section()), tmp_path)
    text = (tmp_path / "bench.md").read_text()
    assert "| DDP step time of a user's script with the launcher's measure of its waits" in text
    assert "- on / off: 1.004 (1.000 to 1.006, n=3); +0.4 % of step time: meets the target" in text
    assert (
        "  - blocking (`dist.all_reduce(t)`, waited for in the hook): on 43.0 (42.5 to 43.5, n=3) "
        "us, off 40.0 (40.0 to 40.0, n=3) us; on - off +3.0 (+2.5 to +3.5, n=3) us per "
        "collective\n"
    ) in text
    assert "callback on its future): on 44.0 (43.5 to 44.5, n=3) us" in text
    assert "the asynchronous cost times the 1.40 (1.40 to 1.40, n=3) collectives a DDP step" in text
    # a cost within the machine's noise is said so, not shown as a saving
    lower = section()
    lower["waits"] = waits_section(cost=(-2.0, -1.0, 0.5))
    report.write(data(detector=lower), tmp_path)
    text = (tmp_path / "bench.md").read_text()
    assert "us per collective: below what this machine resolves" in text
    # a report of a bench from before the measure (no "waits") still reads
    older = section()
    del older["waits"]
    report.write(data(detector=older), tmp_path)
    assert "What a user's own script gets" not in (tmp_path / "bench.md").read_text()
    assert report.figures(data(detector=older))["waits_step"] is None
