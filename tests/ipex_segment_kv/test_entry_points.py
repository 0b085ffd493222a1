"""The two ways users reach the plugin: the import hook (no code change) and optimize()/undo()."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = sys.argv[1]
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    enc = tok(["The old engineer reads", "Why is the sky blue? Maybe."], return_tensors="pt", padding=True)
    kw = dict(num_beams=4, max_new_tokens=8, return_dict_in_generate=True, output_scores=True)
    seg = AutoModelForCausalLM.from_pretrained(path, attn_implementation="segment_kv").eval()
    b = seg.generate(**enc, **kw)
    stock = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    a = stock.generate(**enc, **kw)
    print(json.dumps(dict(
        cache=type(b.past_key_values).__name__,
        same=bool(torch.equal(a.sequences, b.sequences)),
        score_diff=float((a.sequences_scores - b.sequences_scores).abs().max()),
        plugin_imported_by_user=False,
    )))
    """
)


def test_import_hook_in_a_fresh_interpreter(tiny_model):
    """``from_pretrained(attn_implementation="segment_kv")`` + ``generate(num_beams=4)`` in a process that
    never imports the plugin: the package's .pth import hook registers it when transformers loads."""
    import json

    pth = os.path.join(sysconfig.get_paths()["purelib"], "aipc_plugins.pth")
    assert os.path.exists(pth), f"{pth} is missing: reinstall aipc-plugins (pip install -e .)"
    path = tiny_model("llama", dtype="float32")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("AIPC_PLUGINS_AUTOLOAD", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["cache"] == "SegmentKVCache"
    assert result["same"] and result["score_diff"] <= 1e-4

    env["AIPC_PLUGINS_AUTOLOAD"] = "0"  # switched off: the name is unknown to transformers
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0 and "segment_kv" in proc.stderr


def test_optimize_and_undo(pair):
    import ipex_segment_kv
    from ipex_segment_kv import SegmentKVCache

    stock, _, tok = pair("gpt_neox")
    model = type(stock).from_pretrained(stock.name_or_path, attn_implementation="sdpa").eval()
    enc = tok(["The old engineer reads a long letter", "Why is the sky"], return_tensors="pt", padding=True)
    kw = dict(num_beams=4, max_new_tokens=8, return_dict_in_generate=True, output_scores=True)
    ref = stock.generate(**enc, **kw)

    assert ipex_segment_kv.optimize(model) is model
    assert model.config._attn_implementation == "segment_kv"
    out = model.generate(**enc, **kw)
    assert isinstance(out.past_key_values, SegmentKVCache)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, atol=1e-4, rtol=0)

    ipex_segment_kv.undo(model)
    assert model.config._attn_implementation == "sdpa"
    out = model.generate(**enc, **kw)
    assert not isinstance(out.past_key_values, SegmentKVCache)
    assert torch.equal(out.sequences, ref.sequences)


def test_package_import_is_light():
    """Importing the plugin package imports neither torch nor transformers."""
    code = "import sys, ipex_segment_kv; print(any(m in sys.modules for m in ('torch', 'transformers')))"
    env = dict(os.environ, AIPC_PLUGINS_AUTOLOAD="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("kw, message", [
    (dict(response_step=True), "ipex_segment_kv.optimize: response_step=True must be an integer >= 1, e.g. 16"),
    (dict(response_step=16.0), "response_step=16.0 must be an integer >= 1"),
    (dict(response_step="16"), "response_step='16' must be an integer >= 1"),
    (dict(response_step=0), "response_step=0 must be an integer >= 1"),
    (dict(inplace="no"), "inplace='no' is not supported; use one of True (it would copy the weights"),
    (dict(inplace=0), "inplace=0 is not supported"),
    (dict(inplace=False), "inplace=False is not supported"),
    (dict(fuse_layers="no"), "fuse_layers='no' is not supported"),
    (dict(fuse_layers=1), "fuse_layers=1 is not supported"),
])  # fmt: skip
def test_optimize_keywords_are_checked(pair, kw, message):
    """optimize's keywords: exact types (True is not a step, "no" is not a bool), checked before the
    model is touched (issue 19)."""
    import ipex_segment_kv

    stock, _, _ = pair("llama")
    model = type(stock).from_pretrained(stock.name_or_path, attn_implementation="sdpa").eval()
    with pytest.raises(ValueError) as e:
        ipex_segment_kv.optimize(model, **kw)
    assert message in str(e.value)
    assert model.config._attn_implementation == "sdpa"
    assert not type(model.model.layers[0]).__name__.startswith("Fused")
