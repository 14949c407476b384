"""aoa.load against safetensors' own loader plus the same operations, side by side in one run.

    python bench/load.py                  # a ~1.5 GB float32 Llama-like checkpoint
    python bench/load.py --size 0.3 --repeats 5

The checkpoint has Hugging Face names; the mapping makes a fused layout (q/k/v fused with
grouped-query heads, gate/up fused, linear weights transposed to [in, out]), unsharded. The
destination tensors are allocated and touched once, as a model's parameters are, and every
run fills the same ones:

* aoa:         aoa.load(mapping, source=folder, into=tensors)  (compile included)
* safetensors: safetensors.numpy.load_file / safetensors.torch.load_file, then the same
               transposes and concatenations in numpy / torch, written into the tensors
               with out= and copyto/copy_ (no temporaries beyond what the loader returns)

Each pair is timed alternately, repeat by repeat, after one warm-up of each (the file is
in the page cache); the medians and their ratio (the other's time over aoa's: above 1 aoa
is faster) are printed. Both results are checked to be the same bytes. Target: >= 2x.
Needs about 4x --size of memory (the file's cache, the tensors, the loader's copy).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import aoa
from aoa.layout import ShardDesc
from aoa.storage.safetensors import write_safetensors


class Model:
    """Llama-like dimensions that reach about ``size_gb`` of float32."""

    def __init__(self, size_gb: float) -> None:
        for hidden, heads, kv_heads, vocab in ((2048, 16, 4, 32000), (1024, 8, 2, 16000),
                                               (512, 8, 2, 8000), (256, 4, 2, 2048)):
            self.hidden, self.heads, self.kv_heads, self.vocab = hidden, heads, kv_heads, vocab
            self.head_dim = hidden // heads
            self.intermediate = hidden * 11 // 4
            fixed = 2 * vocab * hidden + hidden
            if 4 * (fixed + self.layer_params()) <= size_gb * 1e9:
                break
        self.layers = max(1, round((size_gb * 1e9 / 4 - fixed) / self.layer_params()))

    def layer_params(self) -> int:
        h, kv, i = self.hidden, self.kv_heads * self.head_dim, self.intermediate
        return 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h

    def shapes(self) -> dict[str, tuple[int, ...]]:
        h, kv, i = self.hidden, self.kv_heads * self.head_dim, self.intermediate
        shapes = {"model.embed_tokens.weight": (self.vocab, h), "model.norm.weight": (h,),
                  "lm_head.weight": (self.vocab, h)}
        for layer in range(self.layers):
            p = f"model.layers.{layer}."
            shapes |= {p + "self_attn.q_proj.weight": (h, h),
                       p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)}
        return shapes

    def mapping(self) -> str:
        layer = "model.layers.$LAYER_ID."
        out = "layers.$LAYER_ID."
        return "\n".join([
            "model.embed_tokens.weight -> embed_tokens.weight",
            f"{layer}self_attn.q_proj.weight^T, {layer}self_attn.k_proj.weight^T, "
            f"{layer}self_attn.v_proj.weight^T -> {out}self_attn.qkv_proj.weight, fused_qkv, "
            f"num_heads={self.heads}, num_key_value_groups={self.kv_heads}",
            f"{layer}self_attn.o_proj.weight^T -> {out}self_attn.o_proj.weight",
            f"{layer}mlp.gate_proj.weight^T, {layer}mlp.up_proj.weight^T -> "
            f"{out}mlp.up_gate_proj.weight, fused_ffn",
            f"{layer}mlp.down_proj.weight^T -> {out}mlp.down_proj.weight",
            f"{layer}input_layernorm.weight -> {out}input_layernorm.weight",
            f"{layer}post_attention_layernorm.weight -> {out}post_attention_layernorm.weight",
            "model.norm.weight -> norm.weight",
            "lm_head.weight^T -> lm_head.weight",
        ])

    def destination_shapes(self) -> dict[str, tuple[int, ...]]:
        h, kv, i = self.hidden, self.kv_heads * self.head_dim, self.intermediate
        shapes = {"embed_tokens.weight": (self.vocab, h), "norm.weight": (h,),
                  "lm_head.weight": (h, self.vocab)}
        for layer in range(self.layers):
            d = f"layers.{layer}."
            shapes |= {d + "self_attn.qkv_proj.weight": (h, h + 2 * kv),
                       d + "self_attn.o_proj.weight": (h, h),
                       d + "mlp.up_gate_proj.weight": (h, 2 * i),
                       d + "mlp.down_proj.weight": (i, h),
                       d + "input_layernorm.weight": (h,),
                       d + "post_attention_layernorm.weight": (h,)}
        return shapes

    def qkv_pieces(self) -> list[tuple[str, int, int]]:
        """fused_qkv's column order: per key-value head, its query heads, then k, then v:
        (q/k/v, first column, last column) of each transposed source."""
        group, d = self.heads // self.kv_heads, self.head_dim
        pieces = []
        for g in range(self.kv_heads):
            pieces += [("q", (g * group + j) * d, (g * group + j + 1) * d) for j in range(group)]
            pieces += [("k", g * d, (g + 1) * d), ("v", g * d, (g + 1) * d)]
        return pieces


def write_checkpoint(model: Model, folder: Path) -> Path:
    shapes = model.shapes()
    rng = np.random.default_rng(0)

    def fill(views):
        for view in views.values():
            rng.standard_normal(out=np.frombuffer(view, np.float32), dtype=np.float32)

    write_safetensors(folder / "model.safetensors",
                      [ShardDesc.full(k, s, "float32") for k, s in shapes.items()], None, fill)
    return folder / "model.safetensors"


def numpy_baseline(model: Model, path: Path, into: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import load_file

    hf = load_file(path)
    np.copyto(into["embed_tokens.weight"], hf["model.embed_tokens.weight"])
    np.copyto(into["norm.weight"], hf["model.norm.weight"])
    np.copyto(into["lm_head.weight"], hf["lm_head.weight"].T)
    for layer in range(model.layers):
        p, d = f"model.layers.{layer}.", f"layers.{layer}."
        qkv = {n: hf[p + f"self_attn.{n}_proj.weight"].T for n in "qkv"}
        np.concatenate([qkv[n][:, a:b] for n, a, b in model.qkv_pieces()], axis=1,
                       out=into[d + "self_attn.qkv_proj.weight"])
        np.copyto(into[d + "self_attn.o_proj.weight"], hf[p + "self_attn.o_proj.weight"].T)
        np.concatenate([hf[p + "mlp.gate_proj.weight"].T, hf[p + "mlp.up_proj.weight"].T],
                       axis=1, out=into[d + "mlp.up_gate_proj.weight"])
        np.copyto(into[d + "mlp.down_proj.weight"], hf[p + "mlp.down_proj.weight"].T)
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            np.copyto(into[d + norm], hf[p + norm])


def torch_baseline(model: Model, path: Path, into: dict) -> None:
    import torch
    from safetensors.torch import load_file

    hf = load_file(path)
    with torch.no_grad():
        into["embed_tokens.weight"].copy_(hf["model.embed_tokens.weight"])
        into["norm.weight"].copy_(hf["model.norm.weight"])
        into["lm_head.weight"].copy_(hf["lm_head.weight"].T)
        for layer in range(model.layers):
            p, d = f"model.layers.{layer}.", f"layers.{layer}."
            qkv = {n: hf[p + f"self_attn.{n}_proj.weight"].T for n in "qkv"}
            torch.cat([qkv[n][:, a:b] for n, a, b in model.qkv_pieces()], dim=1,
                      out=into[d + "self_attn.qkv_proj.weight"])
            into[d + "self_attn.o_proj.weight"].copy_(hf[p + "self_attn.o_proj.weight"].T)
            torch.cat([hf[p + "mlp.gate_proj.weight"].T, hf[p + "mlp.up_proj.weight"].T],
                      dim=1, out=into[d + "mlp.up_gate_proj.weight"])
            into[d + "mlp.down_proj.weight"].copy_(hf[p + "mlp.down_proj.weight"].T)
            for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                into[d + norm].copy_(hf[p + norm])


def side_by_side(ours: Callable[[], None], other: Callable[[], None], repeats: int
                 ) -> tuple[float, float]:
    """Median seconds of ``ours`` and ``other``, timed alternately after one warm-up each."""
    ours(), other()
    our_times, other_times = [], []
    for _ in range(repeats):
        for run, times in ((ours, our_times), (other, other_times)):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    return statistics.median(our_times), statistics.median(other_times)


def _bytes(tensors: dict) -> dict[str, bytes]:
    return {k: (v.numpy() if hasattr(v, "numpy") else v).tobytes() for k, v in tensors.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=1.5, help="checkpoint GB (default 1.5)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="aoa's copy threads (default: all CPUs)")
    parser.add_argument("--no-torch", action="store_true", help="numpy only")
    args = parser.parse_args()
    model = Model(args.size)
    with tempfile.TemporaryDirectory(prefix="aoa-bench-load-") as tmp:
        start = time.perf_counter()
        path = write_checkpoint(model, Path(tmp))
        nbytes = path.stat().st_size
        print(f"checkpoint: {nbytes / 1e9:.2f} GB float32, {model.layers} layers, hidden "
              f"{model.hidden}, {model.heads} heads / {model.kv_heads} kv, vocab "
              f"{model.vocab} ({len(model.shapes())} tensors; written in "
              f"{time.perf_counter() - start:.1f} s)")
        mapping = model.mapping()
        shapes = model.destination_shapes()
        ratios = {}
        print(f"{'':<44} {'aoa s':>8} {'other s':>8} {'aoa GB/s':>9} {'ratio':>7}")

        def line(name: str, times: tuple[float, float]) -> None:
            ours, other = times
            ratios[name] = other / ours
            print(f"{name:<44} {ours:8.3f} {other:8.3f} {nbytes / ours / 1e9:9.2f} "
                  f"{other / ours:6.2f}x")

        def compare(name: str, make: Callable, baseline: Callable) -> None:
            """Check both give the same bytes, then time them on the same tensors."""
            tensors = {k: make(s) for k, s in shapes.items()}
            expected = {k: make(s) for k, s in shapes.items()}
            loaded = aoa.load(mapping, source=tmp, into=tensors, threads=args.threads,
                              progress=False)
            baseline(model, path, expected)
            assert _bytes(tensors) == _bytes(expected), f"{name}: aoa and the baseline differ"
            del expected
            print(f"{name}: both give the same bytes; aoa compiles in "
                  f"{loaded.compile_seconds * 1e3:.0f} ms (counted in its time)")
            line(f"{name}: aoa.load vs safetensors.{name} + {name}",
                 side_by_side(lambda: aoa.load(mapping, source=tmp, into=tensors,
                                               threads=args.threads, progress=False),
                              lambda: baseline(model, path, tensors), args.repeats))

        compare("numpy", lambda shape: np.zeros(shape, np.float32) + 0,  # touched pages
                numpy_baseline)
        if not args.no_torch:
            import torch

            compare("torch", lambda shape: torch.zeros(shape) + 0, torch_baseline)
        print("target >= 2x: " + ", ".join(f"{name.split(':')[0]} {r:.2f}x "
                                           f"({'met' if r >= 2 else 'NOT met'})"
                                           for name, r in ratios.items()))


if __name__ == "__main__":
    main()
