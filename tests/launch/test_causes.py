"""Issue 55, the why: a slow node's cause named in one line, from the node's own counters read
twice (launch/causes.py; the GPU's part, launch/gpu_causes.py). The parsers and the judgement
on recorded outputs (cgroup v1 and v2, PSI, /proc/net/snmp, tc, nvidia-smi); then the node's
script for real in a simulated node's container, its CPU held to 0.3 of a core by Docker while
it spins, and its link shaped by tc."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from torch_multinode.launch import causes, gpu_causes, stragglers

# A 5 s window over which a cgroup v1 container limited to 0.3 CPU spun (docker run --cpus 0.3).
V1_BEFORE = "30000\n100000\n\nnr_periods 8\nnr_throttled 4\nthrottled_time 2080511558\n"
V1_AFTER = "30000\n100000\n\nnr_periods 59\nnr_throttled 55\nthrottled_time 9080511558\n"
V2_UNLIMITED = "max 100000\n\nusage_usec 1000\nnr_periods 0\nnr_throttled 0\nthrottled_usec 0\n"
V2_HALF = "50000 100000\n\nusage_usec 1000\nnr_periods 10\nnr_throttled 1\nthrottled_usec 10\n"
SNMP = (
    "Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets "
    "CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors\n"
    "Tcp: 1 200 120000 -1 10 5 0 0 2 {insegs} {out} {again} 0 0 0\n"
)
# nvidia-smi --query-gpu=gpu_causes.GPU_QUERY --format=csv,noheader,nounits on two GPUs: GPU 1
# held down by a hardware thermal slowdown (0x40) at 91 C, GPU 0 idle (0x1) and well; then a GPU
# on a riser that narrows its link to x4.
GPUS_HOT = (
    "0, 0x0000000000000001, 45, 61.20, 300.00, 1980, 1980, 4, 4, 16, 16\n"
    "1, 0x0000000000000040, 91, 250.10, 300.00, 1095, 1980, 4, 4, 16, 16\n"
)
GPU_NARROW = "0, 0x0000000000000000, 60, 280.00, 300.00, 1980, 1980, 4, 4, 4, 16\n"


def sample(**sections: str) -> str:
    return "".join(f"@@{name.replace('_', ' ')}\n{body}\n" for name, body in sections.items())


def readings(before: dict[str, str], after: dict[str, str]) -> tuple:
    text = "@@first\n" + sample(**before) + "@@second\n" + sample(**after)
    return causes.parse(text)


IDLE_STAT = "cpu  1000 0 1000 8000 0 0 0 0 0 0"
IDLE_STAT_LATER = "cpu  1100 0 1100 8800 0 0 0 0 0 0"


def test_cgroup_v1_and_v2_quotas_and_throttling():
    assert causes.parse_cgroup(V1_AFTER) == (0.3, (59, 55))
    assert causes.parse_cgroup("-1\n100000\n\nnr_periods 0\nnr_throttled 0\n") == (None, (0, 0))
    assert causes.parse_cgroup(V2_UNLIMITED) == (None, (0, 0))
    assert causes.parse_cgroup(V2_HALF) == (0.5, (10, 1))


def test_a_throttled_cgroup_is_named_with_its_quota_and_share():
    first, second = readings(
        {"stat": IDLE_STAT, "cgroup_node": V1_BEFORE},
        {"stat": IDLE_STAT_LATER, "cgroup_node": V1_AFTER},
    )
    cause = causes.judge(first, second, "eth1")
    assert cause == causes.Cause(
        "cpu", "CPU throttled by its cgroup quota (0.3 CPU, 100% of periods throttled)"
    )
    # The job's container's own quota is named as such.
    first, second = readings(
        {"cgroup_container": V1_BEFORE, "cgroup_node": V2_UNLIMITED},
        {"cgroup_container": V1_AFTER, "cgroup_node": V2_UNLIMITED},
    )
    assert causes.judge(first, second).text.startswith(
        "CPU throttled by the job's container's cgroup quota (0.3 CPU"
    )
    # A near-idle node: the probe's own reads ran in 3 periods, one throttled (stop 60's CI).
    idle = "30000\n100000\n\nnr_periods {}\nnr_throttled {}\n"
    first, second = readings(
        {"stat": IDLE_STAT, "cgroup_node": idle.format(60, 56)},
        {"stat": IDLE_STAT_LATER, "cgroup_node": idle.format(63, 57)},
    )
    assert causes.judge(first, second, "eth1").kind == "unknown"


def test_steal_contention_memory_network_disk_and_data_each_named():
    steal = readings(
        {"stat": "cpu  1000 0 1000 8000 0 0 0 0"}, {"stat": "cpu  1400 0 1400 8800 0 0 0 400"}
    )
    assert causes.judge(*steal).text == (
        "CPU stolen by the hypervisor (20% of the node's CPU time: steal)"
    )
    busy = readings(
        {"pressure_cpu": "some avg10=10.00 avg60=1 avg300=1 total=1"},
        {
            "loadavg": "9.50 4.00 2.00 9/300 1234",
            "cpus": "2",
            "pressure_cpu": "some avg10=62.50 avg60=30.00 avg300=10.00 total=99",
        },
    )
    assert causes.judge(*busy).text == (
        "CPU contention (load 9.5 on 2 CPUs, tasks waited for a CPU 62 % of the time)"
    )
    swapping = readings(
        {"vmstat": "pswpin 100\npswpout 100"}, {"vmstat": "pswpin 2100\npswpout 3100"}
    )
    assert causes.judge(*swapping).text == "memory: swapping (1000 pages a second)"
    shaped = readings(
        {}, {"qdisc": "qdisc tbf 8001: root refcnt 2 rate 100Mbit burst 4Kb lat 400ms"}
    )
    assert causes.judge(*shaped, "eth1").text == "network: eth1 is shaped (tbf at 100Mbit, tc)"
    errors = readings(
        {"net": "rx_errors 3\ntx_errors 0\nrx_dropped 0\ntx_dropped 0"},
        {"net": "rx_errors 40\ntx_errors 0\nrx_dropped 0\ntx_dropped 0"},
    )
    assert causes.judge(*errors, "eth1").text == "network: eth1 37 rx errors in 5 s"
    retransmits = readings(
        {"snmp": SNMP.format(insegs=10, out=1000, again=10)},
        {"snmp": SNMP.format(insegs=10, out=11000, again=510)},
    )
    assert causes.judge(*retransmits).text == "network: TCP retransmits 5.0% of its segments"
    # A node starved of CPU is named for that, not for the resends its slowness causes (CI: a
    # loaded simulated node said 2.1 % retransmits).
    starved = readings(
        {"snmp": SNMP.format(insegs=10, out=1000, again=10)},
        {
            "snmp": SNMP.format(insegs=10, out=11000, again=510),
            "loadavg": "9.50 4.00 2.00 9/300 1234",
            "cpus": "2",
            "pressure_cpu": "some avg10=62.50 avg60=30.00 avg300=10.00 total=99",
        },
    )
    assert causes.judge(*starved).text.startswith("CPU contention (load 9.5 on 2 CPUs")
    disk = readings({}, {"pressure_io": "some avg10=45.10 avg60=1 avg300=1 total=1"})
    assert causes.judge(*disk).text == "disk: tasks waited for I/O 45 % of the time"
    nothing = readings({"stat": IDLE_STAT}, {"stat": IDLE_STAT_LATER})
    assert causes.judge(*nothing, data_wait=0.62).text == (
        "data loading: 62% of its step waits for the loader"
    )


def test_nothing_found_is_unknown_with_the_numbers():
    first, second = readings(
        {"stat": IDLE_STAT, "cgroup_node": V2_UNLIMITED},
        {
            "stat": IDLE_STAT_LATER,
            "loadavg": "0.50 0.40 0.30 1/100 5",
            "cpus": "8",
            "cgroup_node": V2_UNLIMITED,
            "pressure_cpu": "some avg10=1.00 avg60=1 avg300=1 total=1",
        },
    )
    cause = causes.judge(first, second)
    assert cause.kind == "unknown"
    assert cause.text == (
        "unknown (CPU 20% busy, steal 0%, load 0.5 on 8 CPUs, no node quota, cpu pressure 1 %, "
        "0 pages swapped a second)"
    )


def test_a_gpu_held_down_or_on_a_narrow_link_is_named_from_nvidia_smi():
    (gpu0, gpu1) = gpu_causes.parse_gpus(GPUS_HOT)
    assert (gpu1.index, gpu1.reasons, gpu1.temperature, gpu1.sm_clock) == (1, 0x40, 91.0, 1095.0)
    assert gpu0.reasons == 0x1 and gpu0.pcie_width_max == 16
    hot = readings({}, {"gpu": GPUS_HOT})
    assert causes.judge(*hot) == causes.Cause(
        "gpu",
        "GPU 1 held down: hardware thermal slowdown (SM clock 1095 of 1980 MHz, 91 C, 250.1 of "
        "300 W)",
    )
    narrow = readings({}, {"gpu": GPU_NARROW})
    assert causes.judge(*narrow).text == (
        "GPU 0's PCIe link runs x4 of x16 (a slot or riser that narrows it)"
    )
    # A power cap with the clock near its maximum says nothing; an unknown field's error neither.
    capped = "0, 0x0000000000000004, 70, 299.00, 300.00, 1900, 1980, 4, 4, 16, 16\n"
    assert causes.judge(*readings({}, {"gpu": capped})).kind == "unknown"
    # An idle GPU's link drops its width and generation (nvidia-smi: "may be reduced when the
    # GPU is not in use"): that says nothing of its slot, nor does a GPU at an idle clock.
    idle = "0, 0x0000000000000001, 35, 60.00, 300.00, 345, 1980, 1, 4, 4, 16\n"
    assert causes.judge(*readings({}, {"gpu": idle})).kind == "unknown"
    slow_clock = "0, 0x0000000000000000, 35, 60.00, 300.00, 345, 1980, 1, 4, 16, 16\n"
    assert causes.judge(*readings({}, {"gpu": slow_clock})).kind == "unknown"
    refused = 'Field "clocks_event_reasons.active" is not a valid field to query.\n'
    assert gpu_causes.parse_gpus(refused) == []


def test_the_script_reads_every_counter_twice():
    text = causes.script("eth1", container="tmn-job-node2")
    assert text.count("read_all") == 3 and f"sleep {causes.WINDOW:g}" in text
    assert "docker exec tmn-job-node2 sh -c" in text
    assert "tc qdisc show dev eth1" in text and "/sys/class/net/eth1/statistics" in text
    assert f"--query-gpu={gpu_causes.GPU_QUERY}" in text


@pytest.fixture
def node():
    """A simulated node's container of this run, its CPU held to a twentieth of a core: a quota
    that binds even on a loaded host (at 0.3 CPU, CI's 2 cores at load 5 gave the spinner less
    than its quota, so it was never throttled and contention was the true answer)."""
    from torch_multinode.sim.node_image import NODE_IMAGE, build_images

    build_images()  # cached after the first time
    name = f"tmncauses-{os.getpid()}"
    subprocess.run(
        ["docker", "run", "-d", "--name", name, "--cpus", "0.05", "--cap-add", "NET_ADMIN"]
        + ["--entrypoint", "sleep", NODE_IMAGE, "300"],
        check=True,
        capture_output=True,
    )
    try:
        yield name
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)


def _probe(container: str) -> str:
    done = subprocess.run(
        ["docker", "exec", container, "sh", "-c", causes.script("eth0")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def _look(container: str) -> causes.Cause:
    return causes.judge(*causes.parse(_probe(container)), "eth0")


@pytest.mark.sim
def test_on_a_node_a_cpu_quota_and_a_shaped_link_are_named(node):
    spin = subprocess.Popen(["docker", "exec", node, "sh", "-c", "while :; do :; done"])
    try:
        cpu = _look(node)
    finally:
        spin.kill()
        subprocess.run(["docker", "restart", "-t", "0", node], capture_output=True, check=True)
    assert cpu.kind == "cpu", cpu
    assert cpu.text.startswith("CPU throttled by its cgroup quota (0.05 CPU, "), cpu
    # The probe's own reads must not be throttled while the link is looked at.
    subprocess.run(["docker", "update", "--cpus", "2", node], capture_output=True, check=True)
    shape = "tc qdisc add dev eth0 root tbf rate 100mbit burst 32kbit latency 400ms"
    subprocess.run(["docker", "exec", node, "sh", "-c", shape], check=True)
    # The link's own check: judge's order puts the host's steal first, and a loaded VM's steal
    # holds on this node too (CI run 54: 11 % of the node's CPU time, named before the link).
    samples = causes.parse(_probe(node))
    shaped = causes.Cause("network", "network: eth0 is shaped (tbf at 100Mbit, tc)")
    assert causes._network(*samples, "eth0") == shaped


SLOW_WARNING = (
    "warning: rank 1 on {node} is slow: 0.503 s of its own work per step (median of steps 5-8), "
    "the other ranks' median 0.003 s; every rank waits for it"
)
# What causes.script printed on a node whose cgroup held it to 0.3 CPU (recorded in the
# simulated node's container, below, then trimmed to the sections judged).
THROTTLED_NODE = (
    f"@@first\n@@stat\n{IDLE_STAT}\n@@cgroup node\n{V1_BEFORE}\n"
    f"@@second\n@@stat\n{IDLE_STAT_LATER}\n@@cgroup node\n{V1_AFTER}\n"
)
THROTTLED_LINE = (
    "n2 is the straggler: rank 1's own work takes 503 ms a step, the others' 3 ms, and every "
    "rank waits for it; cause: CPU throttled by its cgroup quota (0.3 CPU, 100% of periods "
    "throttled)"
)


def test_a_slow_ranks_node_is_probed_and_named_once_per_change():
    said: list[str] = []
    answers = {"n2": THROTTLED_NODE}
    probed: list[str] = []

    def probe(node: str) -> str:
        probed.append(node)
        if node not in answers:
            raise RuntimeError(f"host '{node}': cannot SSH to it: timed out")
        return answers[node]

    watcher = stragglers.Stragglers(probe, lambda node: "eth1", said.append)
    watcher.note("[n1] step 8/100 loss 2.1")  # not a warning: nothing probed
    watcher.note("[n1] [rank 0] " + SLOW_WARNING.format(node="n2"))
    watcher.join(10)
    assert said == [f"[launcher] {THROTTLED_LINE}"]
    # The same node and cause again: probed, not said again.
    watcher.note(SLOW_WARNING.format(node="n2"))
    watcher.join(10)
    assert probed == ["n2", "n2"] and len(said) == 1
    # Another cause on that node is said; a node that cannot be probed is said as such.
    answers["n2"] = "@@first\n@@second\n@@qdisc\nqdisc tbf 1: root rate 100Mbit burst 4Kb\n"
    watcher.note(SLOW_WARNING.format(node="n2"))
    watcher.join(10)
    watcher.note(SLOW_WARNING.format(node="n3"))
    watcher.join(10)
    assert [line.split("cause: ")[1] for line in said[1:]] == [
        "network: eth1 is shaped (tbf at 100Mbit, tc)",
        "unknown (not probed: host 'n3': cannot SSH to it: timed out)",
    ]
    assert watcher.said == [line.removeprefix("[launcher] ") for line in said]


def test_the_launcher_names_the_straggler_its_job_reports_and_keeps_it():
    """The real launcher on fake nodes (no traffic): rank 0's warning names n2; the launcher
    probes n2 over a session of its own (the script's output recorded above), says the line,
    and the summary and the result (what the run's record keeps) hold it."""
    from tests.fakes import FakeNodes
    from tests.helpers import inventory_text, node
    from torch_multinode.cluster.inventory_read import parse as parse_inventory
    from torch_multinode.launch.backends import SshBackend
    from torch_multinode.launch.restarts import run_with_restarts
    from torch_multinode.launch.spec import JobSpec
    from torch_multinode.launch.staging import Project

    hosts = {"n1": node(1, compute_ip="10.7.0.9"), "n2": node(2, compute_ip="10.7.0.10")}
    inventory = parse_inventory(
        inventory_text(hosts, launch_mode="host", training_python="/opt/venv/bin/python"),
        "/nonexistent/inv.yml",
    )
    said: list[str] = []

    def job_on(host, command, out) -> int:
        if host.name == "n1":
            out.write(f"[rank 0] {SLOW_WARNING.format(node='n2')}\n")
            # The job goes on while the launcher looks (at most a few seconds here).
            for _ in range(100):
                if any("is the straggler" in line for line in said):
                    break
                time.sleep(0.1)
        return 0

    def answer(host, command):
        return THROTTLED_NODE if "read_all" in command and host.name == "n2" else ""

    nodes = FakeNodes(list(inventory.hosts), responder=answer, streamer=job_on)
    spec = JobSpec(run_id="tmn-slow")
    project = Project(trees=(), workdir="/w", script=None)
    backend = SshBackend(inventory, spec, said.append, project, restart_wait=5, nodes=nodes)
    result = run_with_restarts(backend, spec, 0, said.append)
    assert result.exit_code == 0, said
    assert f"[launcher] {THROTTLED_LINE}" in said, said
    assert result.stragglers == (THROTTLED_LINE,)
    assert f"Straggler: {THROTTLED_LINE}" in backend.summary(result)
    probes = [command for name, command in nodes.commands if "read_all" in command]
    assert len(probes) == 1 and "tc qdisc show dev eth1" in probes[0]


def test_the_run_record_keeps_every_straggler_named(tmp_path, monkeypatch):
    from torch_multinode.launch import record
    from torch_multinode.launch.spec import JobResult, JobSpec

    monkeypatch.chdir(tmp_path)  # the record goes to .runs/ here
    spec = JobSpec(run_id="tmn-slow", log_dir=tmp_path / "tmn-slow")
    result = JobResult("tmn-slow", {}, None, False, 12.0, stragglers=(THROTTLED_LINE,))
    kept = record.finish({"started": "2026-11-30T00:00:00+00:00"}, spec, result, 0)
    assert kept["stragglers"] == [THROTTLED_LINE]
    assert (
        record.finish({"started": "2026-11-30T00:00:00+00:00"}, spec, None, 2)["stragglers"] == []
    )
