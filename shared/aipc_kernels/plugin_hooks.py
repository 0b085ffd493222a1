"""What the plugins' entry-point hooks share: activating an integration module that may not exist yet."""
from __future__ import annotations

import importlib


def import_integration(package: str, module: str) -> bool:
    """Imports ``package.module`` (whose import performs the framework registration); returns False
    when that module does not exist, and re-raises any other import error."""
    name = f"{package}.{module}"
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        return False
    return True
