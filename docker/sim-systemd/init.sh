#!/bin/sh
# What a real host has before its init starts: its own SSH host keys, and cgroup hierarchies
# it may write (Docker mounts a container's read-only; systemd and a Docker engine inside need
# to create groups). Then systemd, as PID 1.
# SIM_AUTHORIZED_KEY: the controller's key for root. SIM_LINKS: network interfaces the node
# owns (sim/owned_network.py plugs them in after the start): waited for, as a real host's NICs
# are there before its init, and /sys made writable, as a real host's is (netplan apply
# triggers udev through it).
set -eu
[ -s /etc/ssh/ssh_host_ed25519_key ] || ssh-keygen -A >/dev/null
if [ -n "${SIM_AUTHORIZED_KEY:-}" ]; then
    mkdir -p /root/.ssh && chmod 700 /root/.ssh
    grep -qxF "$SIM_AUTHORIZED_KEY" /root/.ssh/authorized_keys 2>/dev/null \
        || printf '%s\n' "$SIM_AUTHORIZED_KEY" >> /root/.ssh/authorized_keys
    chmod 600 /root/.ssh/authorized_keys
fi
for link in ${SIM_LINKS:-}; do
    waited=0
    until ip link show "$link" >/dev/null 2>&1; do
        [ "$waited" -lt 600 ] || { echo "sim-systemd: no $link after 60 s" >&2; break; }
        sleep 0.1
        waited=$((waited + 1))
    done
done
[ -z "${SIM_LINKS:-}" ] || mount -o remount,rw /sys
if [ -d /sys/fs/cgroup/cpuset ] && ! mkdir /sys/fs/cgroup/cpuset/.rw-probe 2>/dev/null; then
    # docker/sim-node/entrypoint.sh's remount, systemd's named hierarchy included: every
    # cgroup v1 hierarchy mounted again read-write.
    grep -E '^(cgroup|systemd) /sys/fs/cgroup/' /proc/self/mounts | while read -r _ path _ options _; do
        controllers=$(echo "$options" | tr ',' '\n' \
            | grep -vxE 'ro|rw|nosuid|nodev|noexec|relatime' | paste -sd, -)
        case "$controllers" in name=*) controllers="none,$controllers" ;; esac
        echo "$path $controllers"
    done > /run/sim-cgroups
    mount -t tmpfs -o mode=755 cgroup_root /sys/fs/cgroup
    while read -r path controllers; do
        mkdir -p "$path" && mount -t cgroup -o "$controllers" cgroup "$path"
    done < /run/sim-cgroups
else
    rmdir /sys/fs/cgroup/cpuset/.rw-probe 2>/dev/null || true
fi
exec /lib/systemd/systemd
