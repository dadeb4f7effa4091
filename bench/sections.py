"""The benchmark report's sections for the figures measured apart from the core run: each
section's Markdown lines (bench.report puts them in order)."""

from __future__ import annotations

from torch_multinode.bench.flight import DDP_TIMING, noise, verdict
from torch_multinode.cluster.sync import human


def spread(item: dict, fmt: str = "{:.3f}") -> str:
    return (
        f"{fmt.format(item['median'])} ({fmt.format(item['min'])} to "
        f"{fmt.format(item['max'])}, n={item['n']})"
    )


def nodeloss_lines(found: dict, replication: dict | None = None) -> list[str]:
    """Section 15: a node lost for good, and the job on its new world; what the replicas of
    training.fsdp's checkpoints cost."""
    became = sorted(set(found["became"]))
    extra = []
    if replication:
        extra = [
            "",
            f"training.fsdp on {replication['nodes']} nodes, checkpoints on node-local disks "
            f"(`{replication['job']}`), with replicas and with `--no-replicate`, side by side in "
            "each rep: timed from the first checkpoint's step line to the last step's.",
            f"- with replicas: {spread(replication['with_seconds'], '{:.1f}')} s; without: "
            f"{spread(replication['without_seconds'], '{:.1f}')} s",
            f"- added per checkpoint: {spread(replication['extra_per_checkpoint'], '{:+.2f}')} s",
            f"- step time at one checkpoint every {replication['period']:g} s, replicas on / off: "
            f"{spread(replication['ratio'], '{:.3f}')} (budget {replication['budget']:g})",
        ]
    return [
        "",
        f"## 15. A node lost for good ({found['nodes']} nodes of {found['cluster_nodes']}, "
        "in containers)",
        "",
        f"RESTARTS=1 MIN_NODES={found['nodes'] - 1}, --restart-wait {found['grace']:g} s; node3 "
        "killed after step 12 and left dead. Timed from the kill to the first step line of the "
        f"restarted run; budget {found['budget']:g} s.",
        *(
            [
                "- death to the job stopped on every node (the failed run's summary): "
                f"{spread(found['stopped'], '{:.1f}')} s"
            ]
            if found.get("stopped")
            else []
        ),
        f"- death to the first step on the new world: {spread(found['seconds'], '{:.1f}')} s",
        f"- that / budget: {spread(found['ratio'], '{:.2f}')}",
        f"- what became of node3: {'; '.join(became)}",
        *extra,
    ]


def dependencies_lines(found: dict) -> list[str]:
    """Section 16: a project's dependency layer, once built and shipped, against no layer."""
    return [
        "",
        "## 16. A project's dependencies (2 nodes, jobs in containers)",
        "",
        f"The same project with a requirements.txt ({', '.join(found['requirements'])}, which "
        "the training image lacks) and without one; `make train` to the first step, side by "
        "side. The first run with it built its layer and shipped it "
        f"({found['first_seconds']:.1f} s); every later one said it built and shipped nothing.",
        f"- with the dependencies, a later run: {spread(found['with_seconds'], '{:.1f}')} s",
        f"- without: {spread(found['without_seconds'], '{:.1f}')} s",
        f"- ratio: {spread(found['ratio'], '{:.2f}')}",
    ]


def lock_lines(found: dict) -> list[str]:
    """Section 14: what checking the version lock adds to make train."""
    return [
        "",
        f"## 14. The version lock's check ({found['nodes']} nodes, launch_mode: "
        f"{found['launch_mode']})",
        "",
        "Read the lock, run its probe on every node at once over open sessions, compare: what "
        f"`make train` adds before a job starts; budget {found['budget']:g} s"
        + (f" (measured {found['date']})." if found.get("date") else "."),
        f"- the check: {spread(found['check_seconds'], '{:.2f}')} s",
        f"- a bare round trip on the same sessions, beside it: "
        f"{spread(found['bare_seconds'], '{:.2f}')} s",
        f"- check / budget: {spread(found['ratio'], '{:.2f}')}",
    ]


