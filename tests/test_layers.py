"""Layers only look down: text -> passes -> plan (plain data) -> runtime -> storage, with the
jobs on top and the command line above them. Every import in the package, including those
inside functions, is checked against what its layer may see."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "python" / "aoa"

#: module prefix -> the aoa modules it must not import (by prefix)
FORBIDDEN = {
    "aoa.plan": ("aoa.runtime", "aoa.storage", "aoa.jobs", "aoa.passes", "aoa.pipeline"),
    "aoa.passes": ("aoa.runtime", "aoa.storage", "aoa.jobs"),
    "aoa.runtime": ("aoa.jobs", "aoa.passes", "aoa.pipeline"),
    "aoa.storage": ("aoa.runtime", "aoa.jobs", "aoa.passes", "aoa.pipeline", "aoa.plan"),
    "aoa.layout": ("aoa.runtime", "aoa.storage", "aoa.jobs", "aoa.passes", "aoa.pipeline"),
    # what people hand over, a checkpoint's shard descriptions included (`--source`)
    "aoa.mapping": ("aoa.runtime", "aoa.jobs", "aoa.passes", "aoa.pipeline"),
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {name for name in names if name == "aoa" or name.startswith("aoa.")}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("module", sorted(_modules()))
def test_imports_look_down(module: str) -> None:
    imported = _imports(_modules()[module])
    if module != "aoa.cli":
        assert not [name for name in imported if _under(name, "aoa.cli")], \
            f"{module}: the library never imports the command line"
    for layer, forbidden in FORBIDDEN.items():
        if _under(module, layer):
            wrong = sorted(name for name in imported for f in forbidden if _under(name, f))
            assert not wrong, f"{module} imports {wrong}, above its layer"
