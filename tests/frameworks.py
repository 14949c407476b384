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

#: PaddlePaddle 3.3.1: AOA_PADDLE_PYTHON or the workplace's /work/paddle-venv (bench/README
#: says how to make one).
PADDLE_PYTHON = _first_python(os.environ.get("AOA_PADDLE_PYTHON", ""),
                              "/work/paddle-venv/bin/python")


def paddle_load(folder: Path, tensors: dict[str, tuple[tuple[int, ...], str]], work: Path
                ) -> dict[str, bytes]:
    """The bytes of each of ``tensors`` (key -> global shape, dtype) as Paddle's
    ``paddle.distributed.load_state_dict`` reads them from ``folder``, in a subprocess of
    PADDLE_PYTHON (bench/paddle_checkpoints.py's ``load``)."""
    import json
    import subprocess

    import numpy as np

    assert PADDLE_PYTHON is not None
    spec, out = work / "paddle-spec.json", work / "paddle-loaded.npz"
    spec.write_text(json.dumps({key: [list(shape), dtype]
                                for key, (shape, dtype) in tensors.items()}))
    result = subprocess.run([str(PADDLE_PYTHON), str(ROOT / "bench" / "paddle_checkpoints.py"),
                             "load", str(folder), str(spec), str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with np.load(out) as loaded:
        return {key: loaded[key].tobytes() for key in loaded.files}