def noisy_lines(section: dict, thing: str = "the recorder") -> list[str]:
    """The line saying a section's paired step ratio is too noisy to judge, and why; none when
    it can be judged (flight.noise)."""
    why = noise(section, thing)
    return (
        [f"- too noisy to judge: {why}; an idle machine, more --reps or longer runs"] if why else []
    )


def timing(flight: dict) -> str:
    """How section 13's step was timed (reports before the GPU step said nothing: training.ddp)."""
    text = flight.get("timing", DDP_TIMING)
    return text[0].upper() + text[1:]


def flight_lines(flight: dict) -> list[str]:
    """Section 13: the Flight Recorder's cost on step time, and per collective at worst."""
    ratio = flight["step_ratio"]
    cost = flight["collective_cost_us"]
    noisy = noisy_lines(flight)
    return [
        "",
        "## 13. The Flight Recorder's cost (this machine, no cluster)",
        "",
        f"`torchrun --standalone --nproc-per-node={flight.get('nproc', 2)} "
        f"{' '.join(flight['workload'])}` with "
        f"TORCH_FR_BUFFER_SIZE={flight['buffer']} (on, the trace's watcher running, as every job "
        "of the launcher) and =0 (off), the order alternating from one repetition to the next; "
        f"{flight['machine']}; load average {flight['load_before']:.1f} before, "
        f"{flight['load_after']:.1f} after. {timing(flight)}.",
        f"- on: {spread(flight['step_seconds_on'], '{:.4f}')} s per step",
        f"- off: {spread(flight['step_seconds_off'], '{:.4f}')} s per step",
        f"- on / off: {spread(ratio)}; {verdict(ratio['median'], flight['target'])}",
        "- the same for each run's fastest interval (the least disturbed by other load): "
        f"{spread(flight['fastest_step_ratio'])}",
        *noisy,
        "",
        f"Worst case: {flight['collectives']:,} all_reduces of 1 element back to back, "
        f"{flight['rounds']} rounds per run, the fastest round counted:",
        f"- on: {spread(flight['collective_us_on'], '{:.1f}')} us per collective",
        f"- off: {spread(flight['collective_us_off'], '{:.1f}')} us per collective",
        f"- on / off: {spread(flight['collective_ratio'])}; on - off: "
        f"{spread(cost, '{:+.1f}')} us per collective",
    ]


def detector_lines(found: dict) -> list[str]:
    """Section 17: the straggler detector's cost on step time."""
    ratio = found["step_ratio"]
    noisy = noisy_lines(found, "the detector")
    return [
        "",
        "## 17. The straggler detector's cost (this machine, no cluster)",
        "",
        f"`torchrun --standalone --nproc-per-node={found['nproc']} {' '.join(found['workload'])}` "
        f"with `--slow-rank-factor {found['settings']['on']}` (on, the default: each rank times "
        "its own work, and the ranks gather it every --log-every steps) and "
        f"`{found['settings']['off']}` (off: nothing timed or gathered), the Flight Recorder on in "
        f"both, the order alternating from one repetition to the next; {found['machine']}; load "
        f"average {found['load_before']:.1f} before, {found['load_after']:.1f} after. "
        f"{timing(found)}.",
        f"- on: {spread(found['step_seconds_on'], '{:.4f}')} s per step",
        f"- off: {spread(found['step_seconds_off'], '{:.4f}')} s per step",
        f"- on / off: {spread(ratio)}; {verdict(ratio['median'], found['target'])}",
        "- the same for each run's fastest interval (the least disturbed by other load): "
        f"{spread(found['fastest_step_ratio'])}",
        *noisy,
        "",
        f"Its own work alone, in the same ranks ({found['log_every']} steps between gathers): "
        f"{spread(found['own_time_us'], '{:.1f}')} us a step timing it, "
        f"{spread(found['gather_us'], '{:.0f}')} us a gather; per step "
        f"{spread(found['work_us_per_step'], '{:.1f}')} us",
        f"- (the step off + that work) / the step off: {spread(found['work_ratio'], '{:.4f}')}; "
        f"{verdict(found['work_ratio']['median'], found['target'])}",
        *waits_lines(found.get("waits")),
        *total_lines(found),
        "- not here: the latency from a slowdown to the launcher's line (section 19, on the "
        "bench's cluster)",
    ]


