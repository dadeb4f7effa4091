#!/bin/sh
# First start of a simulated node: its own SSH host keys, the controller's public key, sshd.
set -eu
[ -s /etc/ssh/ssh_host_ed25519_key ] || ssh-keygen -A >/dev/null
if [ -n "${SIM_AUTHORIZED_KEY:-}" ] && ! grep -qxF "$SIM_AUTHORIZED_KEY" /root/.ssh/authorized_keys 2>/dev/null; then
    printf '%s\n' "$SIM_AUTHORIZED_KEY" >> /root/.ssh/authorized_keys
fi
chmod 600 /root/.ssh/authorized_keys 2>/dev/null || true
mkdir -p /run/sshd
exec /usr/sbin/sshd -D -e
