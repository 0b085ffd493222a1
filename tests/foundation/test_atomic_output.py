"""aipc_kernels.core.atomic_output: outputs appear whole or not at all, files this package did not write
survive, interrupted runs are cleaned up (exception, SIGTERM) or named (SIGKILL)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aipc_kernels.core.atomic_output import (RECORD_NAME, IncompleteOutputError, OutputDirError,
                                        atomic_output_dir, check_complete)

KW = dict(what="export", redo="export again", param="output_dir")


def _write(dest: Path, names: dict[str, str], **kw) -> None:
    with atomic_output_dir(dest, **{**KW, **kw}) as part:
        assert part.parent == dest.parent and not dest.joinpath("a").exists()
        for n, text in names.items():
            (part / n).write_text(text)


def test_appears_whole_with_its_record(tmp_path):
    _write(tmp_path / "new" / "out", {"a": "1", "b": "2"})
    (tmp_path / "empty").mkdir()
    _write(tmp_path / "empty", {"a": "1"})
    for d in (tmp_path / "new" / "out", tmp_path / "empty"):
        record = json.loads((d / RECORD_NAME).read_text())
        assert record["complete"] is True and set(record["files"]) <= {"a", "b"}
        check_complete(d, "export", "export again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "new"]  # no staging left


def test_failure_leaves_nothing(tmp_path):
    dest = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_output_dir(dest, **KW) as part:
            (part / "a").write_text("1")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_non_empty_destination_refused_without_keep_others(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("user")
    with pytest.raises(OutputDirError, match=r"output_dir='.*out' is not empty \(holds mine.txt\)"):
        _write(tmp_path / "out", {"a": "1"})
    assert (tmp_path / "out" / "mine.txt").read_text() == "user"


def test_keep_others_replaces_only_what_it_wrote(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "npu_notes.txt").write_text("user notes")
    _write(dest, {"npu_a.xml": "1", "npu_old.xml": "old"}, keep_others=True)
    _write(dest, {"npu_a.xml": "2", "npu_b.xml": "3"}, keep_others=True)
    assert sorted(p.name for p in dest.iterdir()) == [RECORD_NAME, "npu_a.xml", "npu_b.xml",
                                                      "npu_notes.txt"]
    assert (dest / "npu_notes.txt").read_text() == "user notes" and (dest / "npu_a.xml").read_text() == "2"
    # a file the output would overwrite and that this package did not write: refused, untouched
    (dest / "config.json").write_text("user config")
    with pytest.raises(OutputDirError, match="holds config.json, which this package did not write"):
        with atomic_output_dir(dest, keep_others=True, always_writes=["config.json"], **KW):
            pytest.fail("refused before any work")
    with pytest.raises(OutputDirError, match="holds config.json"):
        _write(dest, {"config.json": "ours"}, keep_others=True)
    assert (dest / "config.json").read_text() == "user config"
    assert (dest / "npu_a.xml").read_text() == "2"  # the refused output changed nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from aipc_kernels.core.atomic_output import atomic_output_dir
    with atomic_output_dir(Path(sys.argv[1]), what="export", redo="export again") as part:
        (part / "big.bin").write_bytes(b"x" * 4096)
        print("writing", flush=True)
        time.sleep(60)
""")


def _default_sigint() -> None:
    """The writer starts with SIGINT's default disposition, as from a terminal: a test run started in
    the background (``cmd &`` in a non-interactive shell) ignores SIGINT, and Python then installs no
    KeyboardInterrupt handler (so atomic_output_dir rightly takes none, and Ctrl-C would do nothing)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(dest: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(dest)], stdout=subprocess.PIPE,
                            text=True, env=env, preexec_fn=_default_sigint)
    assert proc.stdout.readline().strip() == "writing", proc.communicate(timeout=30)
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_removes_the_staging_directory(tmp_path, sig):
    proc = _start(tmp_path / "out")
    assert len(list(tmp_path.iterdir())) == 1  # the staging directory
    proc.send_signal(sig)
    assert proc.wait(timeout=30) != 0
    assert list(tmp_path.iterdir()) == []


def test_sigkill_leftover_is_named_and_reads_as_incomplete(tmp_path):
    dest = tmp_path / "out"
    proc = _start(dest)
    proc.kill()
    proc.wait(timeout=30)
    (staging,) = tmp_path.iterdir()
    assert staging.name == f"out.partial-{proc.pid}" and not dest.exists()
    with pytest.raises(IncompleteOutputError, match=f"incomplete export: writing {staging} was "
                                                    f"interrupted.*delete {staging} and export again"):
        check_complete(staging, "export", "export again")
    with pytest.raises(OutputDirError) as err:
        _write(dest, {"a": "1"})
    assert f"was interrupted and left {staging}" in str(err.value)
    assert f"`rm -rf {staging}`" in str(err.value)
    subprocess.run(["rm", "-rf", str(staging)], check=True)
    _write(dest, {"a": "1"})
    assert (dest / "a").read_text() == "1"


def test_running_writer_is_not_mistaken_for_a_leftover(tmp_path):
    proc = _start(tmp_path / "out")
    try:
        with pytest.raises(OutputDirError, match=f"being written by another run right now "
                                                 f"\\(process {proc.pid}"):
            _write(tmp_path / "out", {"a": "1"})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert list(tmp_path.iterdir()) == []


def test_signal_swallowed_by_native_code_still_ends_as_interrupted(tmp_path):
    """torch can catch the handler's exception and raise a ValueError instead (seen mid-write in the
    converter): the block still ends with SIGTERM's exit status, the staging directory removed."""
    from aipc_kernels.core.atomic_output import signals_raise

    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        pytest.skip("SIGTERM has an application handler here; signals_raise leaves it alone")

    def swallowing_call() -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a point where the handler runs
        except BaseException:
            pass
        raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'")

    with pytest.raises(SystemExit) as e:
        with atomic_output_dir(tmp_path / "out", **KW) as part:
            (part / "a").write_text("1")
            swallowing_call()
    assert e.value.code == 128 + signal.SIGTERM and isinstance(e.value.__cause__, ValueError)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="no signal"):  # without a signal, the error is the error
        with signals_raise():
            raise ValueError("no signal")