def total_lines(found: dict) -> list[str]:
    """Section 17's sum for our workload: its own work and its measure of waits, per step."""
    total = found.get("total_work_ratio")
    if total is None:
        return []
    return [
        "",
        "Our workload's whole detector (its own work, and the measure of its waits it starts with "
        f"it: {found['waits_us_per_step']:.1f} us a step, the asynchronous cost above times the "
        f"step's collectives), over the step off: {spread(total, '{:.4f}')}; "
        f"{verdict(total['median'], found['target'])}",
    ]


def waits_lines(waits: dict | None) -> list[str]:
    """Section 17's second part: the measure of waits a user's script gets, on and off."""
    if not waits:
        return []
    target = waits["target"]
    ratio = waits["step_ratio"]
    noisy = noisy_lines(waits, "the measure")
    timing = " and NCCL's timing of each collective" if waits["nccl_timing"] else ""

    def kind(name: str, how: str) -> str:
        cost = waits[f"{name}_cost_us"]
        below = ": below what this machine resolves" if cost["median"] <= 0 else ""
        return (
            f"  - {how}: on {spread(waits[f'{name}_us_on'], '{:.1f}')} us, off "
            f"{spread(waits[f'{name}_us_off'], '{:.1f}')} us; on - off "
            f"{spread(cost, '{:+.1f}')} us per collective{below}"
        )

    return [
        "",
        "What a user's own script gets instead (the launcher's sitecustomize starts the measure "
        f"of its waits in collectives{timing}): `{' '.join(waits['workload'])}` run as a user's "
        "script is (the sitecustomize's directory last on PYTHONPATH) and without it, "
        "training.ddp's own detector off in both:",
        f"- on: {spread(waits['step_seconds_on'], '{:.4f}')} s per step",
        f"- off: {spread(waits['step_seconds_off'], '{:.4f}')} s per step",
        f"- on / off: {spread(ratio)}; {verdict(ratio['median'], target)}",
        *noisy,
        f"- worst case, {waits['collectives']:,} all_reduces of 1 element back to back in a plain "
        f"script of one rank ({waits['rounds']} rounds a run, the fastest counted):",
        kind("blocking", "blocking (`dist.all_reduce(t)`, waited for in the hook)"),
        kind("async", "asynchronous (`async_op=True`, as DDP's buckets: a callback on its future)"),
        f"- the asynchronous cost times the {spread(waits['collectives_per_step'], '{:.2f}')} "
        "collectives a DDP step issued (every collective of the run over its steps), over the "
        f"step off: {spread(waits['work_ratio'], '{:.4f}')}; "
        f"{verdict(waits['work_ratio']['median'], target)}",
    ]


def hang_lines(hang: dict) -> list[str]:
    """Section 12: from a hung job's last step line to the launcher's verdict."""
    lines = [
        "",
        "## 12. A hang explained (jobs in containers)",
        "",
        f"The last rank sleeps in its data loading at step 5; `STALL={hang['stall']}`. From the "
        "job's last step line to the verdict (`[launcher] hang: ...`): the stall, then every "
        f"rank's stacks read with py-spy on every node and judged; budget {hang['budget']} s.",
    ]
    for key in sorted(k for k in hang if k.startswith("nodes_")):
        found = hang[key]
        lines.append(
            f"- {key.split('_')[1]} nodes: {spread(found['seconds'], '{:.1f}')} s, "
            f"ratio {spread(found['ratio'], '{:.2f}')}"
        )
    return lines


