"""The benchmark report: JSON (everything measured), Markdown (the figures against their
targets) and PNG plots, from the dictionary bench.cli assembles."""

from __future__ import annotations

import json
from pathlib import Path

from torch_multinode.bench.flight import too_noisy, verdict
from torch_multinode.cluster.sync import human
from torch_multinode.netcheck.report import human_bytes

FIXED_LEVERS = ("none", "fp16", "bf16", "powersgd", "no_sync")
THREE_DECIMALS = ("flight_step", "flight_collective")  # a target of 2 %: 1.024 is not 1.02

# figure: (what it is, its target)
TARGETS = {
    "busbw_vs_tcp": ("all_reduce busbw at 64 MiB / raw TCP, 1 Gbit/s link", ">= 0.90"),
    "best_efficiency": ("best lever's scaling efficiency, ResNet-18", ">= 0.80"),
    "auto_vs_best": ("auto / best fixed lever (samples/s)", ">= 0.95"),
    "auto_vs_plain": ("auto / plain DDP (samples/s)", ">= 0.98"),
    "launcher": ("make train / torchrun by hand, time to first step", "<= 1.15"),
    "netcheck": ("netcheck wall time, 4 nodes / 2 nodes, half a core per node", "<= 1.50"),
    "provision": ("make provision, second run / first run", "(no target)"),
    "edit_loop": (
        "make train after a one-line edit / nothing changed, 1,000-file project in "
        "containers, time to first step",
        "<= 1.10",
    ),
    "edit_kilobytes": ("KB sent per node for that one-line edit", "<= 100"),
    "fsdp_bytes": (
        "FSDP2, one rank's parameters + gradients + optimizer state / one unsharded replica's, "
        "2 nodes",
        "<= 0.55",
    ),
    "fsdp_vs_ddp": ("FSDP2 / DDP tokens/s, the same GPT on 2 nodes", "(no target)"),
    "slurm": ("make train through Slurm / through the SSH launcher, time to first step", "<= 1.25"),
    "image_first_shipment": (
        "first shipment of the training image to 2 nodes, time through the registry / "
        "streamed whole (docker save into docker load over SSH)",
        "(no target)",
    ),
    "image_top_layer": (
        "bytes a node received after a change to the image's top layer / the whole image "
        "(the node's network counters, the larger of 2 nodes)",
        "(no target)",
    ),
    "image_rebuild": (
        "make provision after a one-line change to docker/entrypoint.sh / the first make "
        "provision on fresh nodes, 2 nodes, jobs in containers",
        "<= 0.25",
    ),
    "hang_2": (
        "a hung job: seconds from its last step line to the launcher's verdict / (STALL + 15 s), "
        "2 nodes, jobs in containers",
        "<= 1.00",
    ),
    "hang_4": ("the same, 4 nodes", "<= 1.00"),
    "lock_4": (
        "what make train adds to check every node against the version lock: seconds at 4 nodes "
        "/ 1 s",
        "<= 1.00",
    ),
    "nodeloss_3": (
        "a node lost for good (RESTARTS=1 MIN_NODES=2, 3 nodes, host mode): seconds from its "
        "death to the first step on the new world / (--restart-wait + 60 s)",
        "<= 1.00",
    ),
    "flight_step": (
        "DDP step time with the Flight Recorder on (TORCH_FR_BUFFER_SIZE=256) / off (=0), "
        "2 ranks on this machine, gloo over loopback",
        "<= 1.02",
    ),
    "flight_collective": (
        "the same for 1-element all_reduces back to back (worst case), time per collective",
        "(no target)",
    ),
}


def _median(item: dict | None) -> float | None:
    return None if item is None else item["median"]


def _rate(scaling: dict, lever: str) -> float | None:
    item = scaling.get("levers", {}).get(lever)
    return None if item is None else item["samples_per_second"]["median"]


