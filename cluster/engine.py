"""The controller's Docker engine: the one way this project calls `docker`, whether the engine
answers, and base images made from Debian's packages (mmdebstrap), with no registry needed.

Used by the image build and shipment and by the simulated cluster alike; the simulator is
built on it, never the other way round.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from torch_multinode.cluster.errors import UserError

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def docker(
    *args: str, check: bool = True, timeout: float | None = 600, stdin: str | None = None
) -> subprocess.CompletedProcess:
    """`docker ARGS`; `stdin` is what the command reads (a secret never goes in ARGS)."""
    try:
        proc = subprocess.run(
            ["docker", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            input=stdin,
        )
    except FileNotFoundError:
        raise UserError(
            "the docker command is not installed", hint="apt-get install docker.io", exit_code=1
        ) from None
    if check and proc.returncode != 0:
        detail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise UserError(
            f"docker {args[0]} failed: {detail[-1] if detail else f'exit {proc.returncode}'}",
            exit_code=1,
        )
    return proc


def engine_available() -> tuple[bool, str]:
    """Whether a Docker engine answers, and if not, why (for skip reasons and errors)."""
    if shutil.which("docker") is None:
        return False, "the docker client is not installed"
    proc = subprocess.run(
        ["docker", "info", "--format", "{{.ServerVersion}}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if proc.returncode != 0:
        return False, "no Docker engine answers (start dockerd)"
    return True, proc.stdout.strip()


def require_engine() -> None:
    ok, why = engine_available()
    if not ok:
        raise UserError(
            why, hint="'apt-get install -y docker.io' and start dockerd (see README)", exit_code=1
        )


def image_exists(image: str) -> bool:
    return docker("image", "inspect", image, check=False).returncode == 0


def debian_mirror(sources_dir: Path = Path("/etc/apt")) -> tuple[str, str]:
    """The (mirror URI, suite) this machine's apt already uses: no mirror is hard-coded."""
    candidates: list[tuple[str, str]] = []
    for path in sorted(sources_dir.glob("sources.list.d/*.sources")):
        for stanza in path.read_text().split("\n\n"):
            fields = {}
            for line in stanza.splitlines():
                if ":" in line and not line.lstrip().startswith("#"):
                    key, value = line.split(":", 1)
                    fields[key.strip().lower()] = value.split()
            for uri in fields.get("uris", []):
                for suite in fields.get("suites", []):
                    candidates.append((uri, suite))
    legacy = sources_dir / "sources.list"
    if legacy.exists():
        for line in legacy.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb":
                uri_index = 2 if parts[1].startswith("[") else 1
                candidates.append((parts[uri_index], parts[uri_index + 1]))
    for uri, suite in candidates:
        if uri.startswith("http") and "security" not in uri and "-" not in suite:
            return uri, suite
    raise UserError(
        f"no Debian mirror found in {sources_dir}/sources.list(.d)",
        hint="running on a Debian machine whose apt sources name a mirror",
        exit_code=1,
    )


def debian_base(image: str, packages: tuple[str, ...], progress: Progress = _quiet) -> None:
    """Make `image` from Debian's packages with mmdebstrap, once: no registry is needed."""
    require_engine()
    if image_exists(image):
        return
    if shutil.which("mmdebstrap") is None:
        raise UserError(
            f"mmdebstrap is needed to make the base image {image}",
            hint="apt-get install -y mmdebstrap",
            exit_code=1,
        )
    mirror, suite = debian_mirror()
    progress(f"Making {image} from Debian {suite} packages (once, ~30 s)...")
    with tempfile.TemporaryDirectory(prefix="debian-base-") as tmp:
        tarball = Path(tmp) / "base.tar"
        proc = subprocess.run(
            [
                "mmdebstrap",
                "--variant=apt",
                f"--include={','.join(packages)}",
                suite,
                str(tarball),
                mirror,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
            raise UserError(f"mmdebstrap failed: {tail[0]}", exit_code=1)
        docker("import", str(tarball), image)
