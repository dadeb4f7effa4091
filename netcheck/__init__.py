"""netcheck: the pre-flight check that the inventory's nodes can train together.

Entry point: `netcheck -i INVENTORY` (netcheck.cli). The run itself is netcheck.preflight;
the judgement of each check is the package netcheck.checks (reach, addressing, software,
traffic); node-side helpers are netcheck.sockprobe, netcheck.softprobe and netcheck.collective;
the launcher reads netcheck.envfile.
"""
