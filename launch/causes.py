"""Why a node is slow: one look at the usual causes, and the one that holds, in one line.

`script()` is a POSIX shell script of standard files and tools, run on the node (over SSH) while
the job runs: it reads every counter twice, WINDOW seconds apart, so that rates come from the
node's own clock (`@@name` sections, as netcheck's facts). `parse()` turns its output into two
Samples, and `judge()` names the first cause that holds, most specific first:

- CPU: periods throttled by a cgroup's quota (the node's own cgroup, cgroup v1 or v2, and the
  job's container's where it has one), time stolen by the hypervisor, more runnable tasks than
  CPUs (CPU pressure);
- the GPU: clocks held down (NVIDIA's clock event reasons: thermal, power cap, power brake, HW
  slowdown), a PCIe link narrower or older than the card's (launch.gpu_causes: nvidia-smi's
  query, its answer read and judged);
- memory: swapping, memory pressure;
- the network: the compute interface shaped (a `tc` qdisc with a rate), its errors and drops,
  TCP retransmissions;
- the disk: I/O pressure;
- data loading, where the workload says how much of its step waits for its loader.

Otherwise the answer is `unknown`, with the numbers read, so that a person can look further.
Every parser here works on text: the unit tests feed it recorded outputs (a GPU's included).

Who is slow, and saying it, is launch.stragglers'.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from torch_multinode.launch import gpu_causes
from torch_multinode.netcheck import facts

MARK = facts.MARK
WINDOW = 5.0  # seconds between the two readings
# A cgroup's quota is the cause when at least THROTTLED_SHARE of its periods in the window were
# throttled (on a loaded host a held cgroup may not even reach its quota: 21 % at 0.3 CPU, load
# 14 on 2 CPUs), and at least THROTTLED_PERIODS of them (a near-idle cgroup runs in a handful of
# periods, and the probe's own reads can be throttled in one: 1 of 3 read "33 %" in stop 60's CI).
THROTTLED_SHARE = 0.1
THROTTLED_PERIODS = 5
STEAL_SHARE = 0.1  # of the node's CPU time
PRESSURE = 30.0  # percent of time some task waited (PSI's "some avg10"), CPU and memory
IO_PRESSURE = 30.0
RETRANSMIT_SHARE = 0.02  # of TCP segments sent
DATA_WAIT_SHARE = 0.3  # of a step, waiting for the loader
# A cgroup's CPU quota and throttling, read where the reader stands: cgroup v2's files at the root
# of its mount, else v1's cpu controller.
CGROUP = (
    "if [ -f /sys/fs/cgroup/cpu.max ]; then cat /sys/fs/cgroup/cpu.max; echo; "
    "cat /sys/fs/cgroup/cpu.stat; else cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us "
    "/sys/fs/cgroup/cpu/cpu.cfs_period_us; echo; cat /sys/fs/cgroup/cpu/cpu.stat; fi"
)


@dataclass
class Sample:
    """One reading of the node's counters."""

    cpu: list[int] = field(default_factory=list)
    """/proc/stat's first line: user nice system idle iowait irq softirq steal (jiffies)."""
    cpus: int = 0
    load: float | None = None
    quota: dict[str, float | None] = field(default_factory=dict)
    """Cgroup ("node", "container") -> CPUs its quota allows (None: no quota)."""
    periods: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Cgroup -> (periods, periods throttled), cumulative."""
    pressure: dict[str, float] = field(default_factory=dict)
    """cpu, memory, io -> PSI's "some avg10" (percent)."""
    swapped: int = 0
    """Pages swapped in and out, cumulative."""
    net: dict[str, int] = field(default_factory=dict)
    """The compute interface's rx_errors, tx_errors, rx_dropped, tx_dropped."""
    tcp: tuple[int, int] = (0, 0)
    """TCP segments sent, retransmitted (cumulative, /proc/net/snmp)."""
    shaped: str | None = None
    """The compute interface's rate-limiting qdisc, as tc shows it."""
    gpus: list[gpu_causes.Gpu] = field(default_factory=list)


@dataclass(frozen=True)
class Cause:
    kind: str
    """cpu, gpu, memory, network, disk, data, unknown."""
    text: str
    shared: bool = False
    """A symptom the slow node's peers show as much as it does (TCP retransmits: a link that
    drops a node's packets makes every node sending to it resend), where the others are the
    node's own (its interface shaped, its errors)."""


