"""The export directory: written whole (staging directory renamed into place), files this package
did not write survive, an interrupted export is named as such when loaded and by the next export."""
from __future__ import annotations

import shutil
import signal
import sys

import pytest

from npu_testing import EXPORT_KW

pytestmark = pytest.mark.slow

CLI_FLAGS = ["--max-seq-len", "128", "--prefill-block", "16", "--kv-buckets", "32,64",
             "--layers-per-chunk", "1", "--weight-format", "fp32"]


def test_export_killed_while_writing(source_model, tmp_path, interrupt_while_writing):
    """SIGKILL while the exporter writes its chunk IRs: nothing at the output directory, the
    staging directory left loads as "incomplete export" and is named, with the command that
    removes it, by the next export; SIGTERM leaves nothing behind."""
    from optimum.intel import OVModelForCausalLM

    from aipc_kernels.core.atomic_output import IncompleteOutputError
    from optimum_npu import OVNPUModelForCausalLM, check_npu_ready

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "optimum_npu.cli", "-m", str(source_model("llama")), str(out),
           *CLI_FLAGS]
    writing = lambda staging: any(staging.glob("npu_layers_*.xml"))  # noqa: E731
    staging = interrupt_while_writing(cmd, out, signal.SIGKILL, ready=writing)
    assert sorted(p.name for p in tmp_path.iterdir()) == [staging.name]
    incomplete = f"incomplete export: writing {staging} was interrupted before it finished; " \
                 f"delete {staging} and export again"
    for load in (OVModelForCausalLM.from_pretrained, OVNPUModelForCausalLM, check_npu_ready):
        with pytest.raises(IncompleteOutputError) as err:
            load(staging)
        assert str(err.value) == incomplete
    import subprocess

    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and not out.exists(), res.stderr[-3000:]
    assert f"was interrupted and left {staging}" in res.stderr and f"`rm -rf {staging}`" in res.stderr
    shutil.rmtree(staging)
    interrupt_while_writing(cmd, out, signal.SIGTERM, ready=writing)
    assert list(tmp_path.iterdir()) == []


def test_user_files_in_the_export_directory_survive(source_model, tmp_path):
    """An export into a directory holding the user's own files adds its files beside them; a
    second export replaces what the first wrote (its KV-bucket IRs included) and nothing else."""
    from optimum_npu import check_npu_ready, export_npu_model

    out = tmp_path / "out"
    out.mkdir()
    (out / "npu_notes.txt").write_text("my notes")
    (out / "README.md").write_text("my readme")
    src = source_model("llama")
    export_npu_model(src, out, **{**EXPORT_KW, "kv_buckets": [32, 64]})
    assert list(out.glob("npu_layers_00_00_kv64.xml"))
    export_npu_model(src, out, **{**EXPORT_KW, "kv_buckets": [32]})
    assert (out / "npu_notes.txt").read_text() == "my notes"
    assert (out / "README.md").read_text() == "my readme"
    assert not list(out.glob("*kv64*"))  # the first export's own files are replaced
    check_npu_ready(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_export_refuses_to_overwrite_a_file_it_did_not_write(source_model, tmp_path):
    from aipc_kernels.core.atomic_output import OutputDirError
    from optimum_npu import export_npu_model

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(OutputDirError, match="output_dir=.* holds config.json, which this package "
                                             "did not write"):
        export_npu_model(source_model("llama"), out, **EXPORT_KW)
    assert (out / "config.json").read_text() == "{}" and sorted(p.name for p in out.iterdir()) == ["config.json"]


def test_half_written_export_is_reported_incomplete(exported, tmp_path):
    """The directories an interrupted export leaves (the chunk IRs without the manifest, which
    is written last; or a listed IR missing) fail to load with "incomplete export", not with
    optimum-intel's "library name could not be automatically inferred"."""
    from optimum.intel import OVModelForCausalLM

    from aipc_kernels.core.atomic_output import IncompleteOutputError
    from optimum_npu import OVNPUModelForCausalLM

    full = exported("llama")
    half = shutil.copytree(full, tmp_path / "half", ignore=shutil.ignore_patterns(
        "npu_export.json", "aipc_output.json", "npu_compile_cache"))
    with pytest.raises(IncompleteOutputError, match=f"incomplete export: {half} holds npu_.*xml but "
                                                    f"no npu_export.json.*delete {half} and export again"):
        OVModelForCausalLM.from_pretrained(half)
    with pytest.raises(IncompleteOutputError, match="incomplete export"):
        OVModelForCausalLM.from_pretrained(half, export_npu=True)
    gone = shutil.copytree(full, tmp_path / "gone", ignore=shutil.ignore_patterns("aipc_output.json"))
    (gone / "npu_head.bin").unlink()
    with pytest.raises(IncompleteOutputError, match=f"incomplete export: {gone} lacks npu_head.bin"):
        OVNPUModelForCausalLM(gone, device="CPU")


def test_temporary_export_is_removed_when_interrupted(source_model, tmp_path, monkeypatch,
                                                      interrupt_while_writing):
    """``from_pretrained(id, export_npu=True)`` without ``export_dir`` exports into
    ``$TMPDIR/optimum_npu_<pid>_*/model``: SIGTERM removes all of it; a SIGKILL leftover is named
    in a warning by the next such export; the directory goes with the model."""
    import gc
    import tempfile

    from optimum.intel import OVModelForCausalLM

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    src = source_model("llama")
    kw = ", ".join(f"{k}={v!r}" for k, v in EXPORT_KW.items())
    cmd = [sys.executable, "-c", "from optimum.intel import OVModelForCausalLM\n"
           f"OVModelForCausalLM.from_pretrained({str(src)!r}, export_npu=True, compile=False, {kw})"]

    def dest(pid: int):
        found = list(tmp.glob(f"optimum_npu_{pid}_*"))
        return found[0] / "model" if found else None

    writing = lambda staging: any(staging.glob("npu_layers_*.xml"))  # noqa: E731
    interrupt_while_writing(cmd, dest, signal.SIGTERM, ready=writing, env={"TMPDIR": str(tmp)})
    assert list(tmp.iterdir()) == []
    leftover = interrupt_while_writing(cmd, dest, signal.SIGKILL, ready=writing,
                                       env={"TMPDIR": str(tmp)}).parent
    assert list(tmp.iterdir()) == [leftover]

    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with pytest.warns(RuntimeWarning, match=f"left by interrupted runs: {leftover} .*"
                                            f"remove with `rm -rf {leftover}`"):
        model = OVModelForCausalLM.from_pretrained(src, export_npu=True, compile=False, **EXPORT_KW)
    assert model.model_dir.parent.parent == tmp and len(list(tmp.iterdir())) == 2
    del model
    gc.collect()
    assert list(tmp.iterdir()) == [leftover]
