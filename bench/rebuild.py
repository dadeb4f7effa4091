"""11. Rebuilding the image after a one-line change: make provision typed in a scratch
checkout on 2 fresh nodes of a cluster of its own, the first time and again after each
one-line edit to docker/entrypoint.sh, with the seconds of each of its steps."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

from torch_multinode.bench.measure import (
    REPO_ROOT,
    Progress,
    Series,
    containers_inventory,
    node_containers,
    node_rx,
)
from torch_multinode.cluster.errors import UserError
from torch_multinode.provision import images
from torch_multinode.sim import nodes as sim

# -- 11. rebuilding the image after a one-line change ----------------------------------------

# The image this section builds and ships under its own name (never a tag tests or users hold),
# removed at the end; its layers below the change stay in the engine's cache, shared.
REBUILD_TAG = "torch-multinode/train:bench-rebuild"
REBUILD_FILE = "docker/entrypoint.sh"  # copied after the torch install, as a user edits it
REBUILD_TIMEOUT = 3600


def scratch_checkout(destination: Path) -> Path:
    """A checkout of this repository for the bench to edit as a user edits theirs: its files
    (tracked, and untracked ones git does not ignore) copied as they are now, so that edits
    made here meanwhile never reach it; docker/wheels hard-linked (3 GB that never change, cost
    nothing to "copy"); the venv linked; its symlinks (torch_multinode/'s to the rooms) made
    anew with the same relative targets, so they point into the copy. Editing a file there
    (edit_line) never touches this checkout, which tests may read."""
    destination.mkdir(parents=True)
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_symlink():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            (destination / name).symlink_to(source.readlink())
        elif source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    if images.WHEELS_DIR.is_dir():
        wheels = destination / images.WHEELS_DIR.relative_to(REPO_ROOT)
        wheels.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-al", str(images.WHEELS_DIR), str(wheels)], check=True)
    (destination / ".venv").symlink_to(REPO_ROOT / ".venv")
    return destination


def edit_line(path: Path, line: str) -> None:
    """One line appended to `path`, a new file in its place (never through a hard link), its
    mode kept (the entrypoint stays executable)."""
    text, mode = path.read_text(), path.stat().st_mode
    path.unlink()
    path.write_text(f"{text}\n{line}\n")
    path.chmod(mode)


# The Makefile's provision recipe, step by step: make echoes each command as it starts it.
PROVISION_PHASES = (
    ("image", re.compile(r"/cluster image ")),
    ("playbook", re.compile(r"ansible-playbook ")),
    ("ship", re.compile(r"/cluster ship ")),
)


def provision_phases(lines: list[tuple[float, str]], end: float) -> dict[str, float]:
    """Seconds per step of `make provision` from its output, each line with the second it was
    read (from the start): 'checks' (cluster check and cluster ready) until make echoes
    `cluster image`, 'image' until `ansible-playbook`, 'playbook' until `cluster ship`, 'ship'
    until `end`. A step whose line never came is left out."""
    starts = {"checks": 0.0}
    for name, pattern in PROVISION_PHASES:
        found = next((at for at, text in lines if pattern.search(text)), None)
        if found is not None:
            starts[name] = found
    ordered = sorted(starts.items(), key=lambda item: item[1])
    ends = [at for _, at in ordered[1:]] + [end]
    return {name: stop - at for (name, at), stop in zip(ordered, ends, strict=True)}


def make_provision_in(checkout: Path, inventory: Path) -> tuple[float, str, dict[str, float]]:
    """`make provision INVENTORY=...` typed in `checkout` (its code runs: PYTHONPATH puts it
    before this checkout's editable install, as a user's own clone would be): wall seconds,
    its output, and the seconds of each of its steps (provision_phases)."""
    import os

    started = time.monotonic()
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "provision", f"INVENTORY={inventory}"],
        cwd=checkout,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env={**os.environ, "PYTHONPATH": str(checkout)},
    )
    timer = threading.Timer(REBUILD_TIMEOUT, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None  # stdout=PIPE
        lines = [(time.monotonic() - started, line) for line in proc.stdout]
        returncode = proc.wait()
    finally:
        timer.cancel()
    seconds = time.monotonic() - started
    output = "".join(text for _, text in lines)
    if returncode != 0:
        tail = output.strip().splitlines()[-15:]
        raise UserError(f"make provision failed (exit {returncode}):\n  " + "\n  ".join(tail))
    return seconds, output, provision_phases(lines, seconds)


def install_layer(image: str) -> str:
    """The id of the step that installed torch (`docker history`), the image's 3.8 GB layer."""
    out = sim.docker("history", "--no-trunc", "--format", "{{.ID}}\t{{.CreatedBy}}", image).stdout
    found = [line.split("\t")[0] for line in out.splitlines() if "pip install" in line]
    if len(found) != 1:
        raise UserError(f"{image}: {len(found)} steps install with pip, not 1")
    return found[0]


def measure_rebuild(config: sim.SimConfig, link: str, reps: int, progress: Progress) -> dict:
    """On 2 fresh simulated nodes for jobs in containers (a cluster of its own, `config`,
    removed at the end): `make provision` typed in a scratch checkout, the first time (it builds
    the training image, from the engine's cache where it holds the layers, and ships the whole
    of it), then `reps` times again, each after one more line appended to docker/entrypoint.sh
    there (make image rebuilds the layers above that COPY, cluster ship sends them). Each
    second run over the first; the torch install layer's id before and after; the bytes each
    node received in each second run."""
    import tempfile

    sim.down(config)
    try:
        cluster = sim.up(2, link, config)
        inventory = containers_inventory(cluster.config.inventory_path, REBUILD_TAG)
        containers = node_containers(inventory)
        with tempfile.TemporaryDirectory(prefix="bench-checkout-") as scratch:
            checkout = scratch_checkout(Path(scratch) / "checkout")
            progress("rebuild: make provision on 2 fresh nodes, jobs in containers...")
            first, _, first_phases = make_provision_in(checkout, inventory)
            installed = install_layer(REBUILD_TAG)
            progress(f"rebuild: first make provision {first:.0f} s ({shown(first_phases)})")
            seconds, received, kept, phases = [], [], [], []
            for rep in range(reps):
                edit_line(checkout / REBUILD_FILE, f"# bench rebuild {rep + 1}")
                before = node_rx(containers)
                again, _, again_phases = make_provision_in(checkout, inventory)
                after = node_rx(containers)
                seconds.append(again)
                phases.append(again_phases)
                received.append({node: after[node] - before[node] for node in containers})
                kept.append(install_layer(REBUILD_TAG) == installed)
                progress(
                    f"rebuild: rep {rep + 1}/{reps}: make provision after a one-line change to "
                    f"{REBUILD_FILE} {again:.0f} s ({again / first:.2f} of the first: "
                    f"{shown(again_phases)}); "
                    + ", ".join(f"{n} {v:,} bytes received" for n, v in received[-1].items())
                )
            whole = images.image_size(REBUILD_TAG)
    finally:
        sim.down(config)  # the nodes, and the image they held
        sim.docker("rmi", REBUILD_TAG, check=False)
    return {
        "changed_file": REBUILD_FILE,
        "image_bytes": whole,
        "first_seconds": first,
        "second_seconds": Series(seconds).as_dict(),
        "ratio": Series([value / first for value in seconds]).as_dict(),
        "install_layer_kept": kept,
        "rx_bytes": received,
        "first_phases": first_phases,
        "second_phases": phases,
    }


def shown(phases: dict[str, float]) -> str:
    """'checks 4 s, image 60 s, ...'"""
    return ", ".join(f"{name} {value:.0f} s" for name, value in phases.items())
