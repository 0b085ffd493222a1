"""The fused decoder layer (``optimize(model)`` and the zero-code path): supported architectures run
``aipc_kernels.decoder.decoder_layer`` and give stock transformers' sequences and scores; ``undo`` gives back the same
modules; unsupported layers keep their stock forward."""
from __future__ import annotations

import pickle

import pytest
import torch

from test_generate import BEAM_KW, PROMPTS, _assert_same_beams, _inputs

FUSED_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "phi3")


@pytest.fixture(scope="module")
def fresh(tiny_model):
    """``fresh(arch, dtype="float32", attn="sdpa") -> (model, tokenizer)``: a new load each call (these tests
    change classes and options)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(arch: str, dtype: str = "float32", attn: str = "sdpa"):
        path = tiny_model(arch, dtype="float32")
        tok = AutoTokenizer.from_pretrained(path, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation=attn)
        return model.eval(), tok

    return load


def _count_fused_calls(monkeypatch) -> list:
    import ipex_segment_kv.fused_layers as fl

    calls = []
    original = fl.decoder_layer

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(fl, "decoder_layer", counting)
    return calls


@pytest.mark.parametrize("arch", FUSED_ARCHS)
@pytest.mark.parametrize("num_beams", [1, 2, 4, 8])
@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "single"])
def test_fused_layers_match_stock(pair, arch, num_beams, padded, monkeypatch):
    """Every layer runs fused (prefill and decode steps) and the beams equal stock transformers' (fp32, 1e-4)."""
    import ipex_segment_kv.fused_layers as fl

    stock, seg, tok = pair(arch)
    enc = _inputs(tok, padded)
    a = stock.generate(**enc, num_beams=num_beams, **BEAM_KW)
    calls = _count_fused_calls(monkeypatch)
    b = seg.generate(**enc, num_beams=num_beams, **BEAM_KW)
    _assert_same_beams(a, b, num_beams)
    layers = seg.config.num_hidden_layers
    assert getattr(seg, fl.FUSION_REPORT) == dict(fused=layers, kept={}, lm_head=True)
    assert all(isinstance(layer, fl.FusedDecoderLayer) for layer in fl.decoder_layers(seg))
    B = enc["input_ids"].shape[0]
    assert calls[0][0] == B and calls[-1] == (B * num_beams, 1, seg.config.hidden_size)  # prompt once, then rows
    assert len(calls) == layers * len(a.scores)


def snapshot(model) -> tuple[dict, dict]:
    """The model's modules with their classes, and its tensors with a copy of their values."""
    return ({name: (type(m), m) for name, m in model.named_modules()},
            {name: (t, t.clone()) for name, t in model.state_dict(keep_vars=True).items()})  # fmt: skip


def assert_restored(model, snap: tuple[dict, dict]) -> None:
    """The same module objects with the same classes, the same tensors with the same bits as in ``snap``."""
    before, tensors = snap
    after = {name: (type(m), m) for name, m in model.named_modules()}
    assert after.keys() == before.keys()
    for name, (cls, module) in before.items():
        assert after[name][0] is cls and after[name][1] is module, name
    for name, t in model.state_dict(keep_vars=True).items():
        original, values = tensors[name]
        assert t is original and torch.equal(t, values), name


@pytest.mark.parametrize("arch", FUSED_ARCHS)
def test_explicit_optimize_and_undo_give_back_the_same_modules(fresh, arch):
    import ipex_segment_kv

    model, tok = fresh(arch)
    stock, _ = fresh(arch)
    snap = snapshot(model)
    enc = _inputs(tok, padded=True)
    ipex_segment_kv.optimize(model)
    assert type(model.model.layers[0]).__name__.startswith("Fused")
    assert isinstance(model.model.layers[0], type(stock.model.layers[0]))  # a subclass: isinstance still holds
    _assert_same_beams(stock.generate(**enc, num_beams=4, **BEAM_KW), model.generate(**enc, num_beams=4, **BEAM_KW), 4)
    ipex_segment_kv.undo(model)
    assert_restored(model, snap)
    assert model.config._attn_implementation == "sdpa"
    assert not hasattr(model, "_aipc_segment_kv_fusion")


def test_hidden_states_and_attention_outputs_as_stock(fresh):
    """output_hidden_states is recorded from the fused layers (hooks on the instances); output_attentions
    takes the stock forward, which can return the weights."""
    import ipex_segment_kv

    model, tok = fresh("qwen3")
    stock, _ = fresh("qwen3")
    ipex_segment_kv.optimize(model)
    model.set_attn_implementation("eager")
    stock.set_attn_implementation("eager")
    enc = _inputs(tok, padded=True)
    with torch.no_grad():
        a = stock(**enc, output_hidden_states=True, output_attentions=True)
        b = model(**enc, output_hidden_states=True, output_attentions=True)
        c = model(**enc, output_hidden_states=True)
    keep = enc["attention_mask"].bool()
    assert len(b.hidden_states) == len(a.hidden_states) == len(c.hidden_states)
    for ha, hb, hc in zip(a.hidden_states, b.hidden_states, c.hidden_states):
        torch.testing.assert_close(hb[keep], ha[keep], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hc[keep], ha[keep], atol=1e-5, rtol=1e-5)
    assert b.attentions is not None and len(b.attentions) == len(a.attentions)
    for wa, wb in zip(a.attentions, b.attentions):
        torch.testing.assert_close(wb, wa, atol=1e-6, rtol=1e-6)


