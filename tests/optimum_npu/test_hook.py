"""The user-facing paths: plain optimum-intel code in a fresh interpreter (the .pth autoloader),
the optimum-cli command, and the hook's guards."""
from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from npu_testing import EXPORT_KW, PROMPT

pytestmark = pytest.mark.slow


def _python(code: str, **env) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env}, timeout=900)


def test_plain_optimum_code_exports_and_reloads(source_model, tmp_path):
    """``OVModelForCausalLM.from_pretrained(id, export_npu=True)`` with nothing but the install,
    then ``from_pretrained(saved_dir)``: same tokens as transformers eager."""
    from transformers import AutoTokenizer

    from npu_testing import eager_greedy

    src = source_model("llama")
    kw = ", ".join(f"{k}={v!r}" for k, v in EXPORT_KW.items())
    code = f"""
import json, torch
from optimum.intel import OVModelForCausalLM
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained({str(src)!r})
ids = tok({PROMPT!r}, return_tensors="pt").input_ids
m = OVModelForCausalLM.from_pretrained({str(src)!r}, export_npu=True, device="CPU",
                                       ov_config={{"INFERENCE_PRECISION_HINT": "f32"}}, {kw})
a = m.generate(ids, max_new_tokens=64, do_sample=False)[0].tolist()
m.save_pretrained({str(tmp_path / 'saved')!r})
again = OVModelForCausalLM.from_pretrained({str(tmp_path / 'saved')!r}, device="CPU",
                                           ov_config={{"INFERENCE_PRECISION_HINT": "f32"}})
b = again.generate(ids, max_new_tokens=64, do_sample=False)[0].tolist()
try:
    OVModelForCausalLM.from_pretrained({str(src)!r}, export_npu=True, max_seq_lenn=64)
    wrong = "no error"
except TypeError as e:
    wrong = str(e)
try:
    OVModelForCausalLM.from_pretrained({str(src)!r}, max_seq_len=64)
    alone = "no error"
except TypeError as e:
    alone = str(e)
print(json.dumps(dict(a=a, b=b, cls=[type(m).__name__, type(again).__name__], wrong=wrong, alone=alone)))
"""
    res = _python(code)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    ids = AutoTokenizer.from_pretrained(src)(PROMPT, return_tensors="pt").input_ids
    want = eager_greedy(src, ids, 64)[0].tolist()
    assert out["a"] == want and out["b"] == want
    assert out["cls"] == ["OVNPUModelForCausalLM", "OVNPUModelForCausalLM"]
    assert "max_seq_lenn" in out["wrong"] and "accepted" in out["wrong"]
    assert "only apply with export_npu=True" in out["alone"]


def test_autoload_disabled_leaves_optimum_untouched():
    res = _python("import optimum.intel.openvino.modeling_decoder as m; "
                  "print('_optimum_npu_original_from_pretrained' in m.OVModelForCausalLM.__dict__)",
                  AIPC_PLUGINS_AUTOLOAD="0")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "False"


def test_install_is_idempotent_and_version_guarded(monkeypatch):
    import optimum.intel.openvino.modeling_decoder as md

    from optimum_npu import hook

    hook.install(md)
    wrapped = md.OVModelForCausalLM.__dict__["from_pretrained"]
    hook.install(md)
    assert md.OVModelForCausalLM.__dict__["from_pretrained"] is wrapped

    class Fresh:
        from_pretrained = classmethod(lambda cls, *a, **k: "stock")

    monkeypatch.setattr(hook, "_version_ok", lambda: (False, "9.9.0"))
    with pytest.warns(RuntimeWarning, match="optimum-intel 9.9.0 is outside the supported range"):
        hook.install(types.SimpleNamespace(OVModelForCausalLM=Fresh))
    assert Fresh.from_pretrained() == "stock"


def test_optimum_cli_export_openvino_npu(source_model, tmp_path):
    import shutil
    from pathlib import Path

    cli = shutil.which("optimum-cli") or str(Path(sys.executable).parent / "optimum-cli")
    out = tmp_path / "cli"
    res = subprocess.run([cli, "export", "openvino-npu", "-m", str(source_model("qwen2")), str(out),
                          "--max-seq-len", "64", "--prefill-block", "16", "--kv-buckets", "32",
                          "--layers-per-chunk", "2", "--weight-format", "int8"],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    manifest = json.loads((out / "npu_export.json").read_text())
    assert manifest["kv_buckets"] == [32, 64] and manifest["quantization"]["mode"] == "int8_sym"
    assert (out / "openvino_tokenizer.xml").is_file() and (out / "openvino_detokenizer.xml").is_file()
    bad = subprocess.run([cli, "export", "openvino-npu", "-m", str(source_model("qwen2")),
                          str(tmp_path / "bad"), "--weight-format", "int4", "--no-sym"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "INT4 asym" in bad.stderr
