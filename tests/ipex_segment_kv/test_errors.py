"""Clear errors: unsupported architectures and dtypes, too many beams, cache reuse, conflicting options."""
from __future__ import annotations

import pytest
import torch


def _enc(tok):
    return tok(["The old engineer reads a long letter"], return_tensors="pt")


def _check_the_advised_fix(error: Exception, load) -> None:
    """The ``attn_implementation='...'`` an error advises loads the model with it, and that model
    runs a beam search."""
    import re

    fix = re.search(r"attn_implementation='(\w+)'", str(error))
    assert fix, str(error)
    model = load(fix.group(1))
    assert model.config._attn_implementation == fix.group(1)
    # min_new_tokens: a randomly initialised model may pick its eos token and end the beams early.
    out = model.generate(torch.tensor([[1, 2, 3]]), num_beams=2, max_new_tokens=2, min_new_tokens=2)
    assert out.shape == (1, 5)


def test_architecture_without_attention_interface(tmp_path):
    """GPT-J (own attention code in transformers < 5.24; refused at load, not a KeyError inside GPT-J's
    __init__) names the cause and an attn_implementation that GPT-J accepts."""
    from transformers import AutoModelForCausalLM, GPTJConfig, GPTJForCausalLM

    import ipex_segment_kv

    config = GPTJConfig(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=2, rotary_dim=8,
                        bos_token_id=1, eos_token_id=2)
    model = GPTJForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"GPTJForCausalLM.*AttentionInterface.*tested: llama"):
        ipex_segment_kv.optimize(model)
    model.config._attn_implementation = "segment_kv"  # as a user forcing it would
    with pytest.raises(ValueError, match=r"GPTJForCausalLM.*cannot use the segment KV cache"):
        model.generate(torch.tensor([[1, 2, 3]]), num_beams=2, max_new_tokens=2)

    model.config._attn_implementation = "eager"
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"GPTJForCausalLM.*cannot use the segment KV cache") as e:
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="segment_kv")
    _check_the_advised_fix(e.value, lambda impl: AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation=impl).eval())


def test_attention_softcapping_is_refused_with_a_fix_gemma2_accepts():
    """Gemma-2 caps its attention logits (the segment kernel does not); the error advises an
    attn_implementation that transformers accepts for Gemma-2 and that then generates."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, bos_token_id=1,
                          eos_token_id=2, pad_token_id=0)
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM.*attn_logit_softcapping=50") as e:
        AutoModelForCausalLM.from_config(config, attn_implementation="segment_kv")
    _check_the_advised_fix(e.value, lambda impl: AutoModelForCausalLM.from_config(
        config, attn_implementation=impl).eval())


def test_unsupported_dtype(pair):
    import ipex_segment_kv

    _, seg, tok = pair("llama")
    model = type(seg).from_pretrained(seg.name_or_path, attn_implementation="sdpa", dtype=torch.float64).eval()
    with pytest.raises(ValueError, match="dtype torch.float64 is not supported"):
        ipex_segment_kv.optimize(model)
    model.set_attn_implementation("segment_kv")
    with pytest.raises(ValueError, match="KV dtype torch.float64 is not supported"):
        model.generate(**_enc(tok), num_beams=2, max_new_tokens=2)


def test_too_many_beams(pair):
    from aipc_kernels.decoder.segment_attention import max_group

    _, seg, tok = pair("llama")
    limit = max_group(torch.device("cpu"))
    with pytest.raises(ValueError, match=rf"num_beams={limit + 1}.*more than the {limit}"):
        seg.generate(**_enc(tok), num_beams=limit + 1, max_new_tokens=2)


def test_cache_reused_across_generate_calls(pair):
    _, seg, tok = pair("llama")
    enc = _enc(tok)
    out = seg.generate(**enc, num_beams=2, max_new_tokens=3, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="already used by an earlier generate call"):
        seg.generate(**enc, num_beams=2, max_new_tokens=3, past_key_values=out.past_key_values)


def test_cache_rows_mismatch(pair):
    """A cache filled for one batch refuses a step with another number of rows."""
    from ipex_segment_kv import SegmentKVCache

    _, seg, _ = pair("llama")
    cache = SegmentKVCache(seg.config, num_beams=2)
    with torch.no_grad():
        seg(torch.tensor([[5, 6, 7]]), past_key_values=cache)
        cache.end_prompt()
        seg(torch.tensor([[8], [9]]), past_key_values=cache)  # 1 prompt x 2 beams
        with pytest.raises(ValueError, match="holds 2 rows"):
            seg(torch.tensor([[8], [9], [10]]), past_key_values=cache)


def test_conflicting_cache_implementation(pair):
    _, seg, tok = pair("llama")
    with pytest.raises(ValueError, match="cache_implementation='static' cannot be combined"):
        seg.generate(**_enc(tok), num_beams=2, max_new_tokens=2, cache_implementation="static")


def test_crop_is_refused(pair):
    from ipex_segment_kv import SegmentKVCache

    _, seg, _ = pair("llama")
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        SegmentKVCache(seg.config).crop(-1)
