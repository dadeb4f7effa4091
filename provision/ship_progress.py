"""What a shipment of the training image says while it goes and when it is done
(provision.ship): the engine's per-layer progress folded into bytes, a line per node every few
seconds (bytes, rate, time left), and the summary.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch_multinode.cluster.sync import PROGRESS_EVERY, human
from torch_multinode.provision.build_watch import duration

Emit = Callable[[str], None]


@dataclass
class Meter:
    """How far an image has come to one node: a line every few seconds while it moves."""

    node: str
    emit: Emit
    total: int = 0
    done: int = 0
    every: float = PROGRESS_EVERY
    clock: Callable[[], float] = time.monotonic
    started: float = field(default=0.0)
    shown: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.started = self.shown = self.clock()

    def update(self, done: int, total: int | None = None, phase: str = "") -> None:
        self.done = done
        if total is not None:
            self.total = total
        now = self.clock()
        if now - self.shown >= self.every:
            self.shown = now
            self.emit(self.line(phase))

    def line(self, phase: str = "") -> str:
        seconds = max(self.clock() - self.started, 1e-9)
        rate = self.done / seconds
        of = f" of {human(self.total)}" if self.total else ""
        left = ""
        if self.total and rate > 0 and self.done < self.total:
            left = f", about {duration((self.total - self.done) / rate)} left"
        elif phase:
            left = f", {phase}"
        return f"[image] {self.node}: {human(self.done)}{of}, {human(rate)}/s{left}"


@dataclass
class Shipment:
    """What `ship` did, for its summary and for benchmarks."""

    image: str
    image_id: str
    via: str  # "registry", "stream" or "" (nothing to send)
    reason: str = ""  # why the stream was chosen
    received: dict[str, int] = field(default_factory=dict)  # bytes each node fetched
    already: list[str] = field(default_factory=list)  # nodes that held the image
    seconds: float = 0.0


def engine_lines(lines: Iterable[str]) -> Iterable[dict]:
    """The engine's JSON progress lines, skipping what is not one."""
    for line in lines:
        line = line.strip()
        if line.startswith("{"):
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


class LayerProgress:
    """A pull's or push's per-layer progress folded into bytes moved and bytes to move."""

    MOVING = {"Downloading", "Pushing"}
    MOVED = {"Download complete", "Pushed", "Verifying Checksum", "Extracting", "Pull complete"}

    def __init__(self) -> None:
        self.layers: dict[str, list[int]] = {}  # id -> [current, total]
        self.error = ""

    def feed(self, message: dict) -> str:
        """Take one message; the phase it tells of ('' for most)."""
        if message.get("error"):
            self.error = str(message.get("error")).strip()
            return "failed"
        status = str(message.get("status", ""))
        layer = str(message.get("id", ""))
        detail = message.get("progressDetail") or {}
        if status in self.MOVING and layer:
            total = int(detail.get("total") or 0)
            current = int(detail.get("current") or 0)
            seen = self.layers.setdefault(layer, [0, total])
            seen[0] = max(seen[0], current)
            seen[1] = max(seen[1], total)
        elif status in self.MOVED and layer in self.layers:
            self.layers[layer][0] = self.layers[layer][1]
            if status == "Extracting":
                return "unpacking"
        return ""

    @property
    def done(self) -> int:
        return sum(current for current, _ in self.layers.values())

    @property
    def total(self) -> int:
        return sum(total for _, total in self.layers.values())


def summary(shipment: Shipment) -> str:
    if not shipment.via:
        return (
            f"Every node already holds {shipment.image} ({shipment.image_id[7:19]}): nothing sent."
        )
    each = ", ".join(f"{name} {human(size)}" for name, size in shipment.received.items())
    held = f"; {', '.join(shipment.already)} already held it" if shipment.already else ""
    how = "through the registry" if shipment.via == "registry" else "by stream"
    return (
        f"Done: {shipment.image} ({shipment.image_id[7:19]}) on every node, {how} in "
        f"{duration(shipment.seconds)} ({each}{held})."
    )
