"""An image of this machine's Docker engine given to simulated nodes' engines without a copy:
its layer directories hard-linked into each node's engine volume, with the image's metadata,
before the node's engine first starts. Test set-up only (the node-loss cluster's three nodes,
tests/training/test_node_loss.py): a `docker load` into each node takes 4.3 GB of disk (and
as much again while it unpacks) and two minutes of CPU, and shipping an image to nodes is
tested on its own (tests/test_image_shipping.py).

Layers are never written once unpacked (a container writes to a directory of its own), so
the engines can share their files. Both engines must keep images as overlay2, in the same
layout (Docker 20.10 here and in the nodes); the caller checks that each node's engine then
reports the image's ID, and loads the image where it does not."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from torch_multinode.sim import nodes as sim

# Run in a node-image container with the engine's directory at /host: the spec on stdin.
_LINK = """
import json, os, shutil, subprocess, sys
spec = json.load(sys.stdin)
host = "/host"
with open(f"{host}/image/overlay2/repositories.json") as file:
    repositories = json.load(file)["Repositories"]
tags = {}
for name, references in repositories.items():
    mine = {ref: id for ref, id in references.items() if id == spec["image_id"]}
    if mine:
        tags[name] = mine
for volume in spec["volumes"]:
    engine = f"{host}/volumes/{volume}/_data"
    os.makedirs(f"{engine}/overlay2/l")
    for cache_id in spec["cache_ids"]:
        layer = f"{host}/overlay2/{cache_id}"
        subprocess.run(["cp", "-al", layer, f"{engine}/overlay2/"], check=True)
        with open(f"{layer}/link") as file:
            os.symlink(f"../{cache_id}/diff", f"{engine}/overlay2/l/{file.read().strip()}")
    store = f"{engine}/image/overlay2"
    for chain in spec["chain_ids"]:
        hexed = chain.split(":")[1]
        source = f"{host}/image/overlay2/layerdb/sha256/{hexed}"
        shutil.copytree(source, f"{store}/layerdb/sha256/{hexed}")
    os.makedirs(f"{store}/imagedb/content/sha256")
    hexed = spec["image_id"].split(":")[1]
    source = f"{host}/image/overlay2/imagedb/content/sha256/{hexed}"
    shutil.copy2(source, f"{store}/imagedb/content/sha256/")
    with open(f"{store}/repositories.json", "w") as file:
        json.dump({"Repositories": tags}, file)
"""


def chain_ids(diff_ids: list[str]) -> list[str]:
    """The layers' chain IDs (the image spec's ChainID: each the digest of its parent's chain ID
    and its own diff ID), the names the engine's layer store files them under."""
    chains = [diff_ids[0]]
    for diff_id in diff_ids[1:]:
        chains.append("sha256:" + hashlib.sha256(f"{chains[-1]} {diff_id}".encode()).hexdigest())
    return chains


def link_image(image: str, volumes: list[str]) -> str | None:
    """`image` put into the engine volumes `volumes` (their engines not started yet) as hard
    links to this engine's files; None, or why it could not be."""
    root, driver = sim.docker("info", "--format", "{{.DockerRootDir}} {{.Driver}}").stdout.split()
    data = json.loads(sim.docker("image", "inspect", image).stdout)[0]
    if driver != "overlay2" or data["GraphDriver"]["Name"] != "overlay2":
        return f"this engine keeps images as {driver}, not overlay2"
    graph = data["GraphDriver"]["Data"]
    diffs = [graph["UpperDir"], *filter(None, graph.get("LowerDir", "").split(":"))]
    for volume in volumes:
        mountpoint = Path(
            sim.docker("volume", "inspect", "--format", "{{.Mountpoint}}", volume).stdout.strip()
        )
        if mountpoint != Path(root) / "volumes" / volume / "_data":
            return f"volume {volume} is at {mountpoint}, outside {root}/volumes"
    spec = {
        "volumes": list(volumes),
        "cache_ids": [Path(diff).parent.name for diff in diffs],
        "chain_ids": chain_ids(data["RootFS"]["Layers"]),
        "image_id": data["Id"],
    }
    command = ["run", "--rm", "-i", "-v", f"{root}:/host", sim.NODE_IMAGE, "python3", "-c", _LINK]
    linked = sim.docker(*command, stdin=json.dumps(spec), check=False)
    if linked.returncode != 0:
        said = (linked.stderr.strip() or linked.stdout.strip()).splitlines()
        return said[-1] if said else f"the links failed (exit {linked.returncode})"
    return None
