"""The model library: from a Hugging Face config.json, the mapping between the Hugging Face
layout and a training layout (`paddleformers`, `megatron`) as AOA text, the layout on a mesh,
and the tensors the checkpoint must hold. One module per family; `base` holds what they
share, `paddleformers` and `megatron` each target's conventions.

    from aoa.models import family_of, mapping_for
    mapping = mapping_for(json.load(open("config.json")), "paddleformers", Mesh(tp=4))
    print(mapping.forward)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aoa.models import (
    deepseek_v3,
    deepseek_v32,
    ernie4_5,
    ernie4_5_moe,
    gemma3,
    glm4_moe,
    gpt_oss,
    kimi_k2,
    llama,
    mixtral,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
    qwen3_next,
)
from aoa.models.base import Config, Family, Mesh, ModelError
from aoa.models.mapping import DTYPES, ModelMapping, build

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen2_moe.FAMILY, qwen3_moe.FAMILY, mixtral.FAMILY,
    deepseek_v3.FAMILY, deepseek_v32.FAMILY, glm4_moe.FAMILY, gpt_oss.FAMILY, gemma3.FAMILY,
    phi3.FAMILY, ernie4_5.FAMILY, ernie4_5_moe.FAMILY, kimi_k2.FAMILY, qwen3_next.FAMILY)
TARGETS = ("paddleformers", "megatron")


def known_model_types() -> list[str]:
    return sorted(t for family in FAMILIES for t in family.model_types)


def family_of(config: Config) -> Family:
    """The family of a config's `model_type`; an unknown one is an error that lists the
    known ones and says how to write a mapping by hand."""
    for family in FAMILIES:
        if config.model_type in family.model_types:
            return family
    what = f"model_type '{config.model_type}'" if config.model_type else "no model_type"
    raise ModelError(f"{config.path}: {what} is not a family aoa knows "
                     f"(known: {', '.join(known_model_types())})",
                     hint="Write the mapping by hand (`aoa mapping --config` of a similar "
                          "family is a start) and convert with `aoa convert MAPPING.aoa "
                          "--source ... --output ... --layout LAYOUT.toml`.")


def mapping_for(config: Mapping[str, Any] | Config, target: str, mesh: Mesh | None = None, *,
                dtype: str | None = None, source_dtypes: Mapping[str, str] | None = None,
                options: Mapping[str, str | None] | None = None) -> ModelMapping:
    """The mapping of a config.json (a dict) onto ``target`` at the given degrees;
    ``options``: the target's own (`megatron`: transformer_impl, experts)."""
    cfg = config if isinstance(config, Config) else Config(config)
    return build(family_of(cfg), cfg, target, mesh or Mesh(), dtype=dtype,
                 source_dtypes=source_dtypes, options=options)


__all__ = ["DTYPES", "FAMILIES", "TARGETS", "Config", "Family", "Mesh", "ModelError",
           "ModelMapping", "family_of", "known_model_types", "mapping_for"]
