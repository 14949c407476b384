"""Ask PaddleFormers 1.2.0 for the AOA statements it generates for a config.

A tool for the team, not part of aoa: it runs ONLY under the Paddle virtual environment
(`/work/paddle-venv/bin/python`, with paddlepaddle 3.3.1 and paddleformers 1.2.0)::

    /work/paddle-venv/bin/python bench/paddleformers_statements.py REQUEST.json

``REQUEST.json``: ``{"module": "qwen3", "class": "Qwen3ForCausalLM", "config": {...}}``,
the config being a Hugging Face config.json. It prints, as JSON,
``{"forward": [...], "inverse": [...]}``: what the class's ``_gen_aoa_config`` and
``_gen_inv_aoa_config`` return for that config.

Many PaddleFormers modeling modules import PaddleFleet (and its ops), which cannot be
installed here. The statements do not depend on it, so those imports are answered by
stand-ins: any ``paddlefleet*`` module is an empty module whose attributes are empty
classes. Nothing PaddleFleet would compute is used.
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import json
import sys
import types
from pathlib import Path


def install_paddlefleet_stand_ins() -> None:
    from paddleformers.transformers.utils import InitTrackerMeta

    class StandInClass(InitTrackerMeta, abc.ABCMeta):  # type: ignore[misc, valid-type]
        """A class any attribute of which is another stand-in class (or an empty table)."""

        def __getattr__(cls, name: str):
            if name.startswith("_"):
                raise AttributeError(name)
            if name.endswith("_rules"):  # class tables that subclasses extend with **
                return {}
            return stand_in(name)

    def stand_in(name: str) -> type:
        return StandInClass(name, (object,), {"__init__": lambda self, *a, **k: None})

    class StandInModule(types.ModuleType):
        def __getattr__(self, name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return stand_in(name)

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path, target=None):
            if fullname.split(".")[0] in ("paddlefleet", "paddlefleet_ops"):
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            module = StandInModule(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module) -> None:
            pass

    sys.meta_path.insert(0, Finder())
    import paddleformers.utils.import_utils as import_utils

    import_utils.is_paddlefleet_available = lambda: True


def config_class(module: str, model_type: str):
    configuration = importlib.import_module(f"paddleformers.transformers.{module}.configuration")
    for name in dir(configuration):
        candidate = getattr(configuration, name)
        if isinstance(candidate, type) and getattr(candidate, "model_type", None) == model_type:
            return candidate
    sys.exit(f"paddleformers.transformers.{module}.configuration has no config class for "
             f"model_type {model_type!r}")


def statements(request: dict) -> dict[str, list[str]]:
    with contextlib.redirect_stdout(sys.stderr):
        install_paddlefleet_stand_ins()
        modeling = importlib.import_module(f"paddleformers.transformers.{request['module']}"
                                           ".modeling")
        config = config_class(request["module"], request["config"]["model_type"])(
            **request["config"])
        model_class = getattr(modeling, request["class"])
        forward = model_class._gen_aoa_config(config)["aoa_statements"]
        inverse = model_class._gen_inv_aoa_config(config)["aoa_statements"]
    return {"forward": list(forward), "inverse": list(inverse)}


def main() -> int:
    request = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps(statements(request), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
