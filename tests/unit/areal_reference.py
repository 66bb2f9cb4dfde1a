"""AReaL's own ``StalenessManager`` class, loaded from the installed ``areal`` package
(``pip install --no-deps areal``; ``./run setup`` does it) without importing the package,
whose ``__init__`` pulls in torch.

``areal/infra/staleness_manager.py`` imports one name, ``RolloutStat``, from ``areal.api``
(which lives in ``areal/api/io_struct.py``, beside torch imports): that class is taken from
AReaL's own source (its definition alone) and handed to the manager's module while it loads.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import sys
import types
from pathlib import Path
from unittest import mock

AREAL_VERSION = "1.0.4"


def areal_root() -> Path:
    spec = importlib.util.find_spec("areal")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"AReaL is not installed: pip install --no-deps 'areal=={AREAL_VERSION}' "
                           "(./run setup does this)")
    return Path(next(iter(spec.submodule_search_locations)))


def _rollout_stat(root: Path) -> type:
    """``RolloutStat`` from AReaL's ``io_struct.py``: its definition only, run on its own."""
    tree = ast.parse((root / "api" / "io_struct.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RolloutStat")
    module = types.ModuleType("areal_reference_io_struct")
    module.dataclass = dataclasses.dataclass  # type: ignore[attr-defined]
    with mock.patch.dict(sys.modules, {module.__name__: module}):  # dataclass() looks its module up
        exec(compile(ast.Module(body=[node], type_ignores=[]), str(root / "api" / "io_struct.py"), "exec"),
             module.__dict__)
    stat: type = module.RolloutStat
    return stat


def load_staleness_manager() -> type:
    """AReaL's ``areal.infra.staleness_manager.StalenessManager``."""
    root = areal_root()
    api = types.ModuleType("areal.api")
    api.RolloutStat = _rollout_stat(root)  # type: ignore[attr-defined]
    path = root / "infra" / "staleness_manager.py"
    spec = importlib.util.spec_from_file_location("areal_reference_staleness_manager", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with mock.patch.dict(sys.modules, {"areal.api": api}):
        spec.loader.exec_module(module)
    manager: type = module.StalenessManager
    return manager
