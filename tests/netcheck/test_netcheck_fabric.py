"""NVSwitch systems without a running fabric manager (issue 27): the node probe's findings on a
fake /sys and /proc, and the software check's FAIL naming the node and the remedy."""

from __future__ import annotations

import pytest

from tests.netcheck.netcheck_fakes import inventory
from torch_multinode.netcheck import softprobe
from torch_multinode.netcheck.checks import software
from torch_multinode.netcheck.report import Status

INV = inventory()
N1, N2, _ = INV.hosts
REMEDY = (
    "on {node}: make provision with nvidia_driver_install: true (it installs and starts the "
    "fabric manager of the driver's branch), or install nvidia-fabricmanager-580 of the "
    "driver's exact version (580.95.05) and start it (systemctl enable --now "
    "nvidia-fabricmanager)"
)


def probe(**change):
    base = {
        "python": "3.11.2",
        "torch": "2.14.1",
        "cuda": "13.0",
        "nccl": "2.30.7",
        "gloo": True,
        "netcheck": True,
        "gpus": 0,
        "shm_bytes": 1 << 30,
        "memlock_bytes": -1,
        "cuda_available": False,
        "nccl_backend": True,
        "driver": "580.95.05",
        "nvidia_smi_gpus": 0,
        "nvswitches": 0,
        "fabricmanager": None,
        "fabric_states": None,
    }
    base.update(change)
    return base


def software_check(*probes):
    hosts = [N1, N2][: len(probes)]
    return software.software_findings(
        hosts, {h.name: p for h, p in zip(hosts, probes, strict=True)}, N1
    )


def on(found, node):
    return [f for f in found if f.node == node]


# --- the probe -------------------------------------------------------------------------------


def fake_pci(root, devices):
    for address, (vendor, device_class) in devices.items():
        (root / address).mkdir(parents=True)
        (root / address / "vendor").write_text(vendor + "\n")
        (root / address / "class").write_text(device_class + "\n")
    return root


def fake_proc(root, commands):
    root.mkdir()
    for pid, comm in commands.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "comm").write_text(comm + "\n")
    (root / "self").mkdir()  # not a pid: ignored
    return root


def test_nvswitches_are_counted_by_nvidia_vendor_and_bridge_class(tmp_path):
    pci = fake_pci(
        tmp_path / "pci",
        {
            "0000:05:00.0": ("0x10de", "0x068000"),  # H100 NVSwitch
            "0000:06:00.0": ("0x10de", "0x068000"),
            "0000:18:00.0": ("0x10de", "0x030200"),  # H100 SXM GPU
            "0000:b9:02.0": ("0x1000", "0x060400"),  # Broadcom PCIe switch port
            "0000:c0:00.0": ("0x8086", "0x068000"),  # another vendor's "other bridge"
        },
    )
    (pci / "0000:07:00.0").mkdir()  # unreadable: no vendor/class files
    assert softprobe.nvswitch_count(str(pci)) == 2
    assert softprobe.nvswitch_count(str(tmp_path / "absent")) == 0


def test_a_running_fabric_manager_is_seen_by_its_process_name(tmp_path):
    # /proc/PID/comm holds 15 characters: nv-fabricmanager shows as nv-fabricmanage.
    proc = fake_proc(tmp_path / "proc", {1: "systemd", 4242: "nv-fabricmanage"})
    assert softprobe.fabricmanager_running(str(proc)) is True


def test_without_the_process_or_systemd_the_probe_says_it_cannot_tell(tmp_path, monkeypatch):
    proc = fake_proc(tmp_path / "proc", {1: "tini", 7: "python3"})
    monkeypatch.setattr(softprobe.os.path, "isdir", lambda path: False)  # no /run/systemd/system
    assert softprobe.fabricmanager_running(str(proc)) is None


