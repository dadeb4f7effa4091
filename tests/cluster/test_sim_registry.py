"""A simulated cluster taken down leaves no registry instance set up for its address: a later
cluster given the same address (a worker's band of subnets starts again, or another run on the
same machine) must not find one that does not answer."""

from __future__ import annotations

from torch_multinode.provision import ship
from torch_multinode.sim import nodes


def test_taking_a_cluster_down_removes_its_registry_instances_settings_and_no_other(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(ship, "REGISTRY_DIR", tmp_path)
    (tmp_path / "server").mkdir()
    ours = "torch-multinode-registry-192-0-2-1-5000"
    other = "torch-multinode-registry-192-0-2-10-5000"  # an address that begins the same
    for name in (ours, other):
        (tmp_path / f"{name}.yml").write_text("version: 0.1\n")
        (tmp_path / f"{name}.crt").write_text("cert\n")
        (tmp_path / "server" / f"{name}.key").write_text("key\n")
    (tmp_path / "ca.crt").write_text("the CA every instance shares\n")

    nodes._stop_registries("192.0.2.1")

    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == [
        "ca.crt",
        f"server/{other}.key",
        f"{other}.crt",
        f"{other}.yml",
    ]
