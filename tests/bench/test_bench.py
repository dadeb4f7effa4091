"""make bench: the parsing, the figures against their targets, the report files, bad input."""

from __future__ import annotations

import json

import pytest

from torch_multinode.bench import (
    cli,
    ft,
    hang,
    jobs,
    latency,
    lock,
    measure,
    nodeloss,
    rebuild,
    report,
    shipping,
)


def spread(*values: float) -> dict:
    return measure.Series(list(values)).as_dict()


def scaling_section() -> dict:
    base = [10.0, 11.0, 9.0]
    levers = {"none": [13.0, 14.0, 12.0], "no_sync": [17.0, 18.0, 15.0], "auto": [16.5, 18.0, 15.0]}
    return {
        "baseline_samples_per_second": spread(*base),
        "levers": {
            name: {
                "samples_per_second": spread(*rates),
                "efficiency": measure.ratio_series(rates, [2 * b for b in base]).as_dict(),
                "seconds_per_step": spread(1.0, 1.0, 1.0),
            }
            for name, rates in levers.items()
        },
        "auto_selection": {
            "lever": "auto-selection",
            "seconds": 4.2,
            "chosen": "fp16",
            "timings": {"none": 2.0, "fp16": 1.8},
        },
        "workload": {"batch": 64, "accumulate": 2},
    }


def bench_data() -> dict:
    return {
        "command": "make bench",
        "date": "2026-11-22T12:00",
        "minutes": 17.5,
        "reps": 3,
        "cluster": "4 Debian containers",
        "bandwidth": {
            name: {
                "link": link,
                "busbw_by_size": {
                    "1048576": spread(0.09, 0.1, 0.1),
                    "67108864": spread(0.115, 0.116, 0.114),
                },
                "tcp_gbytes_per_s": spread(tcp, tcp, tcp),
                "largest_bytes": 67108864,
                "busbw_over_tcp": spread(0.115 / tcp, 0.116 / tcp, 0.114 / tcp),
            }
            for name, link, tcp in (("shaped", "1gbit", 0.119), ("unshaped", "veth", 0.6))
        },
        "scaling": scaling_section(),
        "powersgd_accuracy": {
            "args": ["--steps", "40"],
            "val_accuracy_none": 98.0,
            "val_accuracy_powersgd": 96.5,
            "cost_points": 1.5,
        },
        "launcher": {
            "make_train_seconds": spread(10, 11, 10),
            "by_hand_seconds": spread(9, 10, 9),
            "ratio": spread(10 / 9, 1.1, 10 / 9),
        },
        "netcheck": {
            "two_nodes_seconds": spread(5, 5, 5),
            "four_nodes_seconds": spread(8, 8, 9),
            "ratio": spread(1.6, 1.6, 1.8),
            "two_nodes_own_cores_seconds": spread(4, 4, 4),
            "ratio_own_cores": spread(2.0, 2.0, 2.25),
        },
        "provision": {
            "first_seconds": 100.0,
            "second_seconds": spread(40, 42, 41),
            "ratio": spread(0.4, 0.42, 0.41),
        },
        "edit_loop": {
            "workdir_files": 1000,
            "workdir_bytes": 60000,
            "edited_seconds": spread(10.2, 10.4, 10.0),
            "unchanged_seconds": spread(10.0, 10.0, 10.0),
            "ratio": spread(1.02, 1.04, 1.0),
            "edit_bytes_per_node": spread(41000, 41200, 40900),
        },
        "fsdp": {
            "model": ["--layers", "4"],
            "fsdp_tokens_per_second": spread(6000, 6100, 5900),
            "ddp_tokens_per_second": spread(8600, 8700, 8500),
            "tokens_ratio": spread(0.70, 0.70, 0.69),
            "fsdp_bytes_ratio": spread(0.5, 0.5, 0.5),
            "ddp_bytes_ratio": spread(1.0, 1.0, 1.0),
        },
        "slurm": {
            "slurm_seconds": spread(12, 13, 12),
            "ssh_seconds": spread(10, 10, 10),
            "ratio": spread(1.2, 1.3, 1.2),
        },
        "image": image_section(),
    }


def image_section() -> dict:
    whole, layer = 3_980_000_000, 1_049_000
    nodes = ("node1", "node2")
    return {
        "image": "torch-multinode/train:test",
        "image_bytes": whole - layer,
        "order": ["stream", "registry"],
        "registry_seconds": spread(180.0),
        "stream_seconds": spread(240.0),
        "ratio": spread(0.75),
        "registry_runs": [
            {
                "seconds": 180.0,
                "received": dict.fromkeys(nodes, 2_200_000_000),
                "rx_bytes": dict.fromkeys(nodes, 2_260_000_000),
                "registry_bytes_forgotten": 2_200_000_000,
            }
        ],
        "stream_runs": [
            {
                "seconds": 240.0,
                "received": dict.fromkeys(nodes, 3_990_000_000),
                "rx_bytes": dict.fromkeys(nodes, 4_100_000_000),
                "registry_bytes_forgotten": 0,
            }
        ],
        "top_layer": {
            "via": "registry",
            "reason": "",
            "seconds": 4.2,
            "image_bytes": whole,
            "layer_bytes": layer,
            "received": {"node1": 1_049_100, "node2": 1_049_100},
            "rx_bytes": {"node1": 1_200_000, "node2": 1_300_000},
            "rx_over_image": {"node1": 1_200_000 / whole, "node2": 1_300_000 / whole},
        },
    }


