"""Post-import hooks: how plugins reach frameworks that have no plugin entry points.

optimum-intel and transformers offer no entry points, so the package installs one line,
``aipc_plugins.pth``, that imports this module at interpreter start. It only appends a
meta-path finder (no framework is imported, nothing else runs). When one of the modules in
:data:`POST_IMPORT_HOOKS` is imported later, its import completes normally and then the
listed ``"package.module:function"`` hooks are called with the module object.

Guarantees: a hook that raises (anything but KeyboardInterrupt, SystemExit included) becomes a
warning naming the exception (the framework import still succeeds); each
hook runs at most once per process; ``AIPC_PLUGINS_AUTOLOAD=0`` disables everything; a
framework that is never imported costs nothing beyond this module's import.
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # kept out of interpreter start-up, which imports this module
    import types
    from importlib.machinery import ModuleSpec
    from typing import Dict, Optional, Sequence, Tuple

#: target module (imported by the user's code) -> hooks called after it has been executed
POST_IMPORT_HOOKS: "Dict[str, Tuple[str, ...]]" = {
    "optimum.intel.openvino.modeling_decoder": ("optimum_npu.hook:install",),
    "transformers.modeling_utils": ("ipex_segment_kv.hook:install",),
}

ENV_SWITCH = "AIPC_PLUGINS_AUTOLOAD"
_fired: set = set()


def enabled() -> bool:
    """False when the user set ``AIPC_PLUGINS_AUTOLOAD=0``."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def run_hooks(module: types.ModuleType, hooks: Sequence[str]) -> None:
    """Calls each ``"pkg.mod:function"`` hook with ``module``, once per process; failures warn."""
    for hook in hooks:
        if hook in _fired:
            continue
        _fired.add(hook)
        try:
            target, _, attr = hook.partition(":")
            getattr(importlib.import_module(target), attr)(module)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - a plugin must never break (nor end: SystemExit) the import
            import warnings

            warnings.warn(
                f"aipc-plugins: hook {hook} for {module.__name__} failed ({type(e).__name__}: {e}); "
                f"{module.__name__} works as without the plugin. Set {ENV_SWITCH}=0 to skip the hooks.",
                RuntimeWarning,
                stacklevel=2,
            )


class _HookedLoader:
    """Delegates to the real loader, then runs the hooks on the executed module."""

    def __init__(self, loader, finder: "PostImportFinder", name: str):
        self._loader = loader
        self._finder = finder
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        # the module's own loader stays visible to introspection (inspect, pkgutil, resources)
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        hooks = self._finder.table.pop(self._name, ())
        if not self._finder.table:  # the last hooked module: leave the import system as it was
            uninstall()
        run_hooks(module, hooks)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class PostImportFinder:
    """Meta-path finder that wraps the loader of the hooked modules; finds nothing itself."""

    def __init__(self, table: Dict[str, Tuple[str, ...]]):
        self.table = dict(table)

    def find_spec(self, fullname: str, path=None, target=None) -> Optional[ModuleSpec]:
        # nothing is consumed here: ``importlib.util.find_spec`` may ask without importing
        if fullname not in self.table:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HookedLoader(spec.loader, self, fullname)
                return spec
        return None


def install(table: Optional[Dict[str, Tuple[str, ...]]] = None) -> Optional[PostImportFinder]:
    """Adds the finder to ``sys.meta_path`` (once); for modules already imported, runs the hooks now."""
    if not enabled():
        return None
    for finder in sys.meta_path:
        if isinstance(finder, PostImportFinder):
            return finder
    pending = {}
    for name, hooks in (POST_IMPORT_HOOKS if table is None else table).items():
        if name in sys.modules:
            run_hooks(sys.modules[name], hooks)
        else:
            pending[name] = tuple(hooks)
    if not pending:
        return None
    finder = PostImportFinder(pending)
    sys.meta_path.insert(0, finder)
    return finder


def uninstall() -> None:
    """Removes the finder from ``sys.meta_path``."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, PostImportFinder)]


def _from_pth() -> None:
    """Entry from ``aipc_plugins.pth``: never lets an error escape into interpreter start-up."""
    try:
        install()
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 # pragma: no cover - defensive
        print(f"aipc-plugins: import hooks disabled ({type(e).__name__}: {e})", file=sys.stderr)
