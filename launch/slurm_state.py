"""Slurm's answers read, as pure functions of their text: a job's state (`scontrol show job
-o`) and its place in the queue (`squeue`, in Slurm's order)."""

from __future__ import annotations

from dataclasses import dataclass

SQUEUE_ORDER = "squeue --noheader --format '%i|%j|%u|%T'"  # in Slurm's order
# Slurm's states of a job that has ended (squeue/scontrol's JobState).
ENDED = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}


@dataclass
class JobState:
    state: str
    reason: str = ""
    nodes: str = ""
    restarts: int = 0  # how often Slurm has requeued it (the script's SLURM_RESTART_COUNT)

    @property
    def ended(self) -> bool:
        return self.state in ENDED


def parse_job(text: str) -> JobState | None:
    """`scontrol show job -o ID`'s one line as a JobState (None: no such job)."""
    fields = dict(word.split("=", 1) for word in text.split() if "=" in word)
    if "JobState" not in fields:
        return None
    restarts = fields.get("Restarts", "0")
    return JobState(
        fields["JobState"],
        fields.get("Reason", ""),
        fields.get("NodeList", ""),
        int(restarts) if restarts.isdigit() else 0,
    )


def queue_position(squeue: str, job_id: str) -> tuple[int, str] | None:
    """Where job `job_id` is in Slurm's queue (`squeue --noheader --format '%i|%j|%u|%T'`,
    running jobs first, then pending ones in Slurm's order): its position counting the jobs
    ahead of it, and the one just ahead; None when it is not listed."""
    rows = [line.split("|") for line in squeue.splitlines() if line.count("|") == 3]
    rows.sort(key=lambda row: row[3] != "RUNNING")  # stable: Slurm's order within each
    ids = [row[0] for row in rows]
    if job_id not in ids:
        return None
    index = ids.index(job_id)
    if index == 0:
        return 1, ""
    ahead = rows[index - 1]
    return index + 1, f"job {ahead[0]} ({ahead[1]}, {ahead[2]}, {ahead[3].lower()})"
