"""What a node or an image runs: Python, torch, torchvision, CUDA, cuDNN, NCCL, the project.

`python3 -m cluster.versions` prints one `name: version` line each; `--json` prints a mapping.
Anything absent says so ("none") instead of failing: a CPU node has no NCCL to speak of.
"""

from __future__ import annotations

import json
import platform
import sys

import cluster


def collect() -> dict[str, str]:
    found = {"python": platform.python_version(), "torch-multinode": cluster.__version__}
    try:
        import torch
    except ImportError:
        return {**found, "torch": "none"}
    found["torch"] = torch.__version__
    try:
        import torchvision

        found["torchvision"] = torchvision.__version__
    except ImportError:
        found["torchvision"] = "none"
    found["cuda"] = torch.version.cuda or "none"
    found["cudnn"] = str(torch.backends.cudnn.version() or "none")
    found["nccl"] = _nccl_version(torch)
    found["gpus"] = str(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    return found


def _nccl_version(torch) -> str:
    if not torch.distributed.is_nccl_available():
        return "none"
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a build with NCCL but no usable library: report, don't fail
        return "unknown"
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    found = collect()
    if "--json" in argv:
        print(json.dumps(found, sort_keys=True))
    else:
        for name, version in found.items():
            print(f"{name}: {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
