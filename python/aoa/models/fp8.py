"""fp8 releases in the model library. DeepSeek-V3 and Kimi-K2 store their linear weights in
float8_e4m3fn, each beside ``<weight>_scale_inv`` (float32, one scale per block of
``weight_block_size``, 128 x 128, the last blocks partial); config.json says so in its
``quantization_config`` (``quant_method: fp8``). Which weights are fp8 is what the checkpoint
stores (routers, norms, embeddings and the head stay bfloat16): a key stored in fp8 must have
its scales, and scales are known for exactly those keys.

Two ways through a conversion, for any family:

* ``--dtype`` dequantizes: each fp8 weight is cast as any weight, and the plan reads its
  scales beside it (`aoa.block_scales`), so the kernel multiplies in the copy; the mapping
  does not name the scales, and the output is a plain model of that dtype (its config.json
  without quantization_config).
* without ``--dtype`` the weights stay fp8 and each scale follows its weight: the same
  statement with the scale keys (a ``^T`` transposes the block grid with the weight, as
  PaddleFormers' fp8 Linear keeps ``weight_scale_inv`` as [in / 128, out / 128]) and the
  same split on the mesh. A split that cuts through a block, and a fused layout (whose
  parts the scales cannot follow), are refused.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from aoa.block_scales import FP8, Quantized, scale_shape
from aoa.layout import ShardDesc
from aoa.models.base import (
    EXPERT,
    LAYER,
    Config,
    Dim,
    Expected,
    ModelError,
    Split,
    Step,
    TargetMapping,
)

SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class Fp8Weights:
    """The source (Hugging Face) key templates stored in fp8, and their block."""

    block: tuple[int, ...]
    templates: tuple[str, ...]

    def to_json(self) -> dict:
        return {"block": list(self.block), "templates": list(self.templates)}

    @classmethod
    def from_json(cls, data: Mapping | None) -> Fp8Weights | None:
        if not data:
            return None
        return cls(tuple(data["block"]), tuple(data["templates"]))


def block_of(cfg: Config) -> tuple[int, ...] | None:
    """The block of a config whose quantization_config is fp8 (None: not quantized)."""
    config = cfg.data.get("quantization_config")
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else None
    if method != "fp8":
        raise ModelError(f"{cfg.path}: quantization_config has quant_method {method!r}; aoa "
                         "reads fp8 releases with block scales (quant_method 'fp8') only",
                         hint="Convert an unquantized release of the model.")
    block = config.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ModelError(f"{cfg.path}: quantization_config's weight_block_size is {block!r}; "
                         "fp8 weights with block scales need two sizes, as [128, 128]",
                         hint="Per-tensor fp8 scales are not supported.")
    return tuple(block)


def without_quantization(data: Mapping) -> dict:
    """A config.json for the dequantized weights."""
    return {k: v for k, v in data.items() if k != "quantization_config"}


def stored_fp8(cfg: Config, source_dtypes: Mapping[str, str]) -> Fp8Weights | None:
    """The fp8 weights of a checkpoint whose key templates have ``source_dtypes``."""
    block = block_of(cfg)
    templates = tuple(sorted(t for t, dtype in source_dtypes.items() if dtype in FP8))
    if block is None or not templates:
        return None
    return Fp8Weights(block, templates)


def scale_tensors(info: Mapping[str, Sequence[ShardDesc]], expected: Mapping[str, Expected],
                  cfg: Config) -> dict[str, Expected]:
    """The scale tensors the checkpoint must hold: one for each fp8 weight the family
    knows. A weight stored in fp8 without its scales is an error."""
    block = block_of(cfg)
    if block is None:
        return {}
    scales = {}
    missing = []
    for key, shards in info.items():
        if shards[0].dtype not in FP8 or key not in expected:
            continue
        if key + SUFFIX not in info:
            missing.append(key)
            continue
        scales[key + SUFFIX] = scales_of(expected[key], block)
    if missing:
        raise ModelError(f"{len(missing)} weight(s) stored in fp8 have no scales: "
                         f"'{missing[0]}' lacks '{missing[0]}{SUFFIX}'"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                         hint=f"An fp8 weight means nothing without its {SUFFIX} (one scale "
                              f"per block of {' x '.join(map(str, block))}): check that the "
                              "checkpoint is complete.")
    return scales


def scales_of(weight: Expected, block: Sequence[int]) -> Expected:
    """The scales of an expected weight: one per block along its last axes."""
    full = (1,) * (len(weight.dims) - len(block)) + tuple(block)
    dims = tuple(Dim(n, d.why) if b == 1 else Dim(-(-d.size // b), f"{d.why} / {b}, rounded up")
                 for d, b, n in zip(weight.dims, full, scale_shape(weight.shape, full)))
    return Expected(dims, weight.group)


def with_scales(mapping: TargetMapping, fp8: Fp8Weights, *, dequantize: bool
                ) -> TargetMapping:
    """The family's mapping with the scales: consumed when the weights are dequantized,
    else following each weight (statements and splits)."""
    quantized = set(fp8.templates)
    steps: list[Step] = []
    for step in mapping.steps:
        steps.append(step)
        read = [r for r in step.reads if r in quantized]
        if not read:
            continue
        if dequantize:
            continue  # the scales are read by the dequantization, not by a statement
        if step.simple:
            steps.append(twin(step))
        else:
            raise ModelError(f"'{read[0]}' is stored in fp8 and goes into the fused "
                             f"'{step.writes[0]}', which its scales cannot follow",
                             hint="Dequantize with --dtype bfloat16.")
    splits: list[Split] = []
    for split in mapping.splits:
        splits.append(split)
        if not dequantize and split.match.endswith(".weight"):
            splits.append(dataclasses.replace(split, match=split.match + SUFFIX))
    size = " x ".join(map(str, fp8.block))
    note = (f"fp8 weights dequantized in the copy: each times its <weight>{SUFFIX}, one "
            f"scale per block of {size}" if dequantize else
            f"fp8 weights kept, each <weight>{SUFFIX} (one scale per block of {size}) "
            "beside its weight, transposed and split with it")
    return dataclasses.replace(mapping, steps=steps, splits=splits,
                               notes=[*mapping.notes, note])


def twin(step: Step) -> Step:
    """The scales' step of a plain weight step: its statements with the scale keys."""
    (read,), (write,) = step.reads, step.writes

    def scaled(text: str) -> str:
        for name in dict.fromkeys((read, write)):
            text = re.sub(re.escape(name) + r"(?![\w.$])", name + SUFFIX, text)
        return text

    return Step(tuple(map(scaled, step.forward)), tuple(map(scaled, step.inverse)),
                (read + SUFFIX,), (write + SUFFIX,), reshard=tuple(map(scaled, step.reshard)))