def script(interface: str, container: str | None = None) -> str:
    """The node's script: every counter read twice, WINDOW seconds apart; `container`: the job's
    container, whose own cgroup is read too."""
    q = shlex.quote
    net = f"/sys/class/net/{q(interface)}/statistics"
    lines = [
        "export LC_ALL=C",
        "s() { printf '\\n%s%s\\n' '" + MARK + '\' "$1"; }',
        "read_all() {",
        "  s stat; head -1 /proc/stat",
        "  s cpus; nproc",
        "  s loadavg; cat /proc/loadavg",
        f"  s 'cgroup node'; sh -c {q(CGROUP)} 2>/dev/null",
    ]
    if container:
        lines.append(
            f"  s 'cgroup container'; docker exec {q(container)} sh -c {q(CGROUP)} 2>/dev/null"
        )
    lines += [
        '  for p in cpu memory io; do s "pressure $p"; cat /proc/pressure/$p 2>/dev/null; done',
        "  s vmstat; grep -E '^pswp(in|out) ' /proc/vmstat",
        f"  s net; for c in rx_errors tx_errors rx_dropped tx_dropped; do "
        f'printf "%s " "$c"; cat {net}/$c 2>/dev/null || echo; done',
        "  s snmp; grep '^Tcp:' /proc/net/snmp",
        f"  s qdisc; tc qdisc show dev {q(interface)} 2>/dev/null",
        f"  s gpu; nvidia-smi --query-gpu={gpu_causes.GPU_QUERY} "
        "--format=csv,noheader,nounits 2>/dev/null",
        "}",
        "s first; read_all",
        f"sleep {WINDOW:g}",
        "s second; read_all",
        "exit 0",
    ]
    return "\n".join(lines) + "\n"


def parse(text: str) -> tuple[Sample, Sample]:
    """The script's output: the first and the second reading (netcheck's sections, one set
    each side of the `second` mark)."""
    halves = re.split(rf"^{MARK}second$", text, maxsplit=1, flags=re.MULTILINE)
    samples = (Sample(), Sample())
    for sample, half in zip(samples, [*halves, ""][:2], strict=True):
        for name, body in facts.sections(half).items():
            _read(sample, name, body)
    return samples


def _read(sample: Sample, name: str, body: str) -> None:
    kind, _, arg = name.partition(" ")
    if kind == "stat":
        sample.cpu = [int(n) for n in body.split()[1:9] if n.isdigit()]
    elif kind == "cpus" and body.strip().isdigit():
        sample.cpus = int(body)
    elif kind == "loadavg" and body:
        sample.load = gpu_causes.number(body.split()[0])
    elif kind == "cgroup" and body:
        quota, periods = parse_cgroup(body)
        sample.quota[arg], sample.periods[arg] = quota, periods
    elif kind == "pressure":
        found = re.search(r"^some avg10=([\d.]+)", body, re.MULTILINE)
        if found:
            sample.pressure[arg] = float(found.group(1))
    elif kind == "vmstat":
        sample.swapped = sum(int(n) for n in re.findall(r"^pswp(?:in|out) (\d+)", body, re.M))
    elif kind == "net":
        for line in body.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                sample.net[parts[0]] = int(parts[1])
    elif kind == "snmp":
        sample.tcp = parse_snmp(body)
    elif kind == "qdisc":
        sample.shaped = parse_qdisc(body)
    elif kind == "gpu":
        sample.gpus = gpu_causes.parse_gpus(body)


def parse_cgroup(text: str) -> tuple[float | None, tuple[int, int]]:
    """A cgroup's CPU quota in CPUs (None: none) and its (periods, throttled) counters, from
    cgroup v2's cpu.max and cpu.stat or v1's cfs_quota_us, cfs_period_us and cpu.stat."""
    lines = text.splitlines()
    quota: float | None = None
    first = lines[0].split() if lines else []
    if len(first) == 2 and first[0] != "max" and first[1].isdigit():  # v2: "30000 100000"
        quota = int(first[0]) / int(first[1])
    elif len(lines) >= 2 and re.fullmatch(r"-?\d+", lines[0].strip() or "x"):  # v1
        value, period = int(lines[0]), lines[1].strip()
        if value > 0 and period.isdigit() and int(period):
            quota = value / int(period)
    stat = dict(
        (parts[0], int(parts[1]))
        for parts in (line.split() for line in lines)
        if len(parts) == 2 and parts[1].isdigit()
    )
    return quota, (stat.get("nr_periods", 0), stat.get("nr_throttled", 0))


def parse_snmp(text: str) -> tuple[int, int]:
    """/proc/net/snmp's Tcp lines: (OutSegs, RetransSegs)."""
    rows = [line.split()[1:] for line in text.splitlines() if line.startswith("Tcp:")]
    if len(rows) < 2:
        return (0, 0)
    values = dict(zip(rows[0], rows[1], strict=False))
    return (int(values.get("OutSegs", 0)), int(values.get("RetransSegs", 0)))


_RATE = re.compile(r"\brate (\d+(?:\.\d+)?[KMGT]?bit)\b")


def parse_qdisc(text: str) -> str | None:
    """A qdisc that limits the interface's rate (tbf, htb, netem with a rate), as "tbf at
    100Mbit"; None where none does."""
    for line in text.splitlines():
        found = _RATE.search(line)
        if found:
            kind = line.split()[1] if len(line.split()) > 1 else "qdisc"
            return f"{kind} at {found.group(1)}"
    return None


