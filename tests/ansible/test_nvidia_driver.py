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


# A stock Debian 12's /etc/apt/sources.list (main and non-free-firmware), and with contrib.
STOCK_DEBIAN = (
    "deb http://deb.debian.org/debian bookworm main non-free-firmware\n"
    "deb http://deb.debian.org/debian-security bookworm-security main non-free-firmware\n"
)
WITH_CONTRIB = STOCK_DEBIAN.replace("main non-free", "main contrib non-free")


def apt_sources(root, sources_list: str = WITH_CONTRIB, files: dict[str, str] | None = None):
    """A fake /etc/apt: its sources.list and sources.list.d, as the role's variables name them."""
    (root / "sources.list.d").mkdir(parents=True, exist_ok=True)
    (root / "sources.list").write_text(sources_list)
    for name, text in (files or {}).items():
        (root / "sources.list.d" / name).write_text(text)
    return {
        "nvidia_apt_sources_list": str(root / "sources.list"),
        "nvidia_apt_sources_dir": str(root / "sources.list.d"),
    }


def plan(tmp_path, **variables) -> dict:
    result = tmp_path / "plan.json"
    variables = {
        "nvidia_architecture": "x86_64",
        "nvidia_fabricmanager_required": False,
        "nvidia_nvlsm_required": False,
        "result_file": str(result),
        **apt_sources(tmp_path / "apt"),
        **variables,
    }
    done = run("nvidia_driver_plan.yml", variables)
    assert done.returncode == 0, done.describe()
    return json.loads(result.read_text())


def refusal(tmp_path, **variables) -> str:
    variables = {
        "nvidia_architecture": "x86_64",
        "nvidia_fabricmanager_required": False,
        "nvidia_nvlsm_required": False,
        "result_file": str(tmp_path / "p"),
        **apt_sources(tmp_path / "apt"),
        **variables,
    }
    done = run("nvidia_driver_plan.yml", variables)
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
def test_ubuntu_gets_its_own_open_server_driver_of_the_branch_compute_only(tmp_path, version):
    """Ubuntu's headless metapackage (no X server, OpenGL or Vulkan pieces: Ubuntu's server
    guide's set for compute), and nvidia-utils for nvidia-smi."""
    found = plan(tmp_path, nvidia_distribution="Ubuntu", nvidia_distribution_version=version)
    assert found == {
        "release": f"Ubuntu {version}",
        "repository": None,
        "pinning": [],
        "driver": ["nvidia-headless-580-server-open", "nvidia-utils-580-server"],
        "fabricmanager": [],
        "nvlsm": [],
    }


def test_debian_12_gets_the_open_driver_from_nvidias_cuda_repository_pinned_to_the_branch(
    tmp_path,
):
    # Debian 12's own archive stops at 535, below CUDA 13's 580, and has no *-server packages.
    # NVIDIA's compute-only (headless) set, as its driver installation guide names it.
    found = plan(tmp_path, **DEBIAN_12)
    assert found == {
        "release": "Debian 12",
        "repository": {"url": CUDA_REPO, "key": CUDA_REPO + "3bf863cc.pub"},
        "pinning": ["nvidia-driver-pinning-580"],
        "driver": ["nvidia-driver-cuda", "nvidia-kernel-open-dkms"],
        "fabricmanager": [],
        "nvlsm": [],
    }


@pytest.mark.parametrize(
    "sources_list, files",
    [
        (WITH_CONTRIB, {}),
        # deb822, as Debian 12's installer may write it, contrib in one stanza's Components
        (
            "",
            {
                "debian.sources": "Types: deb deb-src\nURIs: http://deb.debian.org/debian\n"
                "Suites: bookworm bookworm-updates\nComponents: main contrib non-free-firmware\n"
                "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
                "Types: deb\nURIs: http://deb.debian.org/debian-security\n"
                "Suites: bookworm-security\nComponents: main\n"
            },
        ),
        (
            "",
            {
                "mirror.list": "deb [arch=amd64] http://ftp.de.debian.org/debian bookworm main contrib\n"
            },
        ),
    ],
    ids=["sources.list", "deb822", "sources.list.d"],
)
def test_debian_12_with_contrib_enabled_in_any_form_gets_its_plan(tmp_path, sources_list, files):
    apt = apt_sources(tmp_path / "sources", sources_list, files)
    assert plan(tmp_path, **DEBIAN_12, **apt)["release"] == "Debian 12"