def kept_weights(steps: Iterable[Step], block: tuple[int, ...],
                 source: Mapping[str, tuple[int, ...]]
                 ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each target weight kept in fp8 with its scales: target key -> (global shape, block),
    from the plain statements its scales follow (a ``^T`` transposes shape and block)."""
    kept = {}
    for step in steps:
        if not (len(step.writes) == 1 and step.writes[0].endswith(SUFFIX) and step.forward):
            continue
        read, write = step.reads[0][:-len(SUFFIX)], step.writes[0][:-len(SUFFIX)]
        transposed = "^T" in step.forward[0]
        pattern = re.compile(re.escape(read).replace(re.escape(LAYER), r"(?P<layer>\d+)")
                             .replace(re.escape(EXPERT), r"(?P<expert>\d+)"))
        for key, shape in source.items():
            found = pattern.fullmatch(key)
            if found is None:
                continue
            numbers = found.groupdict()
            target = write.replace(LAYER, numbers.get("layer") or LAYER).replace(
                EXPERT, numbers.get("expert") or EXPERT)
            kept[target] = (tuple(shape[::-1]), block[::-1]) if transposed else (shape, block)
    return kept


def target_blocks(steps: Iterable[Step], block: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The block of each target weight template that keeps its scales (a transposed
    weight has the block transposed)."""
    blocks = {}
    for step in steps:
        if len(step.writes) == 1 and step.writes[0].endswith(SUFFIX) and step.forward:
            transposed = "^T" in step.forward[0]
            blocks[step.writes[0][:-len(SUFFIX)]] = block[::-1] if transposed else block
    return blocks


def quantized_keys(keys: Iterable[str], templates_by_key: Mapping[str, str],
                   blocks: Mapping[str, tuple[int, ...]]) -> dict[str, Quantized]:
    """Each key of a quantized template, with its scale key and block."""
    return {key: Quantized(key + SUFFIX, blocks[templates_by_key[key]]) for key in keys
            if templates_by_key.get(key) in blocks}


def check_whole_blocks(shards: Iterable[ShardDesc], blocks: Mapping[str, tuple[int, ...]],
                       layout: str) -> None:
    """Every shard of a weight kept in fp8 holds whole blocks (the last may be partial):
    else its scales could not be split with it. ``blocks``: key -> block."""
    for shard in shards:
        block = blocks[shard.key]
        for axis, (offset, size, total, b) in enumerate(zip(
                shard.global_offset, shard.local_shape, shard.global_shape, block)):
            if offset % b or (size % b and offset + size != total):
                raise ModelError(f"{layout} cuts '{shard.key}' ({list(shard.global_shape)}) "
                                 f"along axis {axis} into parts of {size}, through its fp8 "
                                 f"scale blocks of {b}",
                                 hint=f"Choose degrees whose parts are whole blocks of {b}, "
                                      "or dequantize with --dtype bfloat16.")


def check_scales_follow(destinations: Sequence[ShardDesc],
                        blocks: Mapping[str, tuple[int, ...]]) -> None:
    """The scales' shard of each shard of a weight kept in fp8 holds exactly the scales of
    its blocks. ``blocks``: key -> block."""
    scales = {(d.key, d.global_offset): d for d in destinations if d.key.endswith(SUFFIX)}
    for shard in destinations:
        block = blocks.get(shard.key)
        if block is None:
            continue
        first = tuple(o // b for o, b in zip(shard.global_offset, block))
        scale = scales.get((shard.key + SUFFIX, first))
        want = scale_shape([o + n for o, n in zip(shard.global_offset, shard.local_shape)],
                           block)
        if scale is None or tuple(f + n for f, n in zip(first, scale.local_shape)) != want:
            raise ModelError(f"the scales of '{shard.key}' at {list(shard.global_offset)} are "
                             "not laid out with it",
                             hint=f"'{shard.key}{SUFFIX}' must be split as its weight is, "
                                  "whole blocks to a shard.")
