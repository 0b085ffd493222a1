"""What the plugins' entry-point hooks share: activating an integration module that may not exist yet."""
from __future__ import annotations

import importlib


def import_integration(package: str, module: str) -> bool:
    """Imports ``package.module`` (whose import performs the framework registration); returns False
    when that module does not exist, and re-raises any other import error. A ``SystemExit`` (or other
    ``BaseException`` but KeyboardInterrupt) raised by that import becomes a RuntimeError naming it, so
    the framework calling the hook reports it instead of its process ending silently."""
    name = f"{package}.{module}"
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        return False
    except (Exception, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001
        raise RuntimeError(f"importing {name} raised {type(e).__name__}({e}); the plugin is not "
                           "registered") from e
    return True