def test_layers_outside_the_fused_form_keep_their_forward(fresh):
    """A replaced projection (a subclass of nn.Linear, as a quantization library installs) and an architecture
    outside the list: those layers stay stock, without an error, and generation still matches."""
    import ipex_segment_kv
    import ipex_segment_kv.fused_layers as fl

    class MyLinear(torch.nn.Linear):
        pass

    model, tok = fresh("llama")
    stock, _ = fresh("llama")
    q = model.model.layers[0].self_attn.q_proj
    q.__class__ = MyLinear
    ipex_segment_kv.optimize(model)
    report = getattr(model, fl.FUSION_REPORT)
    assert report["fused"] == model.config.num_hidden_layers - 1
    assert report["kept"] == {"its projections are not all plain nn.Linear or all aipc LowBitLinear (quantized "
                             "otherwise or replaced)": 1}
    assert not isinstance(model.model.layers[0], fl.FusedDecoderLayer)
    enc = _inputs(tok, padded=True)
    _assert_same_beams(stock.generate(**enc, num_beams=4, **BEAM_KW), model.generate(**enc, num_beams=4, **BEAM_KW), 4)

    neox, _ = fresh("gpt_neox")
    ipex_segment_kv.optimize(neox)
    report = getattr(neox, fl.FUSION_REPORT)
    assert report["fused"] == 0 and report["lm_head"] is False
    assert list(report["kept"]) == ["model_type 'gpt_neox' is not one of " + str(fl.FUSED_MODEL_TYPES)]


def test_opting_out(fresh, monkeypatch):
    import ipex_segment_kv
    import ipex_segment_kv.fused_layers as fl

    enc_kw = dict(num_beams=2, max_new_tokens=4)
    monkeypatch.setenv(fl.ENV_SWITCH, "0")
    model, tok = fresh("mistral", attn="segment_kv")
    enc = _inputs(tok, padded=True)
    model.generate(**enc, **enc_kw)
    assert not fl.is_fused(model)  # zero-code path, switched off
    monkeypatch.delenv(fl.ENV_SWITCH)
    ipex_segment_kv.optimize(model, fuse_layers=False)
    model.generate(**enc, **enc_kw)
    assert not fl.is_fused(model)  # explicit opt-out holds for later generate calls
    ipex_segment_kv.optimize(model)
    assert fl.is_fused(model)
    model2, _ = fresh("mistral", attn="segment_kv")
    model2.generate(**enc, **enc_kw)
    assert fl.is_fused(model2)  # the zero-code default


def test_bf16_fused_model_close_to_stock(fresh):
    """bf16: the fused layers round where the modules round; the logits of the prompt and of the first
    steps stay within bf16 noise of the stock model's."""
    import ipex_segment_kv

    model, tok = fresh("llama", dtype="bfloat16")
    stock, _ = fresh("llama", dtype="bfloat16")
    ipex_segment_kv.optimize(model)
    enc = _inputs(tok, padded=True)
    keep = enc["attention_mask"].bool()
    with torch.no_grad():
        a = stock(**enc).logits.float()
        b = model(**enc).logits.float()
    torch.testing.assert_close(b[keep], a[keep], atol=0.1, rtol=0.05)
    kw = dict(do_sample=False, max_new_tokens=3, return_dict_in_generate=True, output_scores=True)
    sa = stock.generate(**enc, num_beams=1, **kw).scores
    sb = model.generate(**enc, num_beams=1, **kw).scores
    torch.testing.assert_close(sb[0], sa[0], atol=0.1, rtol=0.05)


def test_fused_model_pickles(fresh):
    import ipex_segment_kv

    model, tok = fresh("phi3")
    ipex_segment_kv.optimize(model)
    clone = pickle.loads(pickle.dumps(model))
    assert type(clone.model.layers[0]) is type(model.model.layers[0])
    enc = tok(PROMPTS[:1], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(clone(**enc).logits, model(**enc).logits)


def test_training_mode_and_autograd_take_the_stock_forward(fresh):
    import ipex_segment_kv

    model, tok = fresh("llama")
    ipex_segment_kv.optimize(model)
    enc = tok(PROMPTS[:1], return_tensors="pt")
    out = model(**enc, labels=enc["input_ids"])
    out.loss.backward()  # the fused op has no backward: gradients flow through the stock forward
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
