"""Why a node is slow, the GPU's part (launch.causes asks it): nvidia-smi's query (GPU_QUERY, run
by causes' script), its answer read (`parse_gpus`), and the GPU that is held down or on a
narrowed PCIe link named in one line (`held`). Text in, text out: the unit tests feed it
recorded outputs."""

from __future__ import annotations

from dataclasses import dataclass

CLOCK_SHARE = 0.8  # a GPU's SM clock below this share of its maximum, with a reason given

# NVML's clock event (formerly throttle) reasons that slow a busy GPU down, by bit
# (nvmlClocksEventReason*); idle, the applications clocks setting, sync boost and the display
# clock say nothing of a straggler.
GPU_IDLE = 0x1  # nvmlClocksEventReasonGpuIdle: nothing runs on the GPU
GPU_REASONS = {
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake slowdown",
}
GPU_QUERY = (
    "index,clocks_event_reasons.active,temperature.gpu,power.draw,power.limit,clocks.sm,"
    "clocks.max.sm,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,"
    "pcie.link.width.max"
)


@dataclass(frozen=True)
class Gpu:
    index: int
    reasons: int
    temperature: float | None
    power: float | None
    power_limit: float | None
    sm_clock: float | None
    sm_clock_max: float | None
    pcie_gen: int | None
    pcie_gen_max: int | None
    pcie_width: int | None
    pcie_width_max: int | None


def parse_gpus(text: str) -> list[Gpu]:
    """nvidia-smi --query-gpu=GPU_QUERY --format=csv,noheader,nounits."""
    gpus = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != len(GPU_QUERY.split(",")) or not cells[0].isdigit():
            continue
        try:
            reasons = int(cells[1], 16)
        except ValueError:
            reasons = 0
        gpus.append(
            Gpu(
                index=int(cells[0]),
                reasons=reasons,
                temperature=number(cells[2]),
                power=number(cells[3]),
                power_limit=number(cells[4]),
                sm_clock=number(cells[5]),
                sm_clock_max=number(cells[6]),
                pcie_gen=_int(cells[7]),
                pcie_gen_max=_int(cells[8]),
                pcie_width=_int(cells[9]),
                pcie_width_max=_int(cells[10]),
            )
        )
    return gpus


def number(text: str) -> float | None:
    """One reading as a tool printed it (an nvidia-smi cell, /proc/loadavg's first field), or
    None where it printed none (`[N/A]`, `[Not Supported]`)."""
    try:
        return float(text)
    except ValueError:
        return None


def _int(text: str) -> int | None:
    return int(text) if text.strip().isdigit() else None


def held(gpus: list[Gpu]) -> str | None:
    """The first GPU held down (its clocks, with a reason given) or on a narrowed PCIe link
    while it works, in one line (causes' "gpu" cause); None where none is."""
    for gpu in gpus:
        named = [text for bit, text in GPU_REASONS.items() if gpu.reasons & bit]
        slowed = (
            gpu.sm_clock is not None
            and gpu.sm_clock_max
            and gpu.sm_clock < CLOCK_SHARE * gpu.sm_clock_max
        )
        if named and slowed:
            details = [f"SM clock {gpu.sm_clock:g} of {gpu.sm_clock_max:g} MHz"]
            if gpu.temperature is not None:
                details.append(f"{gpu.temperature:g} C")
            if gpu.power is not None and gpu.power_limit:
                details.append(f"{gpu.power:g} of {gpu.power_limit:g} W")
            return f"GPU {gpu.index} held down: {', '.join(named)} ({', '.join(details)})"
        # nvidia-smi: the link's current width and generation "may be reduced when the GPU is
        # not in use"; only a GPU at work (not idle, its SM clock near its maximum) says
        # anything of its slot.
        if gpu.reasons & GPU_IDLE or gpu.sm_clock is None or not gpu.sm_clock_max or slowed:
            continue
        if gpu.pcie_width and gpu.pcie_width_max and gpu.pcie_width < gpu.pcie_width_max:
            return (
                f"GPU {gpu.index}'s PCIe link runs x{gpu.pcie_width} of x{gpu.pcie_width_max} "
                "(a slot or riser that narrows it)"
            )
        if gpu.pcie_gen and gpu.pcie_gen_max and gpu.pcie_gen < gpu.pcie_gen_max:
            return (
                f"GPU {gpu.index}'s PCIe link runs at generation {gpu.pcie_gen} of "
                f"{gpu.pcie_gen_max} while busy (the slot, or the BIOS's PCIe setting)"
            )
    return None