def figures(data: dict) -> dict[str, float | None]:
    """The headline ratios, each from measurements taken side by side in this run."""
    found: dict[str, float | None] = dict.fromkeys(TARGETS)
    bandwidth = data.get("bandwidth")
    if bandwidth:
        found["busbw_vs_tcp"] = _median(bandwidth["shaped"]["busbw_over_tcp"])
    scaling = data.get("scaling")
    if scaling:
        fixed = {k: v for k, v in scaling["levers"].items() if k in FIXED_LEVERS}
        if fixed:
            found["best_efficiency"] = max(v["efficiency"]["median"] for v in fixed.values())
            best_rate = max(_rate(scaling, k) for k in fixed)
            auto = _rate(scaling, "auto")
            if auto is not None:
                found["auto_vs_best"] = auto / best_rate
                if _rate(scaling, "none"):
                    found["auto_vs_plain"] = auto / _rate(scaling, "none")
    for key, section in (
        ("launcher", "launcher"),
        ("netcheck", "netcheck"),
        ("provision", "provision"),
        ("edit_loop", "edit_loop"),
        ("slurm", "slurm"),
    ):
        if data.get(section):
            found[key] = _median(data[section]["ratio"])
    if data.get("fsdp"):
        found["fsdp_bytes"] = _median(data["fsdp"]["fsdp_bytes_ratio"])
        found["fsdp_vs_ddp"] = _median(data["fsdp"]["tokens_ratio"])
    image = data.get("image")
    if image:
        found["image_first_shipment"] = _median(image["ratio"])
        found["image_top_layer"] = max(image["top_layer"]["rx_over_image"].values())
    if data.get("rebuild"):
        found["image_rebuild"] = _median(data["rebuild"]["ratio"])
    for nodes in (2, 4):
        if data.get("hang", {}).get(f"nodes_{nodes}"):
            found[f"hang_{nodes}"] = _median(data["hang"][f"nodes_{nodes}"]["ratio"])
    if data.get("lock"):
        found["lock_4"] = _median(data["lock"]["ratio"])
    if data.get("nodeloss"):
        found["nodeloss_3"] = _median(data["nodeloss"]["ratio"])
    if data.get("flight"):
        found["flight_step"] = _median(data["flight"]["step_ratio"])
        found["flight_collective"] = _median(data["flight"]["collective_ratio"])
    if data.get("edit_loop"):
        found["edit_kilobytes"] = _median(data["edit_loop"]["edit_bytes_per_node"]) / 1000
    return found


def meets(key: str, value: float | None) -> str:
    if value is None:
        return "not measured"
    target = TARGETS[key][1]
    if target.startswith(">="):
        return "meets" if value >= float(target[2:]) else "MISSES"
    if target.startswith("<="):
        return "meets" if value <= float(target[2:]) else "MISSES"
    return ""


def _spread(item: dict, fmt: str = "{:.3f}") -> str:
    return (
        f"{fmt.format(item['median'])} ({fmt.format(item['min'])} to "
        f"{fmt.format(item['max'])}, n={item['n']})"
    )