@pytest.mark.parametrize(
    "sources_list, files",
    [
        (STOCK_DEBIAN, {}),
        # contrib only for sources (deb-src), commented out, or in a stanza of deb-src alone
        ("deb-src http://deb.debian.org/debian bookworm main contrib\n", {}),
        ("# deb http://deb.debian.org/debian bookworm main contrib\n" + STOCK_DEBIAN, {}),
        (
            "",
            {
                "debian.sources": "Types: deb-src\nURIs: http://deb.debian.org/debian\n"
                "Suites: bookworm\nComponents: main contrib\n\nTypes: deb\n"
                "URIs: http://deb.debian.org/debian\nSuites: bookworm\nComponents: main\n"
            },
        ),
    ],
    ids=["stock", "deb-src", "commented", "deb822-src-only"],
)
def test_debian_12_without_contrib_is_refused_before_apt_saying_how_to_enable_it(
    tmp_path, sources_list, files
):
    apt = apt_sources(tmp_path / "sources", sources_list, files)
    said = refusal(tmp_path, **DEBIAN_12, **apt)
    assert (
        "NVIDIA's CUDA repository, the driver's source on Debian 12, needs Debian's contrib" in said
    )
    assert "deb http://deb.debian.org/debian bookworm main contrib non-free-firmware" in said
    assert "then run make provision again" in said


def test_the_contrib_check_is_debians_alone(tmp_path):
    """Ubuntu's driver comes from its own archive: its sources are not looked at."""
    apt = apt_sources(tmp_path / "sources", "")
    assert plan(tmp_path, **UBUNTU_2404, **apt)["release"] == "Ubuntu 24.04"


def test_the_branch_follows_nvidia_driver_branch_and_arm_servers_use_sbsa(tmp_path):
    ubuntu = plan(tmp_path, **UBUNTU_2404, nvidia_driver_branch="590")
    assert ubuntu["driver"] == ["nvidia-headless-590-server-open", "nvidia-utils-590-server"]
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


def test_an_nvlink_5_system_gets_nvlsm_beside_the_fabric_manager_on_debian(tmp_path):
    """HGX B200: NVIDIA's NVLink subnet manager (nvlsm) from NVIDIA's CUDA repository, with the
    fabric manager, which starts it."""
    debian = plan(
        tmp_path, **DEBIAN_12, nvidia_fabricmanager_required=True, nvidia_nvlsm_required=True
    )
    assert (debian["fabricmanager"], debian["nvlsm"]) == (["nvidia-fabricmanager"], ["nvlsm"])


def test_an_nvlink_5_system_on_ubuntu_is_refused_naming_nvlsm(tmp_path):
    """Ubuntu's archive, the role's source of the driver there, has no nvlsm."""
    said = refusal(
        tmp_path, **UBUNTU_2404, nvidia_fabricmanager_required=True, nvidia_nvlsm_required=True
    )
    assert "this node is an NVLink 5 system (HGX B200" in said
    assert "needs NVIDIA's NVLink subnet manager (nvlsm)" in said
    assert "Ubuntu 24.04's archive, the role's source of the driver there, has no nvlsm" in said
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
    pin, driver, fabric, nvlsm = [t for t in tasks if "ansible.builtin.apt" in t][1:]
    start = tasks[-1]
    assert fabric["notify"] == driver["notify"] == "Tell that the driver needs a reboot"
    assert nvlsm["ansible.builtin.apt"]["name"] == "{{ nvidia_driver_plan.nvlsm }}"
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
    (service,) = [
        t
        for t in yaml.safe_load((TASKS / "fabricmanager.yml").read_text())
        if "ansible.builtin.systemd_service" in t
    ]
    assert (
        service["ansible.builtin.systemd_service"]["name"] == "{{ nvidia_fabricmanager_service }}"
    )
    assert service["ansible.builtin.systemd_service"]["enabled"] is True
    assert "nvidia_fabricmanager_start" in service["ansible.builtin.systemd_service"]["state"]
    setup = yaml.safe_load((TASKS / "setup.yml").read_text())
    (install,) = [t for t in setup if t.get("ansible.builtin.include_tasks") == "driver.yml"]
    assert install["when"] == "nvidia_driver_install | bool"
    defaults = yaml.safe_load(
        (ANSIBLE_DIR / "roles" / "nvidia" / "defaults" / "main.yml").read_text()
    )
    assert defaults["nvidia_fabricmanager_service"] == "nvidia-fabricmanager"


# --- the fabric manager against the loaded driver ---------------------------------------------

