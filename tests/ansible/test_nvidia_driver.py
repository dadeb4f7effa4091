"""The nvidia role's driver per distribution and its fabric manager on NVSwitch systems, checked
on the controller without a GPU: the plan the role makes for a distribution it is told it runs,
the refusal of others, and NVSwitch detection on a fake PCI tree (issue 27).

Each test playbook runs once for all of its cases (ansible-playbook's start costs seconds of
CPU): every case is a host of its own in one inventory, all of them this machine (connection
local), with its variables in a file of its own that the playbook includes (include_vars
outranks the role's defaults, as -e would) and any files it needs in its own directory. A test
reads its own host's outcome: what it found in the run's results file, by host, where the host
ran to the end; for a refusal, that it failed (ansible.posix.json's report), wrote no result,
and what its failed task said."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ansible.conftest import ANSIBLE_DIR, PLAYBOOKS, PlaybookRun, ansible_playbook

LOCAL = ["-c", "local", "-e", f"ansible_python_interpreter={sys.executable}"]
TASKS = ANSIBLE_DIR / "roles" / "nvidia" / "tasks"
CUDA_REPO = "https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/"

UBUNTU_2404 = {"nvidia_distribution": "Ubuntu", "nvidia_distribution_version": "24.04"}
DEBIAN_12 = {"nvidia_distribution": "Debian", "nvidia_distribution_version": "12.7"}


@dataclass
class Batch:
    """One ansible-playbook run over many cases, each its own host with files of its own in
    root/HOST; what each host that ran to the end found, by host, in root/results.json."""

    root: Path
    run: PlaybookRun
    report: dict[str, Any]  # ansible.posix.json's document; {} where there is none

    def dir(self, host: str) -> Path:
        return self.root / host

    @property
    def written(self) -> dict[str, Any]:
        results = self.root / "results.json"
        return json.loads(results.read_text()) if results.exists() else {}

    def stats(self, host: str) -> dict[str, int] | None:
        return self.report.get("stats", {}).get(host)

    def results(self, host: str) -> list[tuple[str, dict]]:
        """(task name, result) of every task the host ran, in order."""
        return [
            (task["task"]["name"], task["hosts"][host])
            for play in self.report.get("plays", [])
            for task in play["tasks"]
            if host in task["hosts"]
        ]

    def describe(self, host: str) -> str:
        lines = [
            f"$ {' '.join(self.run.command)}",
            f"(exit {self.run.returncode}, {self.run.seconds:.0f} s; host {host}: "
            f"{self.stats(host)})",
        ]
        if not self.report:
            lines.append(self.run.output[-6000:])
        lines += [f"{name}: {json.dumps(result)[:3000]}" for name, result in self.results(host)]
        return "\n".join(lines)

    def result(self, host: str) -> Any:
        """What a case that succeeds wrote: its host ran to the end, failing nowhere (a run of
        its own would have exited 0)."""
        stats = self.stats(host)
        ran_to_the_end = stats is not None and stats["failures"] == stats["unreachable"] == 0
        assert ran_to_the_end, self.describe(host)
        written = self.written
        assert host in written, self.describe(host)
        return written[host]

    def refusal(self, host: str) -> str:
        """What a refused case said: its host failed (a run of its own would have exited
        non-zero) and wrote no result; its failed tasks' messages, whitespace joined."""
        stats = self.stats(host)
        failed = stats is not None and stats["failures"] + stats["unreachable"] > 0
        assert failed, self.describe(host)
        assert host not in self.written, self.describe(host)
        said = [
            str(result.get("msg", ""))
            for _, result in self.results(host)
            if result.get("failed") or result.get("unreachable")
        ]
        return " ".join(" ".join(said).split())