def test_bench_lines_are_read_through_the_launchers_node_prefix():
    output = (
        "[node1] world 2 processes\n"
        '[node1] BENCH {"lever": "none", "rep": 1, "samples_per_second": 12.5}\n'
        '[node2] something else\nBENCH {"lever": "auto-selection", "chosen": "fp16"}\n'
    )
    assert measure.bench_rows(output) == [
        {"lever": "none", "rep": 1, "samples_per_second": 12.5},
        {"lever": "auto-selection", "chosen": "fp16"},
    ]


def test_the_workloads_are_asked_for_their_bench_lines(tmp_path, monkeypatch):
    """bench_scaling and fsdp print BENCH lines only with --bench (readable lines otherwise)."""
    asked = []
    row = {"lever": "none", "rep": 1, "samples_per_second": 10.0, "seconds_per_step": 1.0}

    def train(inventory, nnodes, module, args, timeout):
        asked.append((module, args))
        return "BENCH " + json.dumps(row) + "\n"

    monkeypatch.setattr(jobs, "train", train)
    jobs.measure_scaling(tmp_path / "inventory.yml", ["--batch", "4"], 1, lambda _: None)
    assert [module for module, _ in asked] == ["training.fixtures.bench_scaling"] * 2
    assert all("--bench" in args for _, args in asked), asked

    fsdp_row = {"workload": "fsdp", "tokens_per_second": 1.0, "bytes_ratio": 0.5}

    def run(command, timeout, what):
        asked.append(("fsdp", command))
        return type("Done", (), {"stdout": "[node1] BENCH " + json.dumps(fsdp_row) + "\n"})()

    monkeypatch.setattr(jobs, "run", run)
    assert jobs.fsdp_row(tmp_path / "inventory.yml", "fsdp", 3) == fsdp_row
    assert "--bench" in " ".join(asked[-1][1])


def test_the_edit_loop_reads_what_the_projects_sync_sent_each_node(tmp_path):
    script = jobs.edit_loop_project(tmp_path / "project")
    files = [path for path in script.parent.rglob("*") if path.is_file()]
    assert len(files) == jobs.EDIT_LOOP_FILES
    line = (
        "[launcher] /p/project (1000 files, 60.1 KB) -> /var/lib/x: node1 1 changed file(s), "
        "41,234 bytes sent in 0.4 s, node2 1 changed file(s), 40,998 bytes sent in 0.5 s"
    )
    assert jobs.SENT.findall(line) == [("node1", "1", "41,234"), ("node2", "1", "40,998")]
    found = report.figures(bench_data())
    assert found["edit_loop"] == pytest.approx(1.02)
    assert found["edit_kilobytes"] == pytest.approx(41.0)
    assert report.meets("edit_loop", found["edit_loop"]) == "meets"
    assert report.meets("edit_kilobytes", 120.0) == "MISSES"


def test_the_dependencies_figure_is_a_later_run_with_them_over_the_same_project_without(
    tmp_path, monkeypatch
):
    with_them, without = jobs.dependency_projects(tmp_path)
    assert (with_them.parent / "requirements.txt").read_text() == "bench-dependency\n"
    assert not (without.parent / "requirements.txt").exists()
    assert with_them.read_text() == without.read_text() == jobs.DEPENDENT_SCRIPT
    layer = "torch-multinode/deps:0123456789abcdef0123"
    later = [
        f"[launcher] dependencies: {layer} holds requirements.txt's 1 package(s) on "
        "torch-multinode/train:test already: nothing to build\n",
        f"[launcher] dependencies: every node holds {layer} (aaaaaaaaaaaa) already: "
        "nothing to ship\n",
    ]
    assert jobs.reused(later) and not jobs.reused(later[:1])
    # The layer the section made leaves every node and this machine again.
    removed = []
    monkeypatch.setattr(jobs, "node_containers", lambda inventory: {"node1": "c1", "node2": "c2"})
    monkeypatch.setattr(jobs.sim, "docker", lambda *args, check=True: removed.append(args))
    jobs.remove_layer(tmp_path / "inventory.yml", later)
    assert removed == [
        ("exec", "c1", "docker", "rmi", layer),
        ("exec", "c2", "docker", "rmi", layer),
        ("rmi", layer),
    ]
    data = {
        **bench_data(),
        "dependencies": {
            "requirements": ["bench-dependency"],
            "first_seconds": 41.0,
            "with_seconds": spread(10.4, 10.6, 10.2),
            "without_seconds": spread(10.0, 10.0, 10.0),
            "ratio": spread(1.04, 1.06, 1.02),
        },
    }
    found = report.figures(data)
    assert found["dependencies"] == pytest.approx(1.04)
    assert report.meets("dependencies", found["dependencies"]) == "meets"
    assert report.meets("dependencies", 1.2) == "MISSES"
    text = report.markdown(data)
    assert (
        "| make train of a project with a requirements.txt, a later run (its layer built and "
        "shipped by the first) / the same project without, time to first step | 1.04 | <= 1.10 "
        "| meets |" in text
    )
    section = text.split("## 16. A project's dependencies (2 nodes, jobs in containers)\n", 1)[1]
    assert section.splitlines() == [
        "",
        "The same project with a requirements.txt (bench-dependency, which the training image lacks) and "
        "without one; `make train` to the first step, side by side. The first run with it "
        "built its layer and shipped it (41.0 s); every later one said it built and shipped "
        "nothing.",
        "- with the dependencies, a later run: 10.4 (10.2 to 10.6, n=3) s",
        "- without: 10.0 (10.0 to 10.0, n=3) s",
        "- ratio: 1.04 (1.02 to 1.06, n=3)",
    ]
    assert "## 16." not in report.markdown(bench_data())  # not measured: no section