OPEN_580_95 = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  "
    "(dvs-builder@U16-I3-B03-4-3)  Tue Sep 23 09:22:54 UTC 2025\n"
    "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)\n"
)
PROPRIETARY_580_82 = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.82.07  Wed Aug 27 2025\n"
    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
)


def fabricmanager_decision(tmp_path, loaded: str | None, package: str) -> dict:
    version_file = tmp_path / "version"
    if loaded is not None:
        version_file.write_text(loaded)
    result = tmp_path / "decision.json"
    variables = {
        "nvidia_driver_version_file": str(version_file),
        "nvidia_fabricmanager_package_version": package,
        "result_file": str(result),
    }
    done = run("nvidia_fabricmanager.yml", variables)
    assert done.returncode == 0, done.describe()
    return json.loads(result.read_text())


@pytest.mark.parametrize(
    "loaded, package",
    [
        (OPEN_580_95, "580.95.05-0ubuntu0.24.04.1"),  # Ubuntu's archive
        (PROPRIETARY_580_82, "580.82.07-1"),  # NVIDIA's repository
    ],
)
def test_the_fabric_manager_starts_where_its_own_driver_version_is_loaded(
    tmp_path, loaded, package
):
    found = fabricmanager_decision(tmp_path, loaded, package)
    assert found["start"] is True and found["wait"] == ""
    assert found["loaded"] == found["package"] == package.split("-")[0]


def test_after_a_driver_upgrade_before_the_reboot_it_says_reboot_first_instead_of_failing(
    tmp_path,
):
    """The old driver stays loaded until the reboot; nvidia-fabricmanager of the new version
    would refuse to start, and the play (any_errors_fatal) would stop on every node."""
    found = fabricmanager_decision(tmp_path, PROPRIETARY_580_82, "580.95.05-1")
    assert found["start"] is False
    assert found["wait"] == (
        "localhost: the loaded NVIDIA driver is 580.82.07 and the installed fabric manager "
        "580.95.05 (a driver upgraded, not yet rebooted into): the fabric manager runs only with "
        "its own version of the driver, so it was enabled but not started: reboot first, and it "
        "starts then."
    )


def test_with_no_driver_loaded_the_fabric_manager_waits_for_the_reboot_quietly(tmp_path):
    """A first install: the handler already says to reboot; the unit, enabled, starts then."""
    found = fabricmanager_decision(tmp_path, None, "580.95.05-1")
    assert (found["loaded"], found["start"], found["wait"]) == ("", False, "")


# --- NVSwitch detection ----------------------------------------------------------------------


def fake_pci(root, devices: dict[str, tuple[str, ...]]):
    """A fake /sys/bus/pci/devices: (vendor, class) per address, and the PCI device id where
    given third."""
    root.mkdir()
    for address, (vendor, device_class, *device) in devices.items():
        (root / address).mkdir()
        (root / address / "vendor").write_text(vendor + "\n")
        (root / address / "class").write_text(device_class + "\n")
        if device:
            (root / address / "device").write_text(device[0] + "\n")
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
        (
            {  # an HGX B200 board, cut short: its switches sit behind ConnectX bridge functions
                "0000:18:00.0": ("0x10de", "0x030200", "0x2901"),
                "0000:2a:00.0": ("0x10de", "0x030200", "0x2901"),
                "0000:1a:00.0": ("0x15b3", "0x020700", "0x1021"),  # Mellanox function
            },
            ["0000:18:00.0", "0000:2a:00.0"],
            [],
        ),
    ],
    ids=["pcie-gpu", "hgx-with-nvswitches", "hgx-b200"],
)
def test_nvswitches_are_found_on_the_pci_bus_beside_the_gpus(tmp_path, devices, gpus, nvswitches):
    """And an NVLink 5 baseboard by its GPUs' device id: it needs the fabric manager and NVIDIA's
    NVLink subnet manager though no switch shows on the PCI bus."""
    pci = fake_pci(tmp_path / "pci", devices)
    result = tmp_path / "found.json"
    done = run(
        "nvidia_detect.yml", {"nvidia_pci_devices_dir": str(pci), "result_file": str(result)}
    )
    assert done.returncode == 0, done.describe()
    nvlink5 = any(device[2:] == ("0x2901",) for device in devices.values())
    assert json.loads(result.read_text()) == {
        "gpus": gpus,
        "nvswitches": nvswitches,
        "fabricmanager_required": bool(nvswitches) or nvlink5,
        "nvlsm_required": nvlink5,
    }
