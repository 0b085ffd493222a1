"""What a framework's plugin hook needs: importing the module that registers the plugin, with every
failure reported (vLLM's ``general_plugins`` hook ``vllm_lowbit.register`` uses it)."""
from __future__ import annotations

import importlib


def import_integration(package: str, module: str) -> bool:
    """Imports ``package.module`` (whose import performs the framework registration) and returns True;
    its import errors propagate. A ``SystemExit`` (or other ``BaseException`` but KeyboardInterrupt)
    raised by that import becomes a RuntimeError naming it, so the framework calling the hook reports it
    instead of its process ending silently."""
    name = f"{package}.{module}"
    try:
        importlib.import_module(name)
    except (Exception, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001
        raise RuntimeError(f"importing {name} raised {type(e).__name__}({e}); the plugin is not "
                           "registered") from e
    return True
