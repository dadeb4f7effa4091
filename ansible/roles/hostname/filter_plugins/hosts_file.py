"""The /etc/hosts edit: one marked block of ours, every other entry kept.

A name of ours that appears on another line (the installer's `127.0.1.1 pc1`, a stale
address) would win or tie in lookups, and a node's own name on loopback is the classic cause
of gloo/NCCL connecting to 127.0.1.1. So our names are removed from every other line, and a
line left with no names is dropped. Applying the edit to its own output changes nothing.
"""

from __future__ import annotations

from ansible.errors import AnsibleFilterError


def hosts_file(current, entries, marker):
    """New /etc/hosts text from `current`, with `entries` ([address, name] pairs) as our block.

    The block keeps its place when it exists, and is appended otherwise.
    """
    begin, end = f"# BEGIN {marker}", f"# END {marker}"
    ours = {str(name).lower() for _, name in entries}
    block = [begin, *(f"{address}\t{name}" for address, name in entries), end]
    lines: list[str] = []
    inside = placed = False
    for line in str(current).splitlines():
        stripped = line.strip()
        if stripped == begin:
            if inside:
                raise AnsibleFilterError(f"/etc/hosts: '{begin}' appears twice without '{end}'")
            inside = True
            if not placed:
                lines.extend(block)
                placed = True
            continue
        if inside:
            inside = stripped != end
            continue
        lines.extend(_without_our_names(line, ours))
    if inside:
        raise AnsibleFilterError(f"/etc/hosts: '{begin}' has no '{end}' after it; fix by hand")
    if not placed:
        lines.extend(block)
    return "\n".join(lines) + "\n"


def _without_our_names(line, ours):
    """The line as it was, the line minus our names, or nothing when no name is left."""
    content, hash_mark, comment = line.partition("#")
    fields = content.split()
    if len(fields) < 2 or not any(name.lower() in ours for name in fields[1:]):
        return [line]
    kept = [name for name in fields[1:] if name.lower() not in ours]
    if not kept:
        return []
    rebuilt = f"{fields[0]}\t{' '.join(kept)}"
    return [f"{rebuilt} {hash_mark}{comment}" if hash_mark else rebuilt]


class FilterModule:
    def filters(self):
        return {"hosts_file": hosts_file}