def judge(
    first: Sample, second: Sample, interface: str = "", data_wait: float | None = None
) -> Cause:
    """The first cause that holds between the two readings, most specific first; `data_wait`:
    the share of the node's step its ranks waited for their loader, where the workload says."""
    for check in (_quota, _gpu, _steal, _memory, _network, _disk, _cpu_pressure, _retransmits):
        cause = check(first, second, interface)
        if cause is not None:
            return cause
    if data_wait is not None and data_wait >= DATA_WAIT_SHARE:
        return Cause("data", f"data loading: {data_wait:.0%} of its step waits for the loader")
    return Cause("unknown", f"unknown ({numbers(first, second)})")


def _quota(first: Sample, second: Sample, _interface: str) -> Cause | None:
    for group in ("container", "node"):
        if group not in first.periods or group not in second.periods:
            continue
        periods = second.periods[group][0] - first.periods[group][0]
        throttled = second.periods[group][1] - first.periods[group][1]
        if throttled >= THROTTLED_PERIODS and throttled / periods >= THROTTLED_SHARE:
            quota = second.quota.get(group)
            allowed = f"{quota:.2g} CPU" if quota is not None else "its quota"
            whose = "the job's container's" if group == "container" else "its"
            return Cause(
                "cpu",
                f"CPU throttled by {whose} cgroup quota ({allowed}, {throttled / periods:.0%} "
                "of periods throttled)",
            )
    return None


def _steal(first: Sample, second: Sample, _interface: str) -> Cause | None:
    share = _cpu_share(first, second, 7)
    if share is not None and share >= STEAL_SHARE:
        return Cause(
            "cpu", f"CPU stolen by the hypervisor ({share:.0%} of the node's CPU time: steal)"
        )
    return None


def _cpu_pressure(first: Sample, second: Sample, _interface: str) -> Cause | None:
    pressure = second.pressure.get("cpu")
    if pressure is not None and pressure >= PRESSURE:
        load = f"load {second.load:g} on {second.cpus} CPUs, " if second.load is not None else ""
        return Cause(
            "cpu", f"CPU contention ({load}tasks waited for a CPU {pressure:.0f} % of the time)"
        )
    return None


def _gpu(_first: Sample, second: Sample, _interface: str) -> Cause | None:
    text = gpu_causes.held(second.gpus)
    return Cause("gpu", text) if text is not None else None


def _memory(first: Sample, second: Sample, _interface: str) -> Cause | None:
    swapped = (second.swapped - first.swapped) / WINDOW
    if swapped >= 1:
        return Cause("memory", f"memory: swapping ({swapped:.0f} pages a second)")
    pressure = second.pressure.get("memory")
    if pressure is not None and pressure >= PRESSURE:
        return Cause("memory", f"memory pressure (tasks stalled {pressure:.0f} % of the time)")
    return None


def _network(first: Sample, second: Sample, interface: str) -> Cause | None:
    if second.shaped:
        return Cause("network", f"network: {interface} is shaped ({second.shaped}, tc)")
    errors = {name: second.net[name] - first.net.get(name, second.net[name]) for name in second.net}
    bad = {name: count for name, count in errors.items() if count > 0}
    if bad:
        shown = ", ".join(f"{count} {name.replace('_', ' ')}" for name, count in bad.items())
        return Cause("network", f"network: {interface} {shown} in {WINDOW:g} s")
    return None


def _retransmits(first: Sample, second: Sample, _interface: str) -> Cause | None:
    """After CPU contention: a node starved of CPU answers late, and its peers' TCP resends
    segments that were never lost (CI saw 2.1 % on a simulated node of a loaded machine)."""
    sent = second.tcp[0] - first.tcp[0]
    again = second.tcp[1] - first.tcp[1]
    if sent > 0 and again / sent >= RETRANSMIT_SHARE:
        text = f"network: TCP retransmits {again / sent:.1%} of its segments"
        return Cause("network", text, shared=True)
    return None


def _disk(_first: Sample, second: Sample, _interface: str) -> Cause | None:
    pressure = second.pressure.get("io")
    if pressure is not None and pressure >= IO_PRESSURE:
        return Cause("disk", f"disk: tasks waited for I/O {pressure:.0f} % of the time")
    return None


def _cpu_share(first: Sample, second: Sample, column: int) -> float | None:
    if len(first.cpu) <= column or len(second.cpu) <= column:
        return None
    total = sum(second.cpu) - sum(first.cpu)
    return (second.cpu[column] - first.cpu[column]) / total if total > 0 else None


def numbers(first: Sample, second: Sample) -> str:
    """What was read, for an unknown cause."""
    idle = _cpu_share(first, second, 3)
    steal = _cpu_share(first, second, 7)
    shown = []
    if idle is not None:
        shown.append(f"CPU {1 - idle:.0%} busy")
    if steal is not None:
        shown.append(f"steal {steal:.0%}")
    if second.load is not None:
        shown.append(f"load {second.load:g} on {second.cpus} CPUs")
    for group, quota in second.quota.items():
        shown.append(f"{group} quota {quota:.2g} CPU" if quota is not None else f"no {group} quota")
    shown += [f"{name} pressure {value:g} %" for name, value in second.pressure.items()]
    shown.append(f"{(second.swapped - first.swapped) / WINDOW:.0f} pages swapped a second")
    return ", ".join(shown)