def rebuild_lines(rebuild: dict) -> list[str]:
    """Section 11: `make provision` again after a one-line change to a file the image copies
    after its torch install, against the first run on fresh nodes."""
    kept = rebuild["install_layer_kept"]
    lines = [
        "",
        "## 11. Rebuilding the image after a one-line change (2 fresh nodes, jobs in containers)",
        "",
        f"`make provision` typed in a scratch checkout: once on fresh nodes (it builds the "
        f"training image, {human(rebuild['image_bytes'])} unpacked, and ships the whole of it), "
        f"then {len(kept)} time(s) again, each after one more line in "
        f"`{rebuild['changed_file']}` (`make image` rebuilds the layers above it, `cluster ship` "
        "sends them).",
        f"- first run: {rebuild['first_seconds']:.0f} s",
        f"- after the change: {spread(rebuild['second_seconds'], '{:.0f}')} s",
        f"- ratio: {spread(rebuild['ratio'], '{:.2f}')}",
        f"- the torch install layer kept by the rebuild: {sum(kept)} of {len(kept)}",
    ]
    for rep, received in enumerate(rebuild["rx_bytes"]):
        lines.append(f"- rep {rep + 1}: bytes received, network counters: {_per_node(received)}")
    if rebuild.get("first_phases"):
        lines += [
            "",
            "Where the time goes, per step of `make provision` (checks: `cluster check` and "
            "`cluster ready`; image: `cluster image`; playbook: `ansible-playbook site.yml`; "
            "ship: `cluster ship`), in seconds:",
            "",
            "| run | " + " | ".join(rebuild["first_phases"]) + " | total |",
            "| --- |" + " ---: |" * (len(rebuild["first_phases"]) + 1),
            _phase_row("first", rebuild["first_phases"], rebuild["first_phases"]),
        ]
        for rep, phases in enumerate(rebuild.get("second_phases", [])):
            lines.append(_phase_row(f"rep {rep + 1}", phases, rebuild["first_phases"]))
    return lines


def _phase_row(name: str, phases: dict[str, float], columns: dict[str, float]) -> str:
    cells = [f"{phases[column]:.0f}" if column in phases else "-" for column in columns]
    return f"| {name} | " + " | ".join(cells) + f" | {sum(phases.values()):.0f} |"


def _per_node(values: dict[str, int]) -> str:
    return ", ".join(f"{node} {value:,} B ({human(value)})" for node, value in values.items())


def image_lines(image: dict) -> list[str]:
    """Section 10: the image's first shipment both ways, and a change to its top layer."""
    registry, stream, top = image["registry_runs"], image["stream_runs"], image["top_layer"]
    n = len(registry)
    lines = [
        "",
        "## 10. Shipping the training image (2 nodes, jobs in containers)",
        "",
        f"`{image['image']}`, {image['image_bytes']:,} bytes ({human(image['image_bytes'])})"
        " unpacked. First shipment: the image removed from both nodes (`docker rmi -f`, "
        "`docker image prune -f`) and, for the registry, from the registry's storage, then "
        "`cluster ship`'s own code (`ship.ship`) with `via=registry` (push, then both nodes "
        "pull at once) and with `via=stream` (one `docker save` written into `docker load` on "
        f"both nodes over SSH), {n} time(s) each, order {', '.join(image['order'])} "
        "(alternating when repeated). Wall time from the call to every node holding the "
        "controller's image ID.",
        "",
        "| | through the registry | streamed whole |",
        "|---|---|---|",
        f"| seconds | {spread(image['registry_seconds'], '{:.0f}')} | "
        f"{spread(image['stream_seconds'], '{:.0f}')} |",
    ]
    for rep, (through, whole) in enumerate(zip(registry, stream, strict=False)):
        lines += [
            f"| rep {rep + 1}: bytes per node, as the shipment counted them | "
            f"{_per_node(through['received'])} | {_per_node(whole['received'])} |",
            f"| rep {rep + 1}: bytes per node, its network counters | "
            f"{_per_node(through['rx_bytes'])} | {_per_node(whole['rx_bytes'])} |",
        ]
    lines += [
        "",
        f"- ratio, registry / stream: {spread(image['ratio'], '{:.2f}')} (lower is better)",
        "",
        f"A change to the image's top layer (one new file of random bytes on top, a rebuild "
        f"after an edit to the Dockerfile's last step): layer {top['layer_bytes']:,} bytes, "
        f"image {top['image_bytes']:,} bytes, shipped {top['via'] or 'nowhere'} "
        f"{('(' + top['reason'] + ') ') if top['reason'] else ''}in {top['seconds']:.1f} s.",
        "",
        "| node | received (network counters) | counted by the shipment | / whole image "
        "| / the layer |",
        "|---|---|---|---|---|",
    ]
    for node, value in top["rx_bytes"].items():
        counted = top["received"].get(node, 0)
        lines.append(
            f"| {node} | {value:,} | {counted:,} | {value / top['image_bytes']:.5f} | "
            f"{value / top['layer_bytes']:.2f} |"
            if top["layer_bytes"]
            else "- |"
        )
    return lines


