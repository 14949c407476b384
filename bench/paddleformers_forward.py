"""Run PaddleFormers 1.2.0's own model on a checkpoint that `aoa convert --to paddleformers`
wrote, and save its logits: the model library's output checked by the framework that trains
on it (tests/test_models_round_trip.py compares them with transformers' logits).

A tool for the team, not part of aoa: it runs ONLY under the Paddle virtual environment
(`/work/paddle-venv/bin/python`, paddlepaddle 3.3.1 and paddleformers 1.2.0)::

    /work/paddle-venv/bin/python bench/paddleformers_forward.py MODULE CLASS FOLDER IDS OUT

MODULE and CLASS name PaddleFormers' model (``ernie4_5 Ernie4_5ForCausalLM``); FOLDER is the
converted checkpoint at TP 1 (its config.json is the Hugging Face one aoa copies); IDS a
JSON list of token-id rows; OUT the .npy file the logits go to. The model is built on the
CPU from that config (RMS norm unfused: Paddle's CPU build has no fused kernel), its
parameters read with Paddle's own ``load_state_dict``, every one of them required.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path


def main() -> None:
    module, model_class, folder, ids, out = sys.argv[1:6]
    import numpy as np
    import paddle
    import paddle.distributed as dist

    paddle.set_device("cpu")
    modeling = importlib.import_module(f"paddleformers.transformers.{module}.modeling")
    model_type = getattr(modeling, model_class).config_class
    config = json.loads((Path(folder) / "config.json").read_text())
    rope = config.pop("rope_parameters", None) or {}  # transformers 5's form of the two below
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        config.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    model = getattr(modeling, model_class)(model_type(**config, fuse_rms_norm=False))
    model.eval()
    state = {key: paddle.full_like(value, float("nan"))
             for key, value in model.state_dict().items()}
    dist.load_state_dict(state, folder)
    unread = [key for key, value in state.items() if bool(paddle.isnan(value).any())]
    if unread:
        sys.exit(f"not in the checkpoint (still NaN): {unread}")
    model.set_state_dict(state)
    with paddle.no_grad():
        output = model(paddle.to_tensor(json.loads(ids)))
    logits = output.logits if hasattr(output, "logits") else output[0]
    np.save(out, logits.astype("float32").numpy())


if __name__ == "__main__":
    main()
