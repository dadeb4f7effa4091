"""The image registry's controller probe (vars/main.yml): what it calls ok is what
community.crypto's modules would leave alone, and anything else sends that certificate through
them. Run as the role runs it (bash -c SCRIPT), on certificates made with openssl here."""

from __future__ import annotations

import getpass
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.ansible.conftest import ANSIBLE_DIR

SCRIPT = yaml.safe_load((ANSIBLE_DIR / "roles/image_registry/vars/main.yml").read_text())[
    "image_registry_controller_probe_script"
]
INSTANCE = "torch-multinode-registry-10-1-2-3-5000"
ADDRESS = "10.1.2.3"  # text in a certificate: nothing connects to it
RENEW = str(30 * 86400)


def openssl(*args: str, stdin: bytes | None = None) -> bytes:
    return subprocess.run(["openssl", *args], input=stdin, capture_output=True, check=True).stdout


def key(path: Path) -> None:
    openssl("ecparam", "-name", "secp384r1", "-genkey", "-noout", "-out", str(path))
    path.chmod(0o600)


def ca(directory: Path, name: str = "ca") -> tuple[Path, Path]:
    ca_key, ca_crt = directory / "private" / f"{name}.key", directory / f"{name}.crt"
    key(ca_key)
    openssl(
        "req",
        "-x509",
        "-new",
        "-key",
        str(ca_key),
        "-subj",
        f"/CN={name}",
        "-days",
        "825",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-out",
        str(ca_crt),
    )
    ca_crt.chmod(0o644)
    return ca_crt, ca_key


def signed(crt: Path, crt_key: Path, by: tuple[Path, Path], days: int = 825, san: str = "") -> None:
    key(crt_key)
    request = openssl(
        "req",
        "-new",
        "-key",
        str(crt_key),
        "-subj",
        "/CN=x",
        *(["-addext", f"subjectAltName={san}"] if san else []),
    )
    openssl(
        "x509",
        "-req",
        "-CA",
        str(by[0]),
        "-CAkey",
        str(by[1]),
        "-days",
        str(days),
        "-copy_extensions",
        "copy",
        "-out",
        str(crt),
        stdin=request,
    )
    crt.chmod(0o644)


@pytest.fixture
def registry(tmp_path) -> Path:
    """A registry directory as the role leaves it: a CA, the client's and one server's."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl is missing: the controller's probe needs it (apt install openssl)")
    (tmp_path / "private").mkdir()
    (tmp_path / "server").mkdir()
    authority = ca(tmp_path)
    signed(tmp_path / "client.crt", tmp_path / "private/client.key", authority)
    server = (tmp_path / f"{INSTANCE}.crt", tmp_path / f"server/{INSTANCE}.key")
    signed(*server, authority, san=f"IP:{ADDRESS}")
    return tmp_path


def probe(
    directory: Path, *, renew: str = RENEW, owner: str | None = None, address: str = ADDRESS
) -> dict[str, str]:
    run = subprocess.run(
        [
            "bash",
            "-c",
            SCRIPT,
            "probe",
            str(directory),
            renew,
            owner or getpass.getuser(),
            INSTANCE,
            address,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(line.split(" ", 1) for line in run.stdout.splitlines())


def test_certificates_in_place_are_ok_and_the_package_and_init_system_are_said(registry):
    found = probe(registry)
    assert (found["ca"], found["client"], found[INSTANCE]) == ("ok", "ok", "ok"), found
    assert found["init"] in ("systemd", "none")
    assert found["package"]  # dpkg's status word, or not-installed


def test_a_missing_ca_sends_every_certificate_through_the_modules(registry):
    (registry / "ca.crt").unlink()
    found = probe(registry)
    assert found["ca"] == "missing"
    assert "client" not in found and INSTANCE not in found, found


def test_fewer_days_left_than_the_renewal_margin_is_expiring(registry):
    assert probe(registry, renew=str(900 * 86400))["ca"] == "expiring"
    signed(
        registry / "client.crt",
        registry / "private/client.key",
        (registry / "ca.crt", registry / "private/ca.key"),
        days=10,
    )
    assert probe(registry)["client"] == "expiring"


def test_a_certificate_for_another_address_is_named(registry):
    assert probe(registry, address="10.1.2.30")[INSTANCE] == "name"


def test_a_certificate_signed_by_another_ca_is_unsigned(registry):
    other = ca(registry, "other")
    signed(registry / "client.crt", registry / "private/client.key", other)
    assert probe(registry)["client"] == "unsigned"


def test_a_certificate_that_is_not_its_keys_is_key(registry):
    shutil.copy(registry / f"{INSTANCE}.crt", registry / "client.crt")
    assert probe(registry)["client"] == "key"


def test_modes_and_the_server_keys_owner_are_checked(registry):
    assert probe(registry, owner="docker-registry-nobody")[INSTANCE] == "mode"
    (registry / "private/client.key").chmod(0o640)
    assert probe(registry)["client"] == "mode"
    (registry / "ca.crt").chmod(0o600)
    assert probe(registry)["ca"] == "mode"
