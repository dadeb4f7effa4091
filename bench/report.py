"""The benchmark report: JSON (everything measured), Markdown (the figures against their
targets) and PNG plots, from the dictionary bench.cli assembles."""

from __future__ import annotations

import json
from pathlib import Path

from torch_multinode.bench.flight import noise
from torch_multinode.bench.sections import (
    dependencies_lines,
    detector_lines,
    flight_lines,
    ft_lines,
    hang_lines,
    image_lines,
    latency_lines,
    lock_lines,
    nodeloss_lines,
    rebuild_lines,
    spread,
)
from torch_multinode.netcheck.report import human_bytes

FIXED_LEVERS = ("none", "fp16", "bf16", "powersgd", "no_sync")
# a target of 1 or 2 %: 1.024 is not 1.02
THREE_DECIMALS = (
    "flight_step",
    "flight_collective",
    "detector_step",
    "detector_work",
    "waits_step",
    "waits_work",
)

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
    "dependencies": (
        "make train of a project with a requirements.txt, a later run (its layer built and "
        "shipped by the first) / the same project without, time to first step",
        "<= 1.10",
    ),
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
        "a node lost for good (RESTARTS=1 MIN_NODES=2, 3 nodes, in containers): seconds from "
        "its death to the first step on the new world / (--restart-wait + 60 s)",
        "<= 1.00",
    ),
    "ft_death_3": (
        "FT=1 (3 nodes, in containers): seconds from a node's death to the survivors' next "
        "step / (the groups' timeout + 5 s)",
        "<= 1.00",
    ),
    "ft_vs_restart_3": (
        "the same / the restart path's at its default --restart-wait (measured at 10 s, plus "
        "the 290 s more it waits)",
        "<= 0.33",
    ),
    "ft_heal_3": (
        "FT=1: seconds from a lost node's return to its group's first committed step / 60 s",
        "<= 1.00",
    ),
    "ft_overhead_3": (
        "FT=1 step time without a fault / plain DDP's, 3 nodes, the tiny CNN (a step of about 25 ms)",
        "<= 1.05",
    ),
    "ft_overhead_resnet_3": (
        "the same with ResNet-18 at 32 px (a step of hundreds of ms, as a real model's)",
        "<= 1.05",
    ),
    "replication_3": (
        "training.fsdp's checkpoint replicas (3 nodes, node-local disks, in containers): step "
        "time with one checkpoint a minute, replicas on / off",
        "<= 1.05",
    ),
    "flight_step": (
        "DDP step time with the Flight Recorder on (TORCH_FR_BUFFER_SIZE=256) / off (=0), "
        "on this machine (2 ranks on gloo, or one per GPU on NCCL: section 13 says which)",
        "<= 1.02",
    ),
    "flight_collective": (
        "the same for 1-element all_reduces back to back (worst case), time per collective",
        "(no target)",
    ),
    "detector_step": (
        "DDP step time with the straggler detector on (--slow-rank-factor 1.5) / off (0), on "
        "this machine (section 17)",
        "<= 1.01",
    ),
    "detector_work": (
        "the same, from the detector's own work per step timed alone and, where measured, its "
        "measure of waits (section 17's second part): (step off + both) / step off",
        "<= 1.01",
    ),
    "straggler_latency": (
        "the straggler watch: seconds from a slowdown (a link shaped, a core held) to the line "
        "naming the node and its cause, the worst of four per rep (our workload and a user's "
        "script, 2 nodes in containers; section 19) / 120 s",
        "<= 1.00",
    ),
    "waits_step": (
        "DDP step time of a user's script with the launcher's measure of its waits on / off, on "
        "this machine (section 17)",
        "<= 1.01",
    ),
    "waits_work": (
        "the same, from the asynchronous worst case's cost per collective times a step's "
        "collectives: (step off + cost) / step off",
        "<= 1.01",
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
            best_rate = max(v["samples_per_second"]["median"] for v in fixed.values())
            auto = _rate(scaling, "auto")
            if auto is not None:
                found["auto_vs_best"] = auto / best_rate
                plain = _rate(scaling, "none")
                if plain:
                    found["auto_vs_plain"] = auto / plain
    for key, section in (
        ("launcher", "launcher"),
        ("netcheck", "netcheck"),
        ("provision", "provision"),
        ("edit_loop", "edit_loop"),
        ("slurm", "slurm"),
        ("dependencies", "dependencies"),
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
    if data.get("replication"):
        found["replication_3"] = _median(data["replication"]["ratio"])
    if data.get("ft"):
        found["ft_death_3"] = _median(data["ft"]["death_ratio"])
        found["ft_vs_restart_3"] = _median(data["ft"]["default_ratio"])
        found["ft_heal_3"] = _median(data["ft"]["heal_ratio"])
        found["ft_overhead_3"] = _median(data["ft"]["overhead"])
        if "overhead_resnet" in data["ft"]:  # reports before 2026-12-02 have the tiny CNN's alone
            found["ft_overhead_resnet_3"] = _median(data["ft"]["overhead_resnet"])
    if data.get("flight"):
        found["flight_step"] = _median(data["flight"]["step_ratio"])
        found["flight_collective"] = _median(data["flight"]["collective_ratio"])
    if data.get("detector"):
        found["detector_step"] = _median(data["detector"]["step_ratio"])
        detector = data["detector"]
        found["detector_work"] = _median(
            detector.get("total_work_ratio") or detector.get("work_ratio")
        )
        waits = data["detector"].get("waits") or {}
        found["waits_step"] = _median(waits.get("step_ratio"))
        found["waits_work"] = _median(waits.get("work_ratio"))
    if data.get("stragglers"):
        found["straggler_latency"] = _median(data["stragglers"]["ratio"])
    if data.get("edit_loop"):
        found["edit_kilobytes"] = data["edit_loop"]["edit_bytes_per_node"]["median"] / 1000
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
        judged = meets(key, value)
        judged_on = {
            "flight_step": (data.get("flight"), "the recorder"),
            "detector_step": (data.get("detector"), "the detector"),
            "waits_step": ((data.get("detector") or {}).get("waits"), "the measure"),
        }
        section, thing = judged_on.get(key, (None, ""))
        if section and value is not None and noise(section, thing):
            judged = "too noisy to judge"
        lines.append(f"| {text} | {shown} | {target} | {judged} |")
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
                f"| {human_bytes(int(size))} | {spread(item)} | {spread(other) if other else '-'} |"
            )
        lines.append(
            f"| raw TCP, same link | {spread(shaped['tcp_gbytes_per_s'])} | "
            f"{spread(free['tcp_gbytes_per_s'])} |"
        )
        lines.append(
            f"| busbw / TCP at {human_bytes(shaped['largest_bytes'])} | "
            f"{spread(shaped['busbw_over_tcp'], '{:.2f}')} | "
            f"{spread(free['busbw_over_tcp'], '{:.2f}')} |"
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
            f"({spread(scaling['baseline_samples_per_second'], '{:.1f}')} samples/s).",
            "",
            "| lever | samples/s (2 nodes) | scaling efficiency |",
            "|---|---|---|",
        ]
        for lever, item in scaling["levers"].items():
            lines.append(
                f"| {lever} | {spread(item['samples_per_second'], '{:.1f}')} | "
                f"{spread(item['efficiency'], '{:.2f}')} |"
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
                f"- {a}: {spread(section[a], '{:.1f}')}",
                f"- {b}: {spread(section[b], '{:.1f}')}",
                f"- ratio: {spread(section['ratio'], '{:.2f}')}",
            ]
    netcheck = data.get("netcheck")
    if netcheck and "ratio_own_cores" in netcheck:
        lines += [
            "",
            "Each node had half a core in both runs (4 nodes on this machine's 2 cores; "
            "the 2 nodes on one core), as real nodes keep their CPUs when others join. "
            "With the 2 nodes on a core each "
            f"({spread(netcheck['two_nodes_own_cores_seconds'], '{:.1f}')} s), the "
            f"ratio is {spread(netcheck['ratio_own_cores'], '{:.2f}')}: then the 4-node "
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
            f"- second, idempotent run: {spread(provision['second_seconds'], '{:.0f}')} s",
            f"- ratio: {spread(provision['ratio'], '{:.2f}')}",
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
            f"{spread(edit['edited_seconds'], '{:.1f}')} s",
            f"- with nothing changed: {spread(edit['unchanged_seconds'], '{:.1f}')} s",
            f"- ratio: {spread(edit['ratio'], '{:.2f}')}",
            f"- bytes sent per node for the edit (rsync: file list, checksums, delta): "
            f"{spread(edit['edit_bytes_per_node'], '{:.0f}')}, against "
            f"{human_bytes(edit['workdir_bytes'])} for the whole project",
        ]
    slurm = data.get("slurm")
    if slurm:
        lines += [
            "",
            "## 8. Through Slurm (jobs on the host)",
            "",
            "The same job on the same 2 nodes, from `make train` to the first training step:",
            f"- through Slurm (scheduler: slurm): {spread(slurm['slurm_seconds'], '{:.1f}')} s",
            f"- through the SSH launcher: {spread(slurm['ssh_seconds'], '{:.1f}')} s",
            f"- ratio: {spread(slurm['ratio'], '{:.2f}')}",
        ]
    fsdp = data.get("fsdp")
    if fsdp:
        lines += [
            "",
            "## 9. FSDP2 against DDP (training.fsdp, the same GPT)",
            "",
            f"`{' '.join(fsdp['model'])}` on 2 nodes, `--strategy fsdp` and `--strategy ddp`:",
            f"- FSDP2: {spread(fsdp['fsdp_tokens_per_second'], '{:,.0f}')} tokens/s, one rank "
            f"holds {spread(fsdp['fsdp_bytes_ratio'], '{:.3f}')} of an unsharded replica",
            f"- DDP: {spread(fsdp['ddp_tokens_per_second'], '{:,.0f}')} tokens/s, "
            f"{spread(fsdp['ddp_bytes_ratio'], '{:.3f}')}",
            f"- tokens/s ratio: {spread(fsdp['tokens_ratio'], '{:.2f}')}",
        ]
    if data.get("image"):
        lines += image_lines(data["image"])
    if data.get("rebuild"):
        lines += rebuild_lines(data["rebuild"])
    if data.get("hang"):
        lines += hang_lines(data["hang"])
    if data.get("flight"):
        lines += flight_lines(data["flight"])
    if data.get("detector"):
        lines += detector_lines(data["detector"])
    if data.get("lock"):
        lines += lock_lines(data["lock"])
    if data.get("nodeloss"):
        lines += nodeloss_lines(data["nodeloss"], data.get("replication"))
    if data.get("dependencies"):
        lines += dependencies_lines(data["dependencies"])
    if data.get("ft"):
        lines += ft_lines(data["ft"])
    if data.get("stragglers"):
        lines += latency_lines(data["stragglers"])
    return "\n".join(lines) + "\n"


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
