"""Where the environments of the reference frameworks the slow tests run are: each is
optional, and a test that needs one is skipped where it is missing."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).parent.parent


def _first_python(*candidates: str) -> Path | None:
    return next((Path(p) for p in candidates if p and Path(p).is_file()), None)


#: Megatron-Core 0.16.1 (torch from the test environment): AOA_MEGATRON_PYTHON, the
#: workplace's /work/megatron-venv, or the .megatron-venv that .ci/run makes.
MEGATRON_PYTHON = _first_python(os.environ.get("AOA_MEGATRON_PYTHON", ""),
                                "/work/megatron-venv/bin/python",
                                str(ROOT / ".megatron-venv" / "bin" / "python"))
