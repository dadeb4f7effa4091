# A systemd-booted host with one network stack from Debian's packages (PACKAGES: netplan.io,
# network-manager or ifupdown, and what each needs), for the static_ip role's tests
# (sim/owned_network.py). Every stack starts with no configuration of the compute NIC.
ARG BASE=torch-multinode/sim-systemd:test
FROM ${BASE}
ARG PACKAGES
RUN if [ -n "${PACKAGES}" ]; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${PACKAGES} \
        && apt-get clean && rm -rf /var/lib/apt/lists/*; \
    fi
