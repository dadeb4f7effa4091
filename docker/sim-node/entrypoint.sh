#!/bin/sh
# Boot of a simulated node, doing what a real host's init would: its own SSH host keys, the
# controller's public key, writable cgroups and (once installed) the Docker engine, then sshd.
set -eu
[ -s /etc/ssh/ssh_host_ed25519_key ] || ssh-keygen -A >/dev/null
if [ -n "${SIM_AUTHORIZED_KEY:-}" ] && ! grep -qxF "$SIM_AUTHORIZED_KEY" /root/.ssh/authorized_keys 2>/dev/null; then
    printf '%s\n' "$SIM_AUTHORIZED_KEY" >> /root/.ssh/authorized_keys
fi
chmod 600 /root/.ssh/authorized_keys 2>/dev/null || true

# A real host keeps /etc/hosts and /etc/hostname across a reboot, and its init sets the host
# name from /etc/hostname. Docker bind-mounts fresh copies of both at every start, so a node
# restarted after `docker kill` lost the names provisioning gave it (netcheck: "node2 cannot
# resolve node1"). On its first boot the node takes Docker's copies as its own files, in its
# root filesystem; from then on it keeps them, as a disk would.
for name in hosts hostname; do
    grep -q " /etc/$name " /proc/self/mountinfo || continue
    docker_copy=$(cat "/etc/$name")
    umount "/etc/$name" || { echo "sim-node: /etc/$name stays Docker's" >&2; continue; }
    if [ ! -e "/var/lib/sim-node/own-$name" ]; then
        printf '%s\n' "$docker_copy" > "/etc/$name"
        mkdir -p /var/lib/sim-node && touch "/var/lib/sim-node/own-$name"
    fi
done
if [ -s /etc/hostname ]; then
    hostname "$(cat /etc/hostname)"
fi

# FRESH=1: the node as a fresh Debian install leaves it. The installer's user, in the sudo
# group (sudo asks for the password, which the simulator sets through chpasswd's standard
# input), SSH password login on (Debian's default), and no key anywhere.
if [ -n "${SIM_FRESH_USER:-}" ]; then
    id "$SIM_FRESH_USER" >/dev/null 2>&1 || useradd -m -s /bin/bash -G sudo "$SIM_FRESH_USER"
    printf '%s\n' 'PermitRootLogin prohibit-password' 'PasswordAuthentication yes' \
        'KbdInteractiveAuthentication no' 'UseDNS no' > /etc/ssh/sshd_config.d/sim-node.conf
fi

# Docker mounts the container's cgroup hierarchies read-only; a Docker engine inside the node
# must create cgroups for its containers, as it can on a real host. Mount the node's own
# (private cgroup namespace) hierarchies again, read-write, with the same controllers.
# The named systemd hierarchy too (Docker calls its device "systemd"): a real host has it, and
# without it runc makes /sys/fs/cgroup/systemd a plain directory on the tmpfs.
if [ -d /sys/fs/cgroup/cpuset ] && ! mkdir /sys/fs/cgroup/cpuset/.rw-probe 2>/dev/null; then
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

# ufw's unit loads the firewall's rules at boot on a real host, once provisioning enabled it.
if [ -x /lib/ufw/ufw-init ] && grep -qs '^ENABLED=yes' /etc/ufw/ufw.conf; then
    /lib/ufw/ufw-init start >/dev/null 2>&1 || echo "sim-node: ufw's rules did not load" >&2
fi

# A host with Docker installed starts it at boot; provisioning installs it. A real boot starts
# with an empty /run (a tmpfs); a container restarted after `docker kill` keeps the engine's pid
# files, and a new dockerd that happens to get the PID written there refuses to start ("pid file
# found"): clear what the killed engine left, as a boot would.
if command -v dockerd >/dev/null 2>&1 && ! pgrep -x dockerd >/dev/null; then
    rm -rf /var/run/docker.pid /var/run/docker-ssd.pid /var/run/docker /run/containerd
    dockerd >>/var/log/dockerd.log 2>&1 &
fi

mkdir -p /run/sshd
exec /usr/sbin/sshd -D -e