def test_ratios_pair_the_repetitions_and_keep_the_spread():
    series = measure.ratio_series([12.0, 6.0, 9.0], [6.0, 6.0, 3.0])
    assert series.values == [2.0, 1.0, 3.0]
    assert series.as_dict() == {
        "median": 2.0,
        "min": 1.0,
        "max": 3.0,
        "n": 3,
        "values": [2.0, 1.0, 3.0],
    }


def test_figures_compare_auto_with_the_best_fixed_lever_and_plain_ddp():
    found = report.figures(bench_data())
    assert found["busbw_vs_tcp"] == pytest.approx(0.115 / 0.119)
    # efficiency, paired rep by rep: no_sync 17/20, 18/22, 15/18 (the best fixed lever)
    assert found["best_efficiency"] == pytest.approx(15 / 18)
    assert found["auto_vs_best"] == pytest.approx(16.5 / 17.0)
    assert found["auto_vs_plain"] == pytest.approx(16.5 / 13.0)
    assert found["launcher"] == pytest.approx(10 / 9)
    assert found["netcheck"] == pytest.approx(1.6)
    assert report.meets("netcheck", found["netcheck"]) == "MISSES"
    assert report.meets("auto_vs_best", found["auto_vs_best"]) == "meets"
    assert report.meets("best_efficiency", None) == "not measured"