def run_batch(root: Path, playbook: str, cases: dict[str, dict]) -> Batch:
    """`playbook` once over an inventory of the cases, each its own host, its variables in
    root/HOST/case.json (the playbook includes them). A failing host does not stop the others."""
    hosts = {}
    for host, variables in cases.items():
        (root / host).mkdir(exist_ok=True)
        case_file = root / host / "case.json"
        case_file.write_text(json.dumps(variables))
        hosts[host] = {"test_case_file": str(case_file)}
    inventory = root / "inventory.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": hosts}}, sort_keys=False))
    result_file = ["-e", f"result_file={root / 'results.json'}"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ANSIBLE_STDOUT_CALLBACK", "ansible.posix.json")
        done = ansible_playbook(inventory, *LOCAL, *result_file, playbook=PLAYBOOKS / playbook)
    try:  # stdout is the one JSON document; what came on stderr follows it
        report, _ = json.JSONDecoder().raw_decode(done.output.lstrip())
    except ValueError:
        report = {}
    return Batch(root, done, report)


def case_dir(root: Path, host: str) -> Path:
    """The case's own directory (its case.json and any files it needs)."""
    (root / host).mkdir()
    return root / host


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


# --- NVIDIA's repositories where the node has them already -----------------------------------

TOOLKIT_REPO = "https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH)"

NVIDIA_TOOLKIT_LIST = (
    "deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] "
    "https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH) /\n"
)
CUDA_KEYRING_LIST = f"deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] {CUDA_REPO} /\n"
SOURCES_D = {
    "nvidia-container-toolkit.list": NVIDIA_TOOLKIT_LIST,
    "cuda-debian12-x86_64.list": CUDA_KEYRING_LIST,
    # the role's own, from an earlier run
    "nvidia-container-toolkit.sources": f"Types: deb\nURIs: {TOOLKIT_REPO}\nSuites: /\n",
    "debian.list": "deb http://deb.debian.org/debian bookworm main\n",
}
# Only the role's own file, or none.
ALONE = {name: SOURCES_D[name] for name in ("nvidia-container-toolkit.sources", "debian.list")}

# host: (nvidia_repository_name, nvidia_repository_url, the files in sources.list.d)
REPOSITORY_CASES: dict[str, tuple[str, str, dict[str, str]]] = {
    "toolkit": ("nvidia-container-toolkit", TOOLKIT_REPO, SOURCES_D),
    "cuda": ("nvidia-cuda", CUDA_REPO, SOURCES_D),
    "toolkit-alone": ("nvidia-container-toolkit", TOOLKIT_REPO, ALONE),
    "cuda-none": ("nvidia-cuda", CUDA_REPO, {}),
}


@pytest.fixture(scope="module")
def repositories(tmp_path_factory) -> Batch:
    root = tmp_path_factory.mktemp("repositories")
    cases = {}
    for host, (name, url, files) in REPOSITORY_CASES.items():
        sources = case_dir(root, host) / "sources.list.d"
        sources.mkdir()
        for file_name, text in files.items():
            (sources / file_name).write_text(text)
        cases[host] = {
            "nvidia_apt_sources_dir": str(sources),
            "nvidia_repository_name": name,
            "nvidia_repository_url": url,
        }
    return run_batch(root, "nvidia_repository.yml", cases)


def kept(repositories: Batch, host: str) -> list[str]:
    sources = repositories.dir(host) / "sources.list.d"
    return [path.removeprefix(f"{sources}/") for path in repositories.result(host)]


def test_a_repository_from_nvidias_own_install_steps_is_kept_and_none_added_beside_it(
    repositories,
):
    """apt refuses one address signed by two keys ("Conflicting values set for option
    Signed-By"): where NVIDIA's own steps wrote the toolkit's .list, or cuda-keyring its
    CUDA list, the role keeps that entry and adds none."""
    assert kept(repositories, "toolkit") == ["nvidia-container-toolkit.list"]
    assert kept(repositories, "cuda") == ["cuda-debian12-x86_64.list"]
    # Only the role's own file, or none: the role (re)writes its own.
    assert kept(repositories, "toolkit-alone") == []
    assert kept(repositories, "cuda-none") == []


# --- the driver per distribution -------------------------------------------------------------

UBUNTU_VERSIONS = ["22.04", "24.04"]

# Debian 12 with contrib enabled, each form: (sources.list, files in sources.list.d)
CONTRIB_FORMS: dict[str, tuple[str, dict[str, str]]] = {
    "sources.list": (WITH_CONTRIB, {}),
    # deb822, as Debian 12's installer may write it, contrib in one stanza's Components
    "deb822": (
        "",
        {
            "debian.sources": "Types: deb deb-src\nURIs: http://deb.debian.org/debian\n"
            "Suites: bookworm bookworm-updates\nComponents: main contrib non-free-firmware\n"
            "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
            "Types: deb\nURIs: http://deb.debian.org/debian-security\n"
            "Suites: bookworm-security\nComponents: main\n"
        },
    ),
    "sources.list.d": (
        "",
        {"mirror.list": "deb [arch=amd64] http://ftp.de.debian.org/debian bookworm main contrib\n"},
    ),
}

# ... and without: stock, or contrib only for sources (deb-src), commented out, or in a stanza
# of deb-src alone
NO_CONTRIB_FORMS: dict[str, tuple[str, dict[str, str]]] = {
    "stock": (STOCK_DEBIAN, {}),
    "deb-src": ("deb-src http://deb.debian.org/debian bookworm main contrib\n", {}),
    "commented": ("# deb http://deb.debian.org/debian bookworm main contrib\n" + STOCK_DEBIAN, {}),
    "deb822-src-only": (
        "",
        {
            "debian.sources": "Types: deb-src\nURIs: http://deb.debian.org/debian\n"
            "Suites: bookworm\nComponents: main contrib\n\nTypes: deb\n"
            "URIs: http://deb.debian.org/debian\nSuites: bookworm\nComponents: main\n"
        },
    ),
}

# (nvidia_distribution, nvidia_distribution_version, the release the refusal names)
OTHER_DISTRIBUTIONS = [
    ("Debian", "11.9", "Debian 11"),
    ("Debian", "13.1", "Debian 13"),
    ("Ubuntu", "20.04", "Ubuntu 20.04"),
    ("Rocky", "9.4", "Rocky 9"),
]


@dataclass
class PlanCase:
    variables: dict[str, Any]
    sources_list: str = WITH_CONTRIB  # the fake /etc/apt's
    files: dict[str, str] = field(default_factory=dict)


PLAN_CASES: dict[str, PlanCase] = {
    **{
        f"ubuntu-{version}": PlanCase(
            {"nvidia_distribution": "Ubuntu", "nvidia_distribution_version": version}
        )
        for version in UBUNTU_VERSIONS
    },
    "debian-12": PlanCase(DEBIAN_12),
    **{f"contrib-{form}": PlanCase(DEBIAN_12, *apt) for form, apt in CONTRIB_FORMS.items()},
    **{f"no-contrib-{form}": PlanCase(DEBIAN_12, *apt) for form, apt in NO_CONTRIB_FORMS.items()},
    "ubuntu-no-sources": PlanCase(UBUNTU_2404, ""),
    "ubuntu-branch-590": PlanCase({**UBUNTU_2404, "nvidia_driver_branch": "590"}),
    "debian-branch-590-arm": PlanCase(
        {**DEBIAN_12, "nvidia_driver_branch": "590", "nvidia_architecture": "aarch64"}
    ),
    "ubuntu-nvswitch": PlanCase({**UBUNTU_2404, "nvidia_fabricmanager_required": True}),
    "debian-nvswitch": PlanCase({**DEBIAN_12, "nvidia_fabricmanager_required": True}),
    **{
        f"other-{distribution}-{version}": PlanCase(
            {"nvidia_distribution": distribution, "nvidia_distribution_version": version}
        )
        for distribution, version, _ in OTHER_DISTRIBUTIONS
    },
    "debian-nvlink5": PlanCase(
        {**DEBIAN_12, "nvidia_fabricmanager_required": True, "nvidia_nvlsm_required": True}
    ),
    "ubuntu-nvlink5": PlanCase(
        {**UBUNTU_2404, "nvidia_fabricmanager_required": True, "nvidia_nvlsm_required": True}
    ),
    "rocky-nvswitch": PlanCase(
        {
            "nvidia_distribution": "Rocky",
            "nvidia_distribution_version": "9.4",
            "nvidia_fabricmanager_required": True,
        }
    ),
    "ubuntu-branch-535": PlanCase({**UBUNTU_2404, "nvidia_driver_branch": "535"}),
}


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> Batch:
    """The driver plan of every case, or its refusal."""
    root = tmp_path_factory.mktemp("plans")
    cases = {
        host: {
            "nvidia_architecture": "x86_64",
            "nvidia_fabricmanager_required": False,
            "nvidia_nvlsm_required": False,
            **apt_sources(case_dir(root, host) / "apt", case.sources_list, case.files),
            **case.variables,
        }
        for host, case in PLAN_CASES.items()
    }
    return run_batch(root, "nvidia_driver_plan.yml", cases)


@pytest.mark.parametrize("version", UBUNTU_VERSIONS)
def test_ubuntu_gets_its_own_open_server_driver_of_the_branch_compute_only(plans, version):
    """Ubuntu's headless metapackage (no X server, OpenGL or Vulkan pieces: Ubuntu's server
    guide's set for compute), and nvidia-utils for nvidia-smi."""
    found = plans.result(f"ubuntu-{version}")
    assert found == {
        "release": f"Ubuntu {version}",
        "repository": None,
        "pinning": [],
        "driver": ["nvidia-headless-580-server-open", "nvidia-utils-580-server"],
        "fabricmanager": [],
        "nvlsm": [],
    }


def test_debian_12_gets_the_open_driver_from_nvidias_cuda_repository_pinned_to_the_branch(plans):
    # Debian 12's own archive stops at 535, below CUDA 13's 580, and has no *-server packages.
    # NVIDIA's compute-only (headless) set, as its driver installation guide names it.
    found = plans.result("debian-12")
    assert found == {
        "release": "Debian 12",
        "repository": {"url": CUDA_REPO, "key": CUDA_REPO + "3bf863cc.pub"},
        "pinning": ["nvidia-driver-pinning-580"],
        "driver": ["nvidia-driver-cuda", "nvidia-kernel-open-dkms"],
        "fabricmanager": [],
        "nvlsm": [],
    }


@pytest.mark.parametrize("form", CONTRIB_FORMS)
def test_debian_12_with_contrib_enabled_in_any_form_gets_its_plan(plans, form):
    assert plans.result(f"contrib-{form}")["release"] == "Debian 12"


@pytest.mark.parametrize("form", NO_CONTRIB_FORMS)
def test_debian_12_without_contrib_is_refused_before_apt_saying_how_to_enable_it(plans, form):
    said = plans.refusal(f"no-contrib-{form}")
    assert (
        "NVIDIA's CUDA repository, the driver's source on Debian 12, needs Debian's contrib" in said
    )
    assert "deb http://deb.debian.org/debian bookworm main contrib non-free-firmware" in said
    assert "then run make provision again" in said


def test_the_contrib_check_is_debians_alone(plans):
    """Ubuntu's driver comes from its own archive: its sources are not looked at."""
    assert plans.result("ubuntu-no-sources")["release"] == "Ubuntu 24.04"


def test_the_branch_follows_nvidia_driver_branch_and_arm_servers_use_sbsa(plans):
    ubuntu = plans.result("ubuntu-branch-590")
    assert ubuntu["driver"] == ["nvidia-headless-590-server-open", "nvidia-utils-590-server"]
    debian = plans.result("debian-branch-590-arm")
    assert debian["pinning"] == ["nvidia-driver-pinning-590"]
    assert debian["repository"]["url"].endswith("/repos/debian12/sbsa/")


def test_nvswitch_systems_get_the_fabric_manager_of_the_same_branch_and_source(plans):
    ubuntu = plans.result("ubuntu-nvswitch")
    assert ubuntu["fabricmanager"] == ["nvidia-fabricmanager-580"]
    # NVIDIA's repository has one nvidia-fabricmanager for all branches: the pinning package,
    # installed first, holds it to the driver's branch.
    debian = plans.result("debian-nvswitch")
    assert debian["fabricmanager"] == ["nvidia-fabricmanager"]
    assert debian["pinning"] == ["nvidia-driver-pinning-580"]


@pytest.mark.parametrize("distribution, version, runs", OTHER_DISTRIBUTIONS)
def test_other_distributions_are_refused_naming_the_supported_ones(
    plans, distribution, version, runs
):
    said = plans.refusal(f"other-{distribution}-{version}")
    assert (
        "the role installs the NVIDIA driver only on Ubuntu 22.04, Ubuntu 24.04, Debian 12" in said
    )
    assert f"this node runs {runs}" in said
    assert "nvidia_driver_install: false" in said


def test_an_nvlink_5_system_gets_nvlsm_beside_the_fabric_manager_on_debian(plans):
    """HGX B200: NVIDIA's NVLink subnet manager (nvlsm) from NVIDIA's CUDA repository, with the
    fabric manager, which starts it."""
    debian = plans.result("debian-nvlink5")
    assert (debian["fabricmanager"], debian["nvlsm"]) == (["nvidia-fabricmanager"], ["nvlsm"])


def test_an_nvlink_5_system_on_ubuntu_is_refused_naming_nvlsm(plans):
    """Ubuntu's archive, the role's source of the driver there, has no nvlsm."""
    said = plans.refusal("ubuntu-nvlink5")
    assert "this node is an NVLink 5 system (HGX B200" in said
    assert "needs NVIDIA's NVLink subnet manager (nvlsm)" in said
    assert "Ubuntu 24.04's archive, the role's source of the driver there, has no nvlsm" in said
    assert "nvidia_driver_install: false" in said


def test_a_refusal_on_an_nvswitch_system_names_the_fabric_manager(plans):
    said = plans.refusal("rocky-nvswitch")
    assert "nvidia-fabricmanager of the same version: this node has NVSwitches" in said


def test_a_branch_without_open_kernel_modules_is_refused(plans):
    said = plans.refusal("ubuntu-branch-535")
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

# (the loaded driver's /proc/driver/nvidia/version, the installed package's version)
LOADED_AND_PACKAGE = [
    (OPEN_580_95, "580.95.05-0ubuntu0.24.04.1"),  # Ubuntu's archive
    (PROPRIETARY_580_82, "580.82.07-1"),  # NVIDIA's repository
]
# host: (the loaded driver's version file, None for no driver loaded; the package's version)
FABRICMANAGER_CASES: dict[str, tuple[str | None, str]] = {
    **{f"starts-{package}": (loaded, package) for loaded, package in LOADED_AND_PACKAGE},
    "upgraded-not-rebooted": (PROPRIETARY_580_82, "580.95.05-1"),
    "no-driver-loaded": (None, "580.95.05-1"),
}


@pytest.fixture(scope="module")
def fabricmanager_decisions(tmp_path_factory) -> Batch:
    root = tmp_path_factory.mktemp("fabricmanager")
    cases = {}
    for host, (loaded, package) in FABRICMANAGER_CASES.items():
        version_file = case_dir(root, host) / "version"
        if loaded is not None:
            version_file.write_text(loaded)
        cases[host] = {
            "nvidia_driver_version_file": str(version_file),
            "nvidia_fabricmanager_package_version": package,
        }
    return run_batch(root, "nvidia_fabricmanager.yml", cases)


@pytest.mark.parametrize("loaded, package", LOADED_AND_PACKAGE)
def test_the_fabric_manager_starts_where_its_own_driver_version_is_loaded(
    fabricmanager_decisions, loaded, package
):
    assert FABRICMANAGER_CASES[f"starts-{package}"] == (loaded, package)
    found = fabricmanager_decisions.result(f"starts-{package}")
    assert found["start"] is True and found["wait"] == ""
    assert found["loaded"] == found["package"] == package.split("-")[0]


def test_after_a_driver_upgrade_before_the_reboot_it_says_reboot_first_instead_of_failing(
    fabricmanager_decisions,
):
    """The old driver stays loaded until the reboot; nvidia-fabricmanager of the new version
    would refuse to start, and the play (any_errors_fatal) would stop on every node."""
    host = "upgraded-not-rebooted"
    found = fabricmanager_decisions.result(host)
    assert found["start"] is False
    assert found["wait"] == (
        f"{host}: the loaded NVIDIA driver is 580.82.07 and the installed fabric manager "
        "580.95.05 (a driver upgraded, not yet rebooted into): the fabric manager runs only with "
        "its own version of the driver, so it was enabled but not started: reboot first, and it "
        "starts then."
    )


def test_with_no_driver_loaded_the_fabric_manager_waits_for_the_reboot_quietly(
    fabricmanager_decisions,
):
    """A first install: the handler already says to reboot; the unit, enabled, starts then."""
    found = fabricmanager_decisions.result("no-driver-loaded")
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


# host: (the PCI devices, the GPUs and NVSwitches to be found among them)
DETECT_CASES: dict[str, tuple[dict[str, tuple[str, ...]], list[str], list[str]]] = {
    "pcie-gpu": (
        {  # a PCIe card box: no switch, no fabric manager
            "0000:41:00.0": ("0x10de", "0x030200"),
            "0000:40:01.1": ("0x1022", "0x060400"),  # AMD PCIe bridge
        },
        ["0000:41:00.0"],
        [],
    ),
    "hgx-with-nvswitches": (
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
    "hgx-b200": (
        {  # an HGX B200 board, cut short: its switches sit behind ConnectX bridge functions
            "0000:18:00.0": ("0x10de", "0x030200", "0x2901"),
            "0000:2a:00.0": ("0x10de", "0x030200", "0x2901"),
            "0000:1a:00.0": ("0x15b3", "0x020700", "0x1021"),  # Mellanox function
        },
        ["0000:18:00.0", "0000:2a:00.0"],
        [],
    ),
}


@pytest.fixture(scope="module")
def detections(tmp_path_factory) -> Batch:
    root = tmp_path_factory.mktemp("detect")
    cases = {
        host: {"nvidia_pci_devices_dir": str(fake_pci(case_dir(root, host) / "pci", devices))}
        for host, (devices, _, _) in DETECT_CASES.items()
    }
    return run_batch(root, "nvidia_detect.yml", cases)


@pytest.mark.parametrize("case", DETECT_CASES)
def test_nvswitches_are_found_on_the_pci_bus_beside_the_gpus(detections, case):
    """And an NVLink 5 baseboard by its GPUs' device id: it needs the fabric manager and NVIDIA's
    NVLink subnet manager though no switch shows on the PCI bus."""
    devices, gpus, nvswitches = DETECT_CASES[case]
    nvlink5 = any(device[2:] == ("0x2901",) for device in devices.values())
    assert detections.result(case) == {
        "gpus": gpus,
        "nvswitches": nvswitches,
        "fabricmanager_required": bool(nvswitches) or nvlink5,
        "nvlsm_required": nvlink5,
    }
