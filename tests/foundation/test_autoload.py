"""The post-import hooks installed by ``aipc_plugins.pth`` (optimum-intel/transformers have no entry points)."""
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

from aipc_kernels import _autoload


def _run(code: str, **env) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env={**os.environ, **env}, timeout=120
    )


def test_pth_is_installed_and_puts_the_finder_first_at_startup():
    assert (Path(sysconfig.get_paths()["purelib"]) / "aipc_plugins.pth").is_file()
    code = """
        import sys
        from aipc_kernels._autoload import PostImportFinder, POST_IMPORT_HOOKS
        assert any(isinstance(f, PostImportFinder) for f in sys.meta_path), sys.meta_path
        heavy = [m for m in ('torch', 'transformers', 'optimum', 'openvino') if m in sys.modules]
        assert not heavy, heavy
    """
    r = _run(code)
    assert r.returncode == 0, r.stderr


def test_switch_disables_the_hooks():
    r = _run(
        "import sys; from aipc_kernels._autoload import PostImportFinder as F; "
        "assert not any(isinstance(f, F) for f in sys.meta_path)",
        AIPC_PLUGINS_AUTOLOAD="0",
    )
    assert r.returncode == 0, r.stderr


def test_hooks_run_once_after_the_import_and_failures_only_warn():
    code = """
        import importlib.util, sys, types, warnings
        from aipc_kernels import _autoload as a
        a.uninstall()
        calls = []
        hooks = types.ModuleType("hooks_for_test")
        hooks.ok = lambda m: calls.append((m.__name__, hasattr(m, "parseString")))
        hooks.bad = lambda m: 1 / 0
        sys.modules["hooks_for_test"] = hooks
        a.install({"xml.dom.minidom": ("hooks_for_test:ok",), "email.parser": ("hooks_for_test:bad",)})
        assert importlib.util.find_spec("xml.dom.minidom") is not None and calls == []  # asking is not importing
        import xml.dom.minidom
        import importlib; importlib.reload(xml.dom.minidom)
        assert calls == [("xml.dom.minidom", True)], calls  # after execution, once
        assert type(xml.dom.minidom.__spec__.loader).__name__ == "SourceFileLoader"
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import email.parser  # the hook raises: the import still succeeds
        assert email.parser.Parser and "ZeroDivisionError" in str(w[0].message), w
        assert not any(isinstance(f, a.PostImportFinder) for f in sys.meta_path)  # gone when all fired
    """
    r = _run(code)
    assert r.returncode == 0, r.stderr


def test_a_hook_raising_system_exit_only_warns():
    """SystemExit (not an Exception) from a hook must not end the process that imports the framework."""
    code = """
        import sys, types, warnings
        from aipc_kernels import _autoload as a
        a.uninstall()
        hooks = types.ModuleType("hooks_for_test")
        def leave(m):
            raise SystemExit(3)
        hooks.leave = leave
        sys.modules["hooks_for_test"] = hooks
        a.install({"email.parser": ("hooks_for_test:leave",)})
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import email.parser
        assert email.parser.Parser and "SystemExit: 3" in str(w[0].message), [str(x.message) for x in w]
        print("still running")
    """
    r = _run(code)
    assert r.returncode == 0 and "still running" in r.stdout, (r.returncode, r.stderr)


def test_every_hook_names_an_importable_plugin_module():
    for target, hooks in _autoload.POST_IMPORT_HOOKS.items():
        for hook in hooks:
            module, _, attr = hook.partition(":")
            assert module.split(".")[0] in {"optimum_npu", "ipex_segment_kv", "vllm_lowbit"} and attr, hook