def ft_lines(found: dict) -> list[str]:
    """Section 18: FT=1 against the restart path, a node's death and return, and its cost."""
    return [
        "",
        f"## 18. FT=1 against the restart path ({found['nodes']} nodes, in containers)",
        "",
        "training.ddp, node3 killed after step 12; side by side in each rep. FT=1 with "
        f"RESTARTS=1 (the groups' timeout {found['timeout']:g} s), node3 started again at once; "
        f"the restart path with RESTARTS=1 MIN_NODES=2 and --restart-wait {found['grace']:g} s, "
        "a checkpoint every 5 steps.",
        "- death to the survivors' next step, FT=1: "
        f"{spread(found['death_seconds'], '{:.1f}')} s (budget {found['death_budget']:g} s: "
        f"{spread(found['death_ratio'], '{:.2f}')})",
        f"- the same on the restart path: {spread(found['restart_seconds'], '{:.1f}')} s; FT=1's "
        "over the restart path's at its default --restart-wait (the measured time plus the "
        f"wait it would add, derived): {spread(found['default_ratio'], '{:.3f}')} (target 0.33)",
        f"- steps done again, FT=1: {spread(found['redone'], '{:.0f}')}; restart path: "
        f"{spread(found['restart_redone'], '{:.0f}')}",
        "- node3's return (its engine answering) to its group's first committed step: "
        f"{spread(found['heal_seconds'], '{:.1f}')} s (target 60 s)",
        "- step time without a fault, FT=1 / plain DDP (steps 10 to 60): "
        f"{spread(found['overhead'], '{:.3f}')} (target 1.05); with ResNet-18 (steps 10 to "
        f"30): {spread(found['overhead_resnet'], '{:.3f}') if 'overhead_resnet' in found else '-'}",
    ]


def latency_lines(found: dict) -> list[str]:
    """Section 19: the straggler watch's latency, from a slowdown to its line."""
    seconds = found["seconds"]
    return [
        "",
        "## 19. The straggler watch's latency (2 nodes, in containers)",
        "",
        "Each rep: our workload (training.ddp) and a user's own script (an all_reduce in a "
        f"loop), even for {found['even_first']:g} s in the first rep and {found['even']:g} s in "
        f"the others with nothing said, then node2's compute link shaped to {found['rate']} "
        "until node2 is named for it, then the link freed and node2's job container held to "
        f"{found['held']['ours']} CPU (our workload) or {found['held']['script']} (the script) "
        "until it is named again. Seconds from the change to the launcher's line "
        f"(target {found['target']:g} s):",
        f"- our workload, the link: {spread(seconds['ours_network'], '{:.0f}')} s; the CPU: "
        f"{spread(seconds['ours_cpu'], '{:.0f}')} s",
        f"- a user's script, the link: {spread(seconds['script_network'], '{:.0f}')} s; the CPU: "
        f"{spread(seconds['script_cpu'], '{:.0f}')} s",
        f"- the worst of the four / {found['target']:g} s: {spread(found['ratio'], '{:.2f}')}",
    ]
