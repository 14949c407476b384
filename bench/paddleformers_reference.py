"""bench/paddle_reference.py with PaddleFormers' own AOA macros registered in Paddle's engine.

PaddleFormers 1.2.0 registers `fused_in_proj` (Qwen3.5's linear attention) in Paddle's macro
table when its qwen3_5 modeling module is imported; Paddle 3.3.1 alone does not have it. This
imports that module (with bench/paddleformers_statements.py's PaddleFleet stand-ins) and then
answers like paddle_reference.py. Paddle environment only::

    /work/paddle-venv/bin/python bench/paddleformers_reference.py CASE.json
"""

from __future__ import annotations

import contextlib
import importlib
import sys

from paddle_reference import main
from paddleformers_statements import install_paddlefleet_stand_ins

if __name__ == "__main__":
    with contextlib.redirect_stdout(sys.stderr):
        install_paddlefleet_stand_ins()
        importlib.import_module("paddleformers.transformers.qwen3_5.modeling")
    sys.exit(main())
