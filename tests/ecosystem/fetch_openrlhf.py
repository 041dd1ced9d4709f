"""Fetch OpenRLHF's reward-request code from its PyPI wheel (``make test-ecosystem`` runs this).

``python tests/ecosystem/fetch_openrlhf.py VERSION OUT.py`` downloads ``openrlhf==VERSION``
(no dependencies: OpenRLHF pins GPU packages) and writes the wheel's
``openrlhf/utils/agent.py`` to ``OUT.py``. The file needs only aiohttp once OpenRLHF's
logging module is stubbed, which is how OpenRLHF's own ``tests/test_agent.py`` loads it;
``tests/ecosystem/test_openrlhf.py`` does the same.

The wheel is tagged cp311 / manylinux1_x86_64 although ``agent.py`` is pure Python, so the
download names that platform explicitly and works from any machine.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MEMBER = "openrlhf/utils/agent.py"


def fetch(version: str, out: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                "3.11",
                "--platform",
                "manylinux1_x86_64",
                f"openrlhf=={version}",
                "-d",
                tmp,
            ],
            check=True,
        )
        (wheel,) = Path(tmp).glob(f"openrlhf-{version}-*.whl")
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n.endswith(MEMBER)]
            if len(names) != 1:
                raise SystemExit(f"{wheel.name}: expected one {MEMBER}, found {names}")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(zf.read(names[0]))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python tests/ecosystem/fetch_openrlhf.py VERSION OUT.py", file=sys.stderr)
        return 2
    print(f"wrote {fetch(argv[0], Path(argv[1]))} from openrlhf=={argv[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
