"""The nvidia role's driver per distribution and its fabric manager on NVSwitch systems, checked
on the controller without a GPU: the plan the role makes for a distribution it is told it runs,
the refusal of others, and NVSwitch detection on a fake PCI tree (issue 27)."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from tests.ansible.conftest import ANSIBLE_DIR, PLAYBOOKS, ansible_playbook

LOCAL = ["-c", "local", "-e", f"ansible_python_interpreter={sys.executable}"]
TASKS = ANSIBLE_DIR / "roles" / "nvidia" / "tasks"
CUDA_REPO = "https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/"

UBUNTU_2404 = {"nvidia_distribution": "Ubuntu", "nvidia_distribution_version": "24.04"}
DEBIAN_12 = {"nvidia_distribution": "Debian", "nvidia_distribution_version": "12.7"}


def run(playbook: str, variables: dict):
    return ansible_playbook(
        "localhost,", *LOCAL, "-e", json.dumps(variables), playbook=PLAYBOOKS / playbook
    )


def plan(tmp_path, **variables) -> dict:
    result = tmp_path / "plan.json"
    variables = {
        "nvidia_architecture": "x86_64",
        "nvidia_fabricmanager_required": False,
        "result_file": str(result),
        **variables,
    }
    done = run("nvidia_driver_plan.yml", variables)
    assert done.returncode == 0, done.describe()
    return json.loads(result.read_text())


def refusal(tmp_path, **variables) -> str:
    variables = {"nvidia_architecture": "x86_64", "result_file": str(tmp_path / "p"), **variables}
    done = run("nvidia_driver_plan.yml", {"nvidia_fabricmanager_required": False, **variables})
    assert done.returncode != 0, done.describe()
    assert not (tmp_path / "p").exists()
    return " ".join(done.output.split())


# --- NVIDIA's repositories where the node has them already -----------------------------------

TOOLKIT_REPO = "https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH)"


def kept(tmp_path, name: str, url: str, files: dict[str, str]) -> list[str]:
    sources = tmp_path / "sources.list.d"
    sources.mkdir(parents=True)
    for file_name, text in files.items():
        (sources / file_name).write_text(text)
    result = tmp_path / "kept.json"
    variables = {
        "nvidia_apt_sources_dir": str(sources),
        "nvidia_repository_name": name,
        "nvidia_repository_url": url,
        "result_file": str(result),
    }
    done = run("nvidia_repository.yml", variables)
    assert done.returncode == 0, done.describe()
    return [path.removeprefix(f"{sources}/") for path in json.loads(result.read_text())]


def test_a_repository_from_nvidias_own_install_steps_is_kept_and_none_added_beside_it(tmp_path):
    """apt refuses one address signed by two keys ("Conflicting values set for option
    Signed-By"): where NVIDIA's own steps wrote the toolkit's .list, or cuda-keyring its
    CUDA list, the role keeps that entry and adds none."""
    nvidia_toolkit = (
        "deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] "
        "https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH) /\n"
    )
    cuda_keyring = f"deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] {CUDA_REPO} /\n"
    ours = f"Types: deb\nURIs: {TOOLKIT_REPO}\nSuites: /\n"
    unrelated = "deb http://deb.debian.org/debian bookworm main\n"
    files = {
        "nvidia-container-toolkit.list": nvidia_toolkit,
        "cuda-debian12-x86_64.list": cuda_keyring,
        "nvidia-container-toolkit.sources": ours,  # the role's own, from an earlier run
        "debian.list": unrelated,
    }
    assert kept(tmp_path / "a", "nvidia-container-toolkit", TOOLKIT_REPO, files) == [
        "nvidia-container-toolkit.list"
    ]
    assert kept(tmp_path / "b", "nvidia-cuda", CUDA_REPO, files) == ["cuda-debian12-x86_64.list"]
    # Only the role's own file, or none: the role (re)writes its own.
    alone = {name: files[name] for name in ("nvidia-container-toolkit.sources", "debian.list")}
    assert kept(tmp_path / "c", "nvidia-container-toolkit", TOOLKIT_REPO, alone) == []
    assert kept(tmp_path / "d", "nvidia-cuda", CUDA_REPO, {}) == []


# --- the driver per distribution -------------------------------------------------------------


@pytest.mark.parametrize("version", ["22.04", "24.04"])
def test_ubuntu_gets_its_own_open_server_driver_of_the_branch(tmp_path, version):
    found = plan(tmp_path, nvidia_distribution="Ubuntu", nvidia_distribution_version=version)
    assert found == {
        "release": f"Ubuntu {version}",
        "repository": None,
        "pinning": [],
        "driver": ["nvidia-driver-580-server-open", "nvidia-utils-580-server"],
        "fabricmanager": [],
    }


def test_debian_12_gets_the_open_driver_from_nvidias_cuda_repository_pinned_to_the_branch(
    tmp_path,
):
    # Debian 12's own archive stops at 535, below CUDA 13's 580, and has no *-server packages.
    found = plan(tmp_path, **DEBIAN_12)
    assert found == {
        "release": "Debian 12",
        "repository": {"url": CUDA_REPO, "key": CUDA_REPO + "3bf863cc.pub"},
        "pinning": ["nvidia-driver-pinning-580"],
        "driver": ["nvidia-open"],
        "fabricmanager": [],
    }


def test_the_branch_follows_nvidia_driver_branch_and_arm_servers_use_sbsa(tmp_path):
    ubuntu = plan(tmp_path, **UBUNTU_2404, nvidia_driver_branch="590")
    assert ubuntu["driver"] == ["nvidia-driver-590-server-open", "nvidia-utils-590-server"]
    debian = plan(tmp_path, **DEBIAN_12, nvidia_driver_branch="590", nvidia_architecture="aarch64")
    assert debian["pinning"] == ["nvidia-driver-pinning-590"]
    assert debian["repository"]["url"].endswith("/repos/debian12/sbsa/")


def test_nvswitch_systems_get_the_fabric_manager_of_the_same_branch_and_source(tmp_path):
    ubuntu = plan(tmp_path, **UBUNTU_2404, nvidia_fabricmanager_required=True)
    assert ubuntu["fabricmanager"] == ["nvidia-fabricmanager-580"]
    # NVIDIA's repository has one nvidia-fabricmanager for all branches: the pinning package,
    # installed first, holds it to the driver's branch.
    debian = plan(tmp_path, **DEBIAN_12, nvidia_fabricmanager_required=True)
    assert debian["fabricmanager"] == ["nvidia-fabricmanager"]
    assert debian["pinning"] == ["nvidia-driver-pinning-580"]


@pytest.mark.parametrize(
    "distribution, version, runs",
    [
        ("Debian", "11.9", "Debian 11"),
        ("Debian", "13.1", "Debian 13"),
        ("Ubuntu", "20.04", "Ubuntu 20.04"),
        ("Rocky", "9.4", "Rocky 9"),
    ],
)
def test_other_distributions_are_refused_naming_the_supported_ones(
    tmp_path, distribution, version, runs
):
    said = refusal(tmp_path, nvidia_distribution=distribution, nvidia_distribution_version=version)
    assert (
        "the role installs the NVIDIA driver only on Ubuntu 22.04, Ubuntu 24.04, Debian 12" in said
    )
    assert f"this node runs {runs}" in said
    assert "nvidia_driver_install: false" in said


def test_a_refusal_on_an_nvswitch_system_names_the_fabric_manager(tmp_path):
    said = refusal(
        tmp_path,
        nvidia_distribution="Rocky",
        nvidia_distribution_version="9.4",
        nvidia_fabricmanager_required=True,
    )
    assert "nvidia-fabricmanager of the same version: this node has NVSwitches" in said


def test_a_branch_without_open_kernel_modules_is_refused(tmp_path):
    said = refusal(tmp_path, **UBUNTU_2404, nvidia_driver_branch="535")
    assert "nvidia_driver_branch is 535" in said and 'set nvidia_driver_branch: "580"' in said


def test_the_install_tasks_install_exactly_the_plan_in_order():
    """The plan is what gets installed: repository (unless the node has it from NVIDIA's own
    steps), then pinning, then driver, then fabric manager, which is enabled (started once the
    driver is loaded)."""
    tasks = yaml.safe_load((TASKS / "driver.yml").read_text())
    assert tasks[0]["ansible.builtin.import_tasks"] == "driver_plan.yml"
    look, keep, repo = tasks[1:4]
    assert look["ansible.builtin.import_tasks"] == "repository_decide.yml"
    assert "nvidia_repository_kept | length > 0" in keep["when"]
    assert "nvidia_repository_kept | length == 0" in repo["when"]
    # The running kernel's headers before the driver (DKMS builds its module for that kernel);
    # Secure Boot looked at, and what it asks said.
    installs = [t["ansible.builtin.apt"]["name"] for t in tasks if "ansible.builtin.apt" in t]
    assert installs[0] == "linux-headers-{{ ansible_facts.kernel }}"
    (secure_boot,) = [t for t in tasks if "ansible.builtin.command" in t]
    assert secure_boot["ansible.builtin.command"] == "mokutil --sb-state"
    pin, driver, fabric = [t for t in tasks if "ansible.builtin.apt" in t][1:]
    start = tasks[-1]
    assert fabric["notify"] == driver["notify"] == "Tell that the driver needs a reboot"
    assert repo["ansible.builtin.deb822_repository"]["uris"] == [
        "{{ nvidia_driver_plan.repository.url }}"
    ]
    assert repo["ansible.builtin.deb822_repository"]["signed_by"] == (
        "{{ nvidia_driver_plan.repository.key }}"
    )
    assert pin["ansible.builtin.apt"]["name"] == "{{ nvidia_driver_plan.pinning }}"
    assert driver["ansible.builtin.apt"]["name"] == "{{ nvidia_driver_plan.driver }}"
    assert fabric["ansible.builtin.apt"]["name"] == "{{ nvidia_driver_plan.fabricmanager }}"
    assert start["ansible.builtin.import_tasks"] == "fabricmanager.yml"
    service = yaml.safe_load((TASKS / "fabricmanager.yml").read_text())[1]
    assert (
        service["ansible.builtin.systemd_service"]["name"] == "{{ nvidia_fabricmanager_service }}"
    )
    assert service["ansible.builtin.systemd_service"]["enabled"] is True
    setup = yaml.safe_load((TASKS / "setup.yml").read_text())
    (install,) = [t for t in setup if t.get("ansible.builtin.include_tasks") == "driver.yml"]
    assert install["when"] == "nvidia_driver_install | bool"
    defaults = yaml.safe_load(
        (ANSIBLE_DIR / "roles" / "nvidia" / "defaults" / "main.yml").read_text()
    )
    assert defaults["nvidia_fabricmanager_service"] == "nvidia-fabricmanager"


# --- NVSwitch detection ----------------------------------------------------------------------


def fake_pci(root, devices: dict[str, tuple[str, str]]):
    root.mkdir()
    for address, (vendor, device_class) in devices.items():
        (root / address).mkdir()
        (root / address / "vendor").write_text(vendor + "\n")
        (root / address / "class").write_text(device_class + "\n")
    return root


@pytest.mark.parametrize(
    "devices, gpus, nvswitches",
    [
        (
            {  # a PCIe card box: no switch, no fabric manager
                "0000:41:00.0": ("0x10de", "0x030200"),
                "0000:40:01.1": ("0x1022", "0x060400"),  # AMD PCIe bridge
            },
            ["0000:41:00.0"],
            [],
        ),
        (
            {  # an HGX H100 board, cut short: GPUs, NVSwitches and a Broadcom PCIe switch
                "0000:05:00.0": ("0x10de", "0x068000"),
                "0000:06:00.0": ("0x10de", "0x068000"),
                "0000:18:00.0": ("0x10de", "0x030200"),
                "0000:2a:00.0": ("0x10de", "0x030200"),
                "0000:b9:02.0": ("0x1000", "0x060400"),  # PEX890xx port: not NVIDIA
                "0000:c0:00.0": ("0x1000", "0x068000"),  # another vendor's bridge of 0x0680
            },
            ["0000:18:00.0", "0000:2a:00.0"],
            ["0000:05:00.0", "0000:06:00.0"],
        ),
    ],
    ids=["pcie-gpu", "hgx-with-nvswitches"],
)
def test_nvswitches_are_found_on_the_pci_bus_beside_the_gpus(tmp_path, devices, gpus, nvswitches):
    pci = fake_pci(tmp_path / "pci", devices)
    result = tmp_path / "found.json"
    done = run(
        "nvidia_detect.yml", {"nvidia_pci_devices_dir": str(pci), "result_file": str(result)}
    )
    assert done.returncode == 0, done.describe()
    assert json.loads(result.read_text()) == {
        "gpus": gpus,
        "nvswitches": nvswitches,
        "fabricmanager_required": bool(nvswitches),
    }