def test_the_report_is_markdown_json_and_plots(tmp_path):
    written = report.write(bench_data(), tmp_path)
    names = sorted(p.name for p in written)
    assert names == ["bench.json", "bench.md", "busbw.png", "scaling.png"]
    for png in ("busbw.png", "scaling.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["figures"]["best_efficiency"] == pytest.approx(15 / 18)
    text = (tmp_path / "bench.md").read_text()
    assert (
        "| all_reduce busbw at 64 MiB / raw TCP, 1 Gbit/s link | 0.97 | >= 0.90 | meets |" in text
    )
    assert (
        "| netcheck wall time, 4 nodes / 2 nodes, half a core per node | 1.60 | <= 1.50 | MISSES |"
        in text
    )
    assert "With the 2 nodes on a core each (4.0 (4.0 to 4.0, n=3) s), the ratio is 2.00" in text
    assert "| no_sync | 17.0 (15.0 to 18.0, n=3) | 0.83 (0.82 to 0.85, n=3) |" in text
    assert "chose **fp16**" in text
    assert "98.00 % without a hook, 96.50 % with PowerSGD (+1.50 points of cost)" in text
    assert "| KB sent per node for that one-line edit | 41.00 | <= 100 | meets |" in text
    assert "- ratio: 1.02 (1.00 to 1.04, n=3)" in text
    assert (
        "| make train through Slurm / through the SSH launcher, time to first step | 1.20 "
        "| <= 1.25 | meets |" in text
    )
    assert "- through Slurm (scheduler: slurm): 12.0 (12.0 to 13.0, n=3) s" in text
    assert (
        "| FSDP2, one rank's parameters + gradients + optimizer state / one unsharded replica's, "
        "2 nodes | 0.50 | <= 0.55 | meets |" in text
    )
    assert "- FSDP2: 6,000 (5,900 to 6,100, n=3) tokens/s, one rank holds 0.500" in text


def test_a_partial_run_reports_what_it_measured(tmp_path):
    data = {k: v for k, v in bench_data().items() if k not in ("scaling", "bandwidth")}
    written = report.write(data, tmp_path)
    assert sorted(p.name for p in written) == ["bench.json", "bench.md"]
    assert (
        "| best lever's scaling efficiency, ResNet-18 | - | >= 0.80 | not measured |"
        in (tmp_path / "bench.md").read_text()
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--only", "scaling,speed"], "Error: --only speed: not a section (try one or more of "),
        (["--reps", "0"], "Error: --reps 0 is not between 1 and 20 (try --reps 3)"),
        (["--subnet-octet", "300"], "Error: --subnet-octet 300 is not between 1 and 254"),
        (
            ["--only", "image", "--image-reps", "0"],
            "Error: --image-reps 0 is not between 1 and 20 (try --image-reps 1)",
        ),
        # then the venv's bench --help, by a path from wherever the test runs
        (["--reps", "x"], "Error: argument --reps: invalid int value: 'x' (try "),
    ],
)
def test_bad_arguments_are_one_line_and_start_nothing(argv, message, capsys, monkeypatch):
    started = []
    monkeypatch.setattr(cli.sim, "up", lambda *a, **k: started.append(a))
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(message) and err.count("\n") == 1
    assert started == []


def test_side_by_side_alternates_which_measurement_goes_first():
    order: list[str] = []
    said: list[tuple] = []

    def ours() -> float:
        order.append("ours")
        return 2.0

    def theirs() -> float:
        order.append("theirs")
        return 1.0

    first, second = measure.side_by_side(3, ours, theirs, lambda *pair: said.append(pair))
    assert order == ["theirs", "ours", "ours", "theirs", "theirs", "ours"]
    assert (first, second) == ([2.0] * 3, [1.0] * 3)
    assert said == [(0, 2.0, 1.0), (1, 2.0, 1.0), (2, 2.0, 1.0)]


def test_a_nodes_received_bytes_leave_loopback_out():
    listing = "docker0 70\neth0 1000\neth1 2345\nlo 999999\n"
    assert measure.rx_bytes(listing) == 70 + 1000 + 2345
    assert measure.rx_bytes("") == 0


def test_the_top_layer_change_is_a_tag_of_the_same_repository():
    assert shipping.repository_of("torch-multinode/train:test") == "torch-multinode/train"
    assert shipping.repository_of("train") == "train"
    assert shipping.repository_of("127.0.0.1:5000/a/b") == "127.0.0.1:5000/a/b"
    assert shipping.derived_tag("torch-multinode/train:test") == (
        f"torch-multinode/train:{shipping.TOP_LAYER_TAG}"
    )


def _repository(storage, name: str, layers: list[str], manifests: list[str]) -> None:
    for kind, digests in (("_layers", layers), ("_manifests/revisions", manifests)):
        for digest in digests:
            link = storage / "repositories" / name / kind / "sha256" / digest / "link"
            link.parent.mkdir(parents=True)
            link.write_text(f"sha256:{digest}")
    (storage / "repositories" / name / "_manifests" / "tags" / "test").mkdir(parents=True)


def test_the_registry_forgets_a_repository_and_only_the_blobs_no_other_one_links(tmp_path):
    storage = tmp_path / "v2"
    for digest in ("aa11", "bb22", "cc33", "dd44", "ee55"):
        blob = storage / "blobs" / "sha256" / digest[:2] / digest / "data"
        blob.parent.mkdir(parents=True)
        blob.write_bytes(b"x")
    _repository(storage, "torch-multinode/train", ["aa11", "bb22", "cc33"], ["dd44", "ff66"])
    _repository(storage, "other/small", ["bb22"], ["ee55"])
    blobs = storage / "blobs" / "sha256"
    assert shipping.registry_files(storage, "torch-multinode/train") == [
        storage / "repositories" / "torch-multinode" / "train",
        blobs / "aa" / "aa11",
        blobs / "cc" / "cc33",
        blobs / "dd" / "dd44",  # ff66 is linked but was never stored: nothing to delete
    ]
    assert shipping.registry_files(storage, "never/pushed") == []


def test_the_bench_waits_only_for_other_clusters_registries():
    names = [
        "torch-multinode-registry-172-30-150-1-5000.yml",
        "torch-multinode-registry-172-30-200-1-5001.yml",
        "ca.yml",
    ]
    assert shipping.registry_endpoints(names) == {"172.30.150.1:5000", "172.30.200.1:5001"}
    ss = (
        "0 0 172.30.150.1:5000 172.30.150.11:44978\n"
        "0 0 172.30.200.1:39000 172.30.200.1:5001\n"
        "0 0 10.0.0.2:22 10.0.0.9:50000\n"
    )
    assert shipping.connections_to(ss, {"172.30.150.1:5000"}) == 1
    assert shipping.connections_to(ss, {"172.30.150.1:5000", "172.30.200.1:5001"}) == 2
    assert shipping.connections_to(ss, {"172.30.1.1:5000"}) == 0


def test_the_image_figures_set_the_first_shipment_and_a_top_layer_change_side_by_side(tmp_path):
    found = report.figures(bench_data())
    assert found["image_first_shipment"] == pytest.approx(0.75)
    assert found["image_top_layer"] == pytest.approx(1_300_000 / 3_980_000_000)
    assert report.meets("image_first_shipment", 0.75) == ""
    report.write(bench_data(), tmp_path)
    text = (tmp_path / "bench.md").read_text()
    assert (
        "| first shipment of the training image to 2 nodes, time through the registry / streamed "
        "whole (docker save into docker load over SSH) | 0.75 | (no target) |  |" in text
    )
    assert (
        "the whole image (the node's network counters, the larger of 2 nodes) | 0.00033 |" in text
    )
    assert "## 10. Shipping the training image (2 nodes, jobs in containers)" in text
    assert "| seconds | 180 (180 to 180, n=1) | 240 (240 to 240, n=1) |" in text
    assert "order stream, registry" in text
    assert "| node2 | 1,300,000 | 1,049,100 | 0.00033 | 1.24 |" in text
    assert "- ratio, registry / stream: 0.75 (0.75 to 0.75, n=1) (lower is better)" in text
    assert (
        "| rep 1: bytes per node, its network counters | node1 2,260,000,000 B (2.3 GB), node2 "
        "2,260,000,000 B (2.3 GB) | node1 4,100,000,000 B (4.1 GB)" in text
    )


def rebuild_section() -> dict:
    return {
        "changed_file": "docker/entrypoint.sh",
        "image_bytes": 3_980_000_000,
        "first_seconds": 400.0,
        "second_seconds": spread(60.0, 70.0, 65.0),
        "ratio": spread(0.15, 0.175, 0.1625),
        "install_layer_kept": [True, True, True],
        "rx_bytes": [dict.fromkeys(("node1", "node2"), 90_000)] * 3,
    }


def test_the_rebuild_figure_is_the_second_make_provision_over_the_first(tmp_path):
    data = {**bench_data(), "rebuild": rebuild_section()}
    found = report.figures(data)
    assert found["image_rebuild"] == pytest.approx(0.1625)
    assert report.meets("image_rebuild", found["image_rebuild"]) == "meets"
    assert report.meets("image_rebuild", 0.3) == "MISSES"  # the bound: a quarter
    assert report.figures(bench_data())["image_rebuild"] is None
    report.write(data, tmp_path)
    text = (tmp_path / "bench.md").read_text()
    assert (
        "| make provision after a one-line change to docker/entrypoint.sh / the first make "
        "provision on fresh nodes, 2 nodes, jobs in containers | 0.16 | <= 0.25 | meets |" in text
    )
    assert "## 11. Rebuilding the image after a one-line change" in text
    assert "- first run: 400 s" in text
    assert "- after the change: 65 (60 to 70, n=3) s" in text
    assert "- the torch install layer kept by the rebuild: 3 of 3" in text
    assert "- rep 2: bytes received, network counters: node1 90,000 B" in text
    without = tmp_path / "without"
    report.write(bench_data(), without)
    assert "## 11." not in (without / "bench.md").read_text()


def test_the_rebuild_edits_a_scratch_checkout_never_this_one(tmp_path):
    checkout = rebuild.scratch_checkout(tmp_path / "checkout")
    original = (measure.REPO_ROOT / rebuild.REBUILD_FILE).read_text()
    rebuild.edit_line(checkout / rebuild.REBUILD_FILE, "# bench rebuild 1")
    assert (checkout / rebuild.REBUILD_FILE).read_text() == f"{original}\n# bench rebuild 1\n"
    assert (measure.REPO_ROOT / rebuild.REBUILD_FILE).read_text() == original
    assert (checkout / rebuild.REBUILD_FILE).stat().st_mode == (
        measure.REPO_ROOT / rebuild.REBUILD_FILE
    ).stat().st_mode  # still executable
    assert (checkout / ".venv").resolve() == (measure.REPO_ROOT / ".venv").resolve()
    assert (checkout / "Makefile").is_file() and (checkout / "provision" / "images.py").is_file()
    # torch_multinode/'s symlinks lead to the copy's rooms, not to this checkout's
    assert (checkout / "torch_multinode" / "cluster").resolve() == (checkout / "cluster").resolve()
    # the code is copied, not linked: edits made meanwhile in this checkout never reach it
    code = checkout / "provision" / "images.py"
    assert code.stat().st_ino != (measure.REPO_ROOT / "provision" / "images.py").stat().st_ino
    assert "rebuild" in cli.SECTIONS


def test_the_hang_figure_is_the_time_from_the_last_step_to_the_verdict_over_the_budget(tmp_path):
    lines = [
        (10.0, "[node1] step 3/10\n"),
        (10.3, "[node1] step 4/10\n"),
        (26.0, "[launcher] no step lines or heartbeats for 16 s (stall after 15 s): ...\n"),
        (28.8, "[launcher] hang: rank 1 (node2) not in a collective ...\n"),
        (29.0, "[node1] step 5/10\n"),  # nothing after the verdict counts
    ]
    assert hang.stall_to_verdict(lines) == pytest.approx(18.5)
    assert hang.stall_to_verdict(lines[:3]) is None  # no verdict
    assert hang.stall_to_verdict(lines[2:4]) is None  # no step line before it
    seconds = {"median": 18.5, "min": 18.0, "max": 19.0, "n": 2, "values": [18.0, 19.0]}
    ratio = {
        k: v / hang.HANG_BUDGET if k != "n" else v for k, v in seconds.items() if k != "values"
    }
    data = {
        **bench_data(),
        "hang": {"stall": 15, "budget": 30, "nodes_2": {"seconds": seconds, "ratio": ratio}},
    }
    found = report.figures(data)
    assert found["hang_2"] == pytest.approx(18.5 / 30) and found["hang_4"] is None
    assert report.meets("hang_2", found["hang_2"]) == "meets"
    report.write(data, tmp_path)
    text = (tmp_path / "bench.md").read_text()
    assert "## 12. A hang explained (jobs in containers)" in text
    assert "- 2 nodes: 18.5 (18.0 to 19.0, n=2) s, ratio 0.62" in text


def test_the_lock_figure_is_the_checks_seconds_at_four_nodes_over_its_budget(tmp_path):
    def series(*values):
        return {
            "median": sorted(values)[len(values) // 2],
            "min": min(values),
            "max": max(values),
            "n": len(values),
            "values": list(values),
        }

    data = {
        **bench_data(),
        "lock": {
            "nodes": 4,
            "launch_mode": "host",
            "budget": lock.LOCK_BUDGET,
            "check_seconds": series(0.21, 0.24, 0.3),
            "bare_seconds": series(0.05, 0.06, 0.07),
            "ratio": series(0.21, 0.24, 0.3),
        },
    }
    found = report.figures(data)
    assert found["lock_4"] == pytest.approx(0.24)
    assert report.meets("lock_4", found["lock_4"]) == "meets"
    assert report.meets("lock_4", 1.3) != "meets"
    report.write(data, tmp_path)
    text = (tmp_path / "bench.md").read_text()
    assert "## 14. The version lock's check (4 nodes, launch_mode: host)" in text
    assert "- the check: 0.24 (0.21 to 0.30, n=3) s" in text
    assert "- a bare round trip on the same sessions, beside it: 0.06 (0.05 to 0.07, n=3) s" in text
    assert "lock" in cli.SECTIONS


def test_a_lost_nodes_figure_is_from_its_death_to_the_first_step_of_the_restarted_run(tmp_path):
    lines = [
        (1.0, "[launcher] node3 failed: stopping the job on every node...\n"),
        (2.0, "[node1] step 13/30  loss 2.0\n"),  # the failed run's last words: not counted
        (2.5, "Job tmn-1 FAILED on node3 after 40.1 s on 3 node(s).\n"),
        (13.0, "[launcher] node3 lost at restart 1 after step 13: replaced by spare node4\n"),
        (13.5, "[launcher] job tmn-1-r1: the nodes answer (waited 10 s); restart 1 of 1\n"),
        (20.0, "[node1] resuming from step 10, the newest step every rank has (...)\n"),
        (24.5, "[node1] step 11/30  loss 2.1\n"),
    ]
    assert nodeloss.death_to_first_step(lines) == (
        24.5,
        "node3 lost at restart 1 after step 13: replaced by spare node4",
    )
    assert nodeloss.death_to_first_step(lines[:5]) == (None, lines[3][1][11:].strip())
    assert nodeloss.death_to_stop(lines) == 2.5  # the job stopped everywhere: its summary
    assert nodeloss.death_to_stop(lines[:2]) is None
    series = {"median": 24.5, "min": 24.5, "max": 24.5, "n": 1, "values": [24.5]}
    stopped = {"median": 2.5, "min": 2.5, "max": 2.5, "n": 1, "values": [2.5]}
    data = {
        **bench_data(),
        "nodeloss": {
            "nodes": 3,
            "cluster_nodes": 4,
            "grace": nodeloss.NODELOSS_GRACE,
            "budget": nodeloss.NODELOSS_BUDGET,
            "became": ["node3 lost at restart 1 after step 13: replaced by spare node4"],
            "seconds": series,
            "stopped": stopped,
            "ratio": {**series, "median": 0.35, "min": 0.35, "max": 0.35, "values": [0.35]},
        },
    }
    found = report.figures(data)
    assert found["nodeloss_3"] == pytest.approx(0.35)
    assert report.meets("nodeloss_3", 0.35) == "meets"
    assert report.meets("nodeloss_3", 1.2) != "meets"
    report.write(data, tmp_path)
    text = (tmp_path / "bench.md").read_text()
    assert "## 15. A node lost for good (3 nodes of 4, in containers)" in text
    assert "- death to the job stopped on every node (the failed run's summary): 2.5" in text
    assert (
        "- what became of node3: node3 lost at restart 1 after step 13: replaced by spare" in text
    )
    assert "nodeloss" in cli.SECTIONS


def test_the_replicas_cost_is_the_extra_time_per_checkpoint_spread_over_a_minute(tmp_path):
    lines = [
        (1.0, "[node1] step  9/40  loss 5.0\n"),
        (2.0, "[node1] step 10/40  loss 4.9\n"),  # the window opens
        (2.5, "[node1] checkpoint step 10 written to /x/step-00000010 (node-local disks...)\n"),
        (9.0, "[node1] checkpoint step 20 written to /x/step-00000020 (node-local disks...)\n"),
        (30.0, "[node1] step 40/40  loss 3.0\n"),  # and closes
        (31.0, "[node1] checkpoint step 40 written to /x/step-00000040 (node-local disks...)\n"),
    ]
    assert nodeloss.timed_window(lines, 10) == (28.0, 2)
    with pytest.raises(RuntimeError):
        nodeloss.timed_window(lines[2:], 10)
    extra, ratio = nodeloss.per_checkpoint(31.0, 28.0, 3)
    assert extra == pytest.approx(1.0) and ratio == pytest.approx(1 + 1 / 60)
    series = {"median": 1.01, "min": 1.0, "max": 1.02, "n": 2, "values": [1.0, 1.02]}
    loss = {"median": 24.5, "min": 24.5, "max": 24.5, "n": 1, "values": [24.5]}
    data = {
        **bench_data(),
        "nodeloss": {
            "nodes": 3,
            "cluster_nodes": 3,
            "grace": nodeloss.NODELOSS_GRACE,
            "budget": nodeloss.NODELOSS_BUDGET,
            "became": ["node3 lost at restart 1 after step 13: dropped"],
            "seconds": loss,
            "ratio": loss,
        },
        "replication": {
            "nodes": 3,
            "job": " ".join(nodeloss.REPLICATION_JOB),
            "period": nodeloss.REPLICATION_PERIOD,
            "budget": nodeloss.REPLICATION_BUDGET,
            "with_seconds": {**series, "median": 31.0},
            "without_seconds": {**series, "median": 28.0},
            "extra_per_checkpoint": {**series, "median": 1.0},
            "ratio": series,
        },
    }
    assert report.figures(data)["replication_3"] == pytest.approx(1.01)
    assert report.meets("replication_3", 1.01) == "meets"
    assert report.meets("replication_3", 1.2) != "meets"
    report.write(data, tmp_path)
    text = (tmp_path / "bench.md").read_text()
    assert "- added per checkpoint: +1.00 (" in text
    assert "- step time at one checkpoint every 60 s, replicas on / off: 1.010 (" in text


def test_ft_figures_are_the_next_committed_step_the_steps_redone_and_the_heal(tmp_path):
    """Section 18 from recorded lines: FT=1's death to the survivors' first step without
    node3, its steps not committed, node3's return to its heal; the restart path's steps since
    its checkpoint; the report's lines and targets."""
    lines = [
        (0.4, "[node1] step 13/200  loss 2.0\n"),
        (0.9, "[launcher] node3 lost at step 12: continuing on node1, node2 (2 of 3 groups)\n"),
        (10.5, "[node1] step 14 not committed: done again\n"),
        (11.2, "[node1] step 14/200  loss 1.9\n"),
        (11.2, "[node1] step 14: 2 of 3 replica groups train: each step sees 2/3 ...\n"),
        (30.0, "[node3] healed from a peer: at step 70 with the others\n"),
    ]
    assert ft.ft_figures(lines, 12.0) == (11.2, 1, 18.0)
    with pytest.raises(RuntimeError):
        ft.ft_figures(lines[:4], 12.0)
    restarted = [
        (1.0, "[node1] step 13/30  loss 2.0\n"),
        (13.5, "[launcher] job tmn-1-r1: the nodes answer (waited 10 s); restart 1 of 1\n"),
        (20.0, "[node1] resuming from step 10, the newest step every rank has (...)\n"),
        (24.5, "[node1] step 11/30  loss 2.1\n"),
    ]
    assert ft.restart_redone(restarted) == 3
    assert ft.restart_redone(restarted[:2]) is None

    def series(value: float) -> dict:
        return {"median": value, "min": value, "max": value, "n": 1, "values": [value]}

    data = {
        **bench_data(),
        "ft": {
            "nodes": 3,
            "timeout": 10.0,
            "grace": 10,
            "death_seconds": series(11.2),
            "death_ratio": series(0.75),
            "death_budget": 15.0,
            "redone": series(1.0),
            "restart_seconds": series(24.5),
            "restart_redone": series(3.0),
            "default_ratio": series(0.036),
            "heal_seconds": series(18.0),
            "heal_ratio": series(0.3),
            "overhead": series(1.04),
            "overhead_resnet": series(1.02),
        },
    }
    found = report.figures(data)
    assert found["ft_overhead_resnet_3"] == pytest.approx(1.02)
    assert found["ft_death_3"] == pytest.approx(0.75)
    assert report.meets("ft_vs_restart_3", found["ft_vs_restart_3"]) == "meets"
    assert report.meets("ft_overhead_3", 1.2) != "meets"
    report.write(data, tmp_path)
    text = (tmp_path / "bench.md").read_text()
    assert "## 18. FT=1 against the restart path (3 nodes, in containers)" in text
    assert "- death to the survivors' next step, FT=1: 11.2 (11.2 to 11.2, n=1) s" in text
    assert "- steps done again, FT=1: 1 (1 to 1, n=1); restart path: 3 (3 to 3, n=1)" in text
    assert "with ResNet-18 (steps 10 to 30): 1.020 (1.020 to 1.020, n=1)" in text
    assert "ft" in cli.SECTIONS


# A stand-in for the launcher's job: its lines as a real job's, node2 named for its link once the
# link is shaped and for its CPU once its job container is held (the flags the fakes below
# write); it ends on SIGINT, as the launcher does.
FAKE_JOB = """\
import os, signal, sys, time
flags = sys.argv[1]
signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
print("[launcher] job tmn-lat-1: 2 nodes", flush=True)
print("[node1] step    20/100000  loss 2.0", flush=True)
said = set()
while True:
    for flag, line in (
        ("shaped", "node2 is the straggler: every node's ranks wait ...; cause: network: eth1 is "
                   "shaped (tbf at 200Kbit, tc)"),
        ("held", "node2 is the straggler: rank 1's own work takes 90 ms a step ...; cause: CPU "
                 "throttled by the job's container's cgroup quota (0.1 CPU, 80% of periods)"),
    ):
        if flag not in said and os.path.exists(os.path.join(flags, flag)):
            time.sleep(0.3)
            print("[launcher] " + line, flush=True)
            said.add(flag)
    time.sleep(0.05)
"""


def test_the_latency_section_times_each_slowdown_to_its_line_and_frees_the_link(
    tmp_path, monkeypatch
):
    """Section 19's job driven against a stand-in launcher: the link shaped, then freed before
    the CPU is held (in the job's own container, named from the run ID); the seconds from each
    change to its line; the report's figure and lines."""
    import sys

    from torch_multinode.sim import nodes as sim

    flags = tmp_path / "flags"
    flags.mkdir()
    done: list[tuple] = []

    def shape_link(container: str, link: str | None) -> None:
        done.append(("shape", container, link))
        if link is not None:
            (flags / "shaped").touch()

    def docker(*args: str, **_: object) -> None:
        done.append(("docker", *args))
        (flags / "held").touch()

    monkeypatch.setattr(sim, "shape_link", shape_link)
    monkeypatch.setattr(sim, "docker", docker)
    monkeypatch.setattr(latency, "EVEN_SECONDS", 0.2)
    (tmp_path / "job.py").write_text(FAKE_JOB)
    config = sim.SimConfig("tmnlat", "172.29.99.0/24", tmp_path / "state", "172.30.99.0/24")
    command = [sys.executable, str(tmp_path / "job.py"), str(flags)]
    seconds = latency.one_job(command, "ours", config, "1gbit", tmp_path / "ours-1.log")
    assert set(seconds) == {"network", "cpu"}
    assert all(0.3 <= value < 10 for value in seconds.values()), seconds
    node2 = config.container(2)
    assert done == [
        ("shape", node2, latency.SHAPED_RATE),
        ("shape", node2, "1gbit"),  # the bench's link again before the CPU is held
        ("docker", "exec", node2, "docker", "update", "--cpus", "0.1", "tmn-lat-1-node2"),
    ], done
    # The job's output is kept, with the bench's changes and the job's end marked.
    kept = (tmp_path / "ours-1.log").read_text()
    marks = [line.split(" ---- ")[1] for line in kept.splitlines() if " ---- " in line]
    assert marks[:2] == [
        f"node2's link shaped to {latency.SHAPED_RATE}",
        "node2's link freed; its job container held to 0.1 CPU",
    ], kept
    assert marks[-1].startswith("ended, exit "), kept
    assert "[launcher] job tmn-lat-1:" in kept, kept
    # A line on the even cluster fails the section, saying it.
    monkeypatch.setattr(latency, "EVEN_SECONDS", 1.0)
    (flags / "shaped").touch()
    with pytest.raises(RuntimeError, match="said on an even cluster"):
        latency.one_job(command, "ours", config, "1gbit", tmp_path / "ours-2.log")

    data = {
        **bench_data(),
        "stragglers": {
            "even_first": 300.0,
            "even": 60.0,
            "target": 120.0,
            "rate": "200kbit",
            "held": latency.HELD_CPUS,
            "seconds": {
                "ours_network": spread(50.0),
                "ours_cpu": spread(30.0),
                "script_network": spread(62.0),
                "script_cpu": spread(70.0),
            },
            "ratio": spread(70.0 / 120),
        },
    }
    found = report.figures(data)
    assert found["straggler_latency"] == pytest.approx(70 / 120)
    assert report.meets("straggler_latency", found["straggler_latency"]) == "meets"
    report.write(data, tmp_path)
    text = (tmp_path / "bench.md").read_text()
    assert "## 19. The straggler watch's latency (2 nodes, in containers)" in text
    assert "even for 300 s in the first rep and 60 s in the others with nothing said" in text
    assert "node2's compute link shaped to 200kbit until node2 is named for it" in text
    assert (
        "- a user's script, the link: 62 (62 to 62, n=1) s; the CPU: 70 (70 to 70, n=1) s" in text
    )
    assert "stragglers" in cli.SECTIONS


def test_the_node_loss_sections_reader_times_the_lines_after_step_12_from_the_kill(
    tmp_path, monkeypatch
):
    """Sections 15 and 18's job (bench.nodeloss.killed_after_step_12) against a stand-in
    launcher: node3 killed once node1's step-12 line came, `then` called after the kill, and
    the lines after step 12's timed from the kill; a job that fails is one error."""
    import sys

    from torch_multinode.sim import nodes as sim

    done: list[str] = []
    monkeypatch.setattr(sim, "docker", lambda *args, **_: done.append(" ".join(args)))
    job = tmp_path / "job.py"
    job.write_text(
        "import sys, time\n"
        "for step in range(1, 16):\n"
        "    print(f'[node1] step {step:3d}/15', flush=True)\n"
        "    time.sleep(0.3 if step >= 12 else 0)\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    config = sim.SimConfig("tmnloss", "172.29.98.0/24", tmp_path / "state", "172.30.98.0/24")
    lines, returned = nodeloss.killed_after_step_12(
        [sys.executable, str(job), "0"], config, lambda: done.append("then")
    )
    assert done == [f"kill {config.container(3)}", "then"], done
    assert [line.split()[2] for _, line in lines] == ["13/15", "14/15", "15/15"], lines
    times = [at for at, _ in lines]
    assert times == sorted(times) and 0.1 < times[0] < 1.0 and times[-1] < 3.0, times
    assert 0 <= returned < 1.0, returned
    with pytest.raises(RuntimeError, match=r"the job failed \(exit 3\)"):
        nodeloss.killed_after_step_12([sys.executable, str(job), "3"], config)