def markdown(data: dict) -> str:
    found = figures(data)
    where = (
        f"on the simulated cluster: {data['cluster']}"
        if data.get("cluster")
        else "on this machine, no simulated cluster"
    )
    lines = [
        "# torch-multinode benchmark",
        "",
        f"`{data['command']}`, {data['date']}, {data['minutes']:.1f} min, {where}.",
        "Every figure is a ratio of two things measured side by side in this run: median over "
        "the repetitions (paired rep by rep), range and count in parentheses.",
        "",
        "| figure | value | target | |",
        "|---|---|---|---|",
    ]
    for key, (text, target) in TARGETS.items():
        value = found[key]
        shown = (
            "-"
            if value is None
            else f"{value:.3f}"
            if key in THREE_DECIMALS
            else f"{value:.2f}"
            if abs(value) >= 0.01
            else f"{value:.5f}"
        )
        lines.append(f"| {text} | {shown} | {target} | {meets(key, value)} |")
    bandwidth = data.get("bandwidth")
    if bandwidth:
        lines += [
            "",
            "## 1. Bus bandwidth against raw TCP (all_reduce, gloo, 2 nodes)",
            "",
            "| message | busbw 1 Gbit/s (GB/s) | busbw unshaped (GB/s) |",
            "|---|---|---|",
        ]
        shaped, free = bandwidth["shaped"], bandwidth["unshaped"]
        for size, item in shaped["busbw_by_size"].items():
            other = free["busbw_by_size"].get(size)
            lines.append(
                f"| {human_bytes(int(size))} | {_spread(item)} | "
                f"{_spread(other) if other else '-'} |"
            )
        lines.append(
            f"| raw TCP, same link | {_spread(shaped['tcp_gbytes_per_s'])} | "
            f"{_spread(free['tcp_gbytes_per_s'])} |"
        )
        lines.append(
            f"| busbw / TCP at {human_bytes(shaped['largest_bytes'])} | "
            f"{_spread(shaped['busbw_over_tcp'], '{:.2f}')} | "
            f"{_spread(free['busbw_over_tcp'], '{:.2f}')} |"
        )
    scaling = data.get("scaling")
    if scaling:
        work = scaling.get("workload", {})
        lines += [
            "",
            "## 2. Scaling efficiency per lever (ResNet-18, 1 Gbit/s link)",
            "",
            f"Per-rank micro-batch {work.get('batch')}, {work.get('accumulate')} "
            "micro-batches per optimizer step for every lever (the same global batch); "
            "each node pinned to its own core. Efficiency: samples/s of 2 nodes over "
            "twice that of 1 node "
            f"({_spread(scaling['baseline_samples_per_second'], '{:.1f}')} samples/s).",
            "",
            "| lever | samples/s (2 nodes) | scaling efficiency |",
            "|---|---|---|",
        ]
        for lever, item in scaling["levers"].items():
            lines.append(
                f"| {lever} | {_spread(item['samples_per_second'], '{:.1f}')} | "
                f"{_spread(item['efficiency'], '{:.2f}')} |"
            )
        selection = scaling.get("auto_selection")
        if selection:
            timings = ", ".join(f"{k} {v:.2f}" for k, v in selection["timings"].items())
            lines += [
                "",
                f"`auto` timed the candidates (s per optimizer step: {timings}) in "
                f"{selection['seconds']:.1f} s and chose **{selection['chosen']}**.",
            ]
    accuracy = data.get("powersgd_accuracy")
    if accuracy:
        lines += [
            "",
            "## 3. PowerSGD's accuracy cost",
            "",
            f"Same job, same steps and seed (`{' '.join(accuracy['args'])}`): validation "
            f"accuracy {accuracy['val_accuracy_none']:.2f} % without a hook, "
            f"{accuracy['val_accuracy_powersgd']:.2f} % with PowerSGD "
            f"({accuracy['cost_points']:+.2f} points of cost).",
        ]
    for key, title, a, b in (
        (
            "launcher",
            "4. Launcher overhead (time to the first training step)",
            "make_train_seconds",
            "by_hand_seconds",
        ),
        ("netcheck", "5. netcheck wall time", "four_nodes_seconds", "two_nodes_seconds"),
    ):
        section = data.get(key)
        if section:
            lines += [
                "",
                f"## {title}",
                "",
                f"- {a}: {_spread(section[a], '{:.1f}')}",
                f"- {b}: {_spread(section[b], '{:.1f}')}",
                f"- ratio: {_spread(section['ratio'], '{:.2f}')}",
            ]
    netcheck = data.get("netcheck")
    if netcheck and "ratio_own_cores" in netcheck:
        lines += [
            "",
            "Each node had half a core in both runs (4 nodes on this machine's 2 cores; "
            "the 2 nodes on one core), as real nodes keep their CPUs when others join. "
            "With the 2 nodes on a core each "
            f"({_spread(netcheck['two_nodes_own_cores_seconds'], '{:.1f}')} s), the "
            f"ratio is {_spread(netcheck['ratio_own_cores'], '{:.2f}')}: then the 4-node "
            "run mostly measures twice the torch imports (about 2.5 s of CPU per node) on "
            "the same 2 cores.",
        ]
    provision = data.get("provision")
    if provision:
        lines += [
            "",
            "## 6. Provisioning",
            "",
            f"- first run on fresh nodes: {provision['first_seconds']:.0f} s (once: it "
            "needs fresh nodes)",
            f"- second, idempotent run: {_spread(provision['second_seconds'], '{:.0f}')} s",
            f"- ratio: {_spread(provision['ratio'], '{:.2f}')}",
        ]
    edit = data.get("edit_loop")
    if edit:
        lines += [
            "",
            "## 7. The edit loop (jobs in containers)",
            "",
            f"A project of {edit['workdir_files']} small files "
            f"({human_bytes(edit['workdir_bytes'])}); one module edited by one line before "
            "each edited run.",
            f"- time to the first step after the edit: "
            f"{_spread(edit['edited_seconds'], '{:.1f}')} s",
            f"- with nothing changed: {_spread(edit['unchanged_seconds'], '{:.1f}')} s",
            f"- ratio: {_spread(edit['ratio'], '{:.2f}')}",
            f"- bytes sent per node for the edit (rsync: file list, checksums, delta): "
            f"{_spread(edit['edit_bytes_per_node'], '{:.0f}')}, against "
            f"{human_bytes(edit['workdir_bytes'])} for the whole project",
        ]
    slurm = data.get("slurm")
    if slurm:
        lines += [
            "",
            "## 8. Through Slurm (jobs on the host)",
            "",
            "The same job on the same 2 nodes, from `make train` to the first training step:",
            f"- through Slurm (scheduler: slurm): {_spread(slurm['slurm_seconds'], '{:.1f}')} s",
            f"- through the SSH launcher: {_spread(slurm['ssh_seconds'], '{:.1f}')} s",
            f"- ratio: {_spread(slurm['ratio'], '{:.2f}')}",
        ]
    fsdp = data.get("fsdp")
    if fsdp:
        lines += [
            "",
            "## 9. FSDP2 against DDP (training.fsdp, the same GPT)",
            "",
            f"`{' '.join(fsdp['model'])}` on 2 nodes, `--strategy fsdp` and `--strategy ddp`:",
            f"- FSDP2: {_spread(fsdp['fsdp_tokens_per_second'], '{:,.0f}')} tokens/s, one rank "
            f"holds {_spread(fsdp['fsdp_bytes_ratio'], '{:.3f}')} of an unsharded replica",
            f"- DDP: {_spread(fsdp['ddp_tokens_per_second'], '{:,.0f}')} tokens/s, "
            f"{_spread(fsdp['ddp_bytes_ratio'], '{:.3f}')}",
            f"- tokens/s ratio: {_spread(fsdp['tokens_ratio'], '{:.2f}')}",
        ]
    if data.get("image"):
        lines += image_lines(data["image"])
    if data.get("rebuild"):
        lines += rebuild_lines(data["rebuild"])
    if data.get("hang"):
        lines += hang_lines(data["hang"])
    if data.get("flight"):
        lines += flight_lines(data["flight"])
    if data.get("lock"):
        lines += lock_lines(data["lock"])
    if data.get("nodeloss"):
        lines += nodeloss_lines(data["nodeloss"])
    return "\n".join(lines) + "\n"