def test_systemd_decides_where_the_process_is_not_seen(tmp_path, monkeypatch):
    proc = fake_proc(tmp_path / "proc", {1: "systemd"})
    answers = []

    def systemctl(argv, **kwargs):
        answers.append(argv)
        return softprobe.subprocess.CompletedProcess(argv, 3, stdout="inactive\n", stderr="")

    monkeypatch.setattr(softprobe.os.path, "isdir", lambda path: path == "/run/systemd/system")
    monkeypatch.setattr(softprobe.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(softprobe.subprocess, "run", systemctl)
    assert softprobe.fabricmanager_running(str(proc)) is False
    assert answers == [["systemctl", "is-active", "nvidia-fabricmanager"]]


def test_fabric_states_are_read_from_nvidia_smi_and_unknown_fields_give_none():
    text = "Completed, Success\nIn Progress, N/A\n[N/A], [N/A]\n"
    assert softprobe.fabric_states(text) == [
        ["Completed", "Success"],
        ["In Progress", "N/A"],
        ["N/A", "N/A"],
    ]
    assert softprobe.fabric_states('Field "fabric.state" is not a valid field to query.\n') is None


def test_a_node_without_nvswitches_asks_nothing_more(tmp_path, monkeypatch):
    monkeypatch.setattr(softprobe.shutil, "which", lambda name: pytest.fail("nvidia-smi asked"))
    found = softprobe.fabric(str(fake_pci(tmp_path / "pci", {})), str(tmp_path / "proc"))
    assert found == {"nvswitches": 0, "fabricmanager": None, "fabric_states": None}


# --- the software check ----------------------------------------------------------------------


def test_an_nvswitch_node_without_its_fabric_manager_fails_naming_node_and_remedy():
    found = software_check(
        probe(nvswitches=4, fabricmanager=False),
        probe(nvswitches=4, fabricmanager=True, fabric_states=[["Completed", "Success"]] * 2),
    )
    (fail,) = on(found, "node1")
    assert fail.status is Status.FAIL and fail.check == "software"
    assert fail.detail == (
        "node1 has 4 NVSwitch(es) but no fabric manager runs (nv-fabricmanager; systemd: "
        "nvidia-fabricmanager inactive): its GPUs stay uninitialised (CUDA error 802, system "
        "not yet initialized)"
    )
    assert fail.remedy == REMEDY.format(node="node1")
    (ok,) = on(found, "node2")
    assert ok.status is Status.PASS


def test_in_a_container_the_gpus_fabric_registration_names_the_missing_fabric_manager():
    # The probe in the training image sees neither the host's processes nor its systemd.
    states = [["Completed", "Success"], ["Not Started", "N/A"], ["In Progress", "N/A"]]
    (fail,) = on(software_check(probe(nvswitches=4, fabric_states=states)), "node1")
    assert fail.detail.startswith(
        "node1 has 4 NVSwitch(es) but the GPUs' fabric registration is not complete "
        "(GPU 1 Not Started, GPU 2 In Progress)"
    )
    assert fail.remedy == REMEDY.format(node="node1")


def test_gpus_torch_cannot_see_behind_nvswitches_point_at_the_fabric_manager():
    # A100 boards report no fabric state; torch sees no GPU (error 802) while nvidia-smi lists 8.
    found = software_check(probe(nvswitches=6, nvidia_smi_gpus=8, gpus=0, fabric_states=None))
    details = [f.detail for f in on(found, "node1")]
    assert (
        "node1 has 6 NVSwitch(es) but torch sees none of the 8 GPU(s) nvidia-smi lists (is "
        "nvidia-fabricmanager running?): its GPUs stay uninitialised (CUDA error 802, system "
        "not yet initialized)"
    ) in details


def test_a_fabric_registration_that_completed_with_a_failure_is_named_with_its_status():
    # An H100 node as some report it: State Completed, Status Insufficient Resources.
    states = [["Completed", "Success"], ["Completed", "Insufficient Resources"]]
    found = software_check(probe(nvswitches=4, fabricmanager=True, fabric_states=states))
    (fail,) = on(found, "node1")
    assert fail.status is Status.FAIL
    assert fail.detail == (
        "node1 has 4 NVSwitch(es) but the GPUs' fabric registration failed (GPU 1 Insufficient "
        "Resources): NCCL cannot use NVLink across them"
    )
    assert fail.remedy.startswith("on node1: journalctl -u nvidia-fabricmanager says why")


@pytest.mark.parametrize(
    "change",
    [
        {"nvswitches": 0, "fabricmanager": False},  # no switch: no fabric manager needed
        {"nvswitches": 4, "fabricmanager": True},
        {"nvswitches": 4, "fabric_states": [["Completed", "Success"]]},  # container, all well
        # Every GPU registered though neither its process nor systemd's unit was seen (a /proc
        # mounted with hidepid, a service under another name): a fabric manager ran.
        {"nvswitches": 4, "fabricmanager": False, "fabric_states": [["Completed", "Success"]]},
        {},  # a probe from before this field existed
    ],
    ids=["no-nvswitch", "running", "registered", "registered-unseen", "old-probe"],
)
def test_no_fabric_manager_finding_where_none_is_needed_or_it_runs(change):
    found = software_check(probe(**change) if change else {**probe(), "nvswitches": None})
    assert [f.status for f in on(found, "node1")] == [Status.PASS]


def test_without_a_driver_version_the_remedy_names_the_package_without_a_branch():
    (fail,) = on(software_check(probe(nvswitches=2, fabricmanager=False, driver=None)), "node1")
    assert "or install nvidia-fabricmanager of the driver's exact version and start it" in (
        fail.remedy
    )