def nodeloss_lines(found: dict) -> list[str]:
    """Section 15: a node lost for good, and the job on its new world."""
    became = sorted(set(found["became"]))
    return [
        "",
        f"## 15. A node lost for good ({found['nodes']} nodes of {found['cluster_nodes']}, "
        "host mode)",
        "",
        f"RESTARTS=1 MIN_NODES={found['nodes'] - 1}, --restart-wait {found['grace']:g} s; node3 "
        "killed after step 12 and left dead. Timed from the kill to the first step line of the "
        f"restarted run; budget {found['budget']:g} s.",
        f"- death to the first step on the new world: {_spread(found['seconds'], '{:.1f}')} s",
        f"- that / budget: {_spread(found['ratio'], '{:.2f}')}",
        f"- what became of node3: {'; '.join(became)}",
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
        f"- the check: {_spread(found['check_seconds'], '{:.2f}')} s",
        f"- a bare round trip on the same sessions, beside it: "
        f"{_spread(found['bare_seconds'], '{:.2f}')} s",
        f"- check / budget: {_spread(found['ratio'], '{:.2f}')}",
    ]


def flight_lines(flight: dict) -> list[str]:
    """Section 13: the Flight Recorder's cost on step time, and per collective at worst."""
    ratio = flight["step_ratio"]
    cost = flight["collective_cost_us"]
    noisy = (
        [
            f"- too noisy to judge: the repetitions range from {ratio['min']:.3f} to "
            f"{ratio['max']:.3f}, on both sides of 1 and wider than twice the target's margin "
            "(other load on this machine); an idle machine or more --reps"
        ]
        if too_noisy(ratio, flight["target"])
        else []
    )
    return [
        "",
        "## 13. The Flight Recorder's cost (this machine, no cluster)",
        "",
        f"`torchrun --standalone --nproc-per-node=2 {' '.join(flight['workload'])}` with "
        f"TORCH_FR_BUFFER_SIZE={flight['buffer']} (on, the trace's watcher running, as every job "
        "of the launcher) and =0 (off), the order alternating from one repetition to the next; "
        f"{flight['machine']}; load average {flight['load_before']:.1f} before, "
        f"{flight['load_after']:.1f} after. Seconds per step: the median of the step lines' "
        "intervals (the first, warm-up, left out).",
        f"- on: {_spread(flight['step_seconds_on'], '{:.4f}')} s per step",
        f"- off: {_spread(flight['step_seconds_off'], '{:.4f}')} s per step",
        f"- on / off: {_spread(ratio)}; {verdict(ratio['median'], flight['target'])}",
        "- the same for each run's fastest interval (the least disturbed by other load): "
        f"{_spread(flight['fastest_step_ratio'])}",
        *noisy,
        "",
        f"Worst case: {flight['collectives']:,} all_reduces of 1 element back to back, "
        f"{flight['rounds']} rounds per run, the fastest round counted:",
        f"- on: {_spread(flight['collective_us_on'], '{:.1f}')} us per collective",
        f"- off: {_spread(flight['collective_us_off'], '{:.1f}')} us per collective",
        f"- on / off: {_spread(flight['collective_ratio'])}; on - off: "
        f"{_spread(cost, '{:+.1f}')} us per collective",
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
            f"- {key.split('_')[1]} nodes: {_spread(found['seconds'], '{:.1f}')} s, "
            f"ratio {_spread(found['ratio'], '{:.2f}')}"
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
        f"- after the change: {_spread(rebuild['second_seconds'], '{:.0f}')} s",
        f"- ratio: {_spread(rebuild['ratio'], '{:.2f}')}",
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
        f"| seconds | {_spread(image['registry_seconds'], '{:.0f}')} | "
        f"{_spread(image['stream_seconds'], '{:.0f}')} |",
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
        f"- ratio, registry / stream: {_spread(image['ratio'], '{:.2f}')} (lower is better)",
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


def plots(data: dict, directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    written = []
    bandwidth = data.get("bandwidth")
    if bandwidth:
        figure, axes = pyplot.subplots(figsize=(7, 4.5))
        for name, style in (("shaped", "o-"), ("unshaped", "s-")):
            item = bandwidth[name]
            sizes = [int(s) for s in item["busbw_by_size"]]
            medians = [v["median"] for v in item["busbw_by_size"].values()]
            (line,) = axes.plot(sizes, medians, style, label=f"all_reduce busbw, {item['link']}")
            axes.axhline(
                item["tcp_gbytes_per_s"]["median"],
                color=line.get_color(),
                linestyle="--",
                label=f"raw TCP, {item['link']}",
            )
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("message size (bytes)")
        axes.set_ylabel("GB/s")
        axes.set_title("Bus bandwidth against raw TCP, 2 nodes (gloo)")
        axes.legend(fontsize=8)
        written.append(_save(figure, directory / "busbw.png"))
    scaling = data.get("scaling")
    if scaling:
        figure, axes = pyplot.subplots(figsize=(7, 4.5))
        levers = list(scaling["levers"])
        efficiency = [scaling["levers"][k]["efficiency"] for k in levers]
        medians = [e["median"] for e in efficiency]
        lows = [e["median"] - e["min"] for e in efficiency]
        highs = [e["max"] - e["median"] for e in efficiency]
        axes.bar(levers, medians, yerr=[lows, highs], capsize=4, color="#4c72b0")
        axes.axhline(0.8, color="grey", linestyle="--", label="target for the best lever")
        axes.set_ylim(0, 1.05)
        axes.set_ylabel("scaling efficiency (2 nodes)")
        axes.set_title("ResNet-18 on a 1 Gbit/s link, per lever")
        axes.legend(fontsize=8)
        written.append(_save(figure, directory / "scaling.png"))
    return written


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    import matplotlib.pyplot

    matplotlib.pyplot.close(figure)
    return path


def write(data: dict, directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    data = {**data, "figures": figures(data)}
    json_path = directory / "bench.json"
    json_path.write_text(json.dumps(data, indent=2) + "\n")
    md_path = directory / "bench.md"
    md_path.write_text(markdown(data))
    return [md_path, json_path, *plots(data, directory)]
