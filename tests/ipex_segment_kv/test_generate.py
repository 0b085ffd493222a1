"""Stock ``generate`` with attn_implementation="segment_kv" gives the same output as transformers' own
attention and cache (float32 tiny models, random weights), with the prompt prefilled once per batch entry."""
from __future__ import annotations

import warnings

import pytest
import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "phi3", "phi3_longrope", "gpt_neox", "opt")
PROMPTS = ["The old engineer reads a long letter", "Why is the sky blue? Maybe. The weather"]

BEAM_KW = dict(do_sample=False, max_new_tokens=12, return_dict_in_generate=True, output_scores=True)


def _inputs(tok, padded: bool):
    return tok(PROMPTS if padded else PROMPTS[:1], return_tensors="pt", padding=True)


def _assert_same_beams(a, b, num_beams: int):
    assert torch.equal(a.sequences, b.sequences)
    if num_beams > 1:
        torch.testing.assert_close(b.sequences_scores, a.sequences_scores, atol=1e-4, rtol=0)
        assert torch.equal(a.beam_indices, b.beam_indices)
    assert len(a.scores) == len(b.scores)
    for sa, sb in zip(a.scores, b.scores):
        finite = torch.isfinite(sa)
        assert torch.equal(finite, torch.isfinite(sb))
        torch.testing.assert_close(sb[finite], sa[finite], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("num_beams", [1, 4])
@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "single"])
def test_beam_search_matches_stock(pair, arch, num_beams, padded):
    stock, seg, tok = pair(arch)
    enc = _inputs(tok, padded)
    if padded:
        assert (enc["attention_mask"] == 0).any()  # the batch really is left-padded
    a = stock.generate(**enc, num_beams=num_beams, **BEAM_KW)
    b = seg.generate(**enc, num_beams=num_beams, **BEAM_KW)
    _assert_same_beams(a, b, num_beams)
    assert type(b.past_key_values).__name__ == "SegmentKVCache"


@pytest.mark.parametrize("arch", ["llama", "opt"])
@pytest.mark.parametrize("num_beams", [2, 8])
def test_beam_widths(pair, arch, num_beams):
    stock, seg, tok = pair(arch)
    enc = _inputs(tok, padded=True)
    kw = dict(BEAM_KW, num_return_sequences=2, length_penalty=0.7)
    a = stock.generate(**enc, num_beams=num_beams, **kw)
    b = seg.generate(**enc, num_beams=num_beams, **kw)
    _assert_same_beams(a, b, num_beams)


def test_prompt_prefilled_once_per_batch_entry(pair):
    """The first forward sees B rows (stock: B * num_beams); the decode steps see B * num_beams."""
    _, seg, tok = pair("llama")
    enc = _inputs(tok, padded=True)
    rows = []
    handle = seg.get_input_embeddings().register_forward_hook(lambda m, args, out: rows.append(tuple(args[0].shape)))
    try:
        seg.generate(**enc, num_beams=4, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    finally:
        handle.remove()
    B, Np = enc["input_ids"].shape
    assert rows[0] == (B, Np)
    assert rows[1:] == [(B * 4, 1)] * 4


def test_greedy_and_sampling_unchanged(pair):
    stock, seg, tok = pair("qwen2")
    enc = _inputs(tok, padded=True)
    kw = dict(max_new_tokens=10, return_dict_in_generate=True, output_scores=True)
    _assert_same_beams(stock.generate(**enc, do_sample=False, **kw), seg.generate(**enc, do_sample=False, **kw), 1)
    for extra in (dict(num_return_sequences=3, top_k=50, temperature=0.9), dict(num_beams=3, num_return_sequences=2)):
        torch.manual_seed(1234)
        a = stock.generate(**enc, do_sample=True, **kw, **extra)
        torch.manual_seed(1234)
        b = seg.generate(**enc, do_sample=True, **kw, **extra)
        _assert_same_beams(a, b, extra.get("num_beams", 1))


def test_kv_bytes_match_the_formulas(pair):
    from ipex_segment_kv.cache import kv_bytes_per_token, segment_kv_bytes, standard_kv_bytes

    stock, seg, tok = pair("llama")
    enc = _inputs(tok, padded=True)
    B, Np = enc["input_ids"].shape
    bw, new = 4, 20
    kw = dict(num_beams=bw, max_new_tokens=new, min_new_tokens=new, do_sample=False, return_dict_in_generate=True)
    c = kv_bytes_per_token(seg.config, torch.float32)
    cache = seg.generate(**enc, **kw).past_key_values
    assert cache.kv_bytes() == segment_kv_bytes(B, bw, Np, new, c)  # response pre-sized to ceil(20/16)*16
    assert cache.peak_kv_bytes == cache.kv_bytes()
    stock_cache = stock.generate(**enc, **kw).past_key_values
    stock_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in stock_cache.layers)
    assert stock_bytes == standard_kv_bytes(B, bw, Np, new - 1, c)  # the last token is never cached


def test_response_buffer_grows_in_steps(pair):
    """Without a planned length the response buffer grows by response_step tokens; results unchanged."""
    from ipex_segment_kv import SegmentKVCache

    stock, seg, tok = pair("mistral")
    enc = _inputs(tok, padded=True)
    kw = dict(num_beams=3, max_new_tokens=11, min_new_tokens=11, do_sample=False, return_dict_in_generate=True,
              output_scores=True)  # fmt: skip
    cache = SegmentKVCache(seg.config, num_beams=3, response_step=4)
    b = seg.generate(**enc, past_key_values=cache, **kw)
    _assert_same_beams(stock.generate(**enc, **kw), b, 3)
    assert cache.layers[0].response_key.shape[0] == 12  # 10 cached tokens -> 3 steps of 4
    assert cache.path.shape == (12, enc["input_ids"].shape[0] * 3)


def test_plain_forward_without_cache(pair):
    """Outside generate (no cache), the model's forward equals the stock one."""
    stock, seg, tok = pair("phi3")
    enc = _inputs(tok, padded=True)
    with torch.no_grad():
        a = stock(**enc, use_cache=False).logits
        b = seg(**enc, use_cache=False).logits
    keep = enc["attention_mask"].bool()
    torch.testing.assert_close(b[keep], a[keep], atol=1e-5, rtol=1e-5)


# 41 tokens: past the tiny phi3_longrope's original_max_position_embeddings (32)
LONG_PROMPT = ("The quiet river reads a long letter in the kitchen, and the old engineer checks the weights quickly in "
               "the library before lunch on Monday, and every student prepares two cups of tea at the market")


@pytest.mark.parametrize("num_beams", [1, 4])
@pytest.mark.parametrize("batch", ["batched", "single"])
@pytest.mark.parametrize("switch", ["in-prompt", "while-decoding"])
def test_longrope_switch_keeps_the_segment_cache(pair, switch, batch, num_beams):
    """Phi-3 drops the cache in prepare_inputs_for_generation when a sequence passes
    original_max_position_embeddings (its LongRoPE switches to the long factors) and recomputes it into a
    DynamicCache: the plugin takes that over into the segment cache; output equal to stock."""
    from aipc_kernels.tools.tiny_model import LONGROPE_ORIGINAL_MAX

    stock, seg, tok = pair("phi3_longrope")
    first = LONG_PROMPT if switch == "in-prompt" else PROMPTS[0]
    enc = tok([first, PROMPTS[1]] if batch == "batched" else [first], return_tensors="pt", padding=True)
    B, Np = enc["input_ids"].shape
    new = 30
    if switch == "in-prompt":
        assert Np > LONGROPE_ORIGINAL_MAX
    else:
        assert Np < LONGROPE_ORIGINAL_MAX < Np + new - 1
    kw = dict(BEAM_KW, max_new_tokens=new, min_new_tokens=new)
    a = stock.generate(**enc, num_beams=num_beams, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b = seg.generate(**enc, num_beams=num_beams, **kw)
    _assert_same_beams(a, b, num_beams)
    ours = [str(w.message) for w in caught if "segment_kv" in str(w.message)]
    cache = b.past_key_values
    if a.past_key_values.get_seq_length() < Np + new - 1:  # transformers < 5.24: stock did not recompute
        assert switch == "while-decoding" and len(ours) == 1 and type(cache).__name__ == "DynamicCache", ours
        return
    assert not ours and type(cache).__name__ == "SegmentKVCache", ours
    assert cache.layers[0].prompt_key.shape[:2] == (B, Np)  # the prompt still once per prompt
    assert cache.get_seq_length() == Np + new - 1


def test_dropped_cache_without_recompute_falls_back_with_one_warning(pair):
    """transformers before 5.24: Phi-3 drops the cache at the switch but the model still gets only the new
    token (its new cache lacks the sequence). The plugin cannot take that over: one warning, then the model's
    own cache, with output equal to stock's (which continues from the same cache)."""
    from transformers import GenerationMixin, Phi3ForCausalLM

    from aipc_kernels.tools.tiny_model import LONGROPE_ORIGINAL_MAX
    from ipex_segment_kv.generation import CACHE_KWARG

    class OlderPhi3(Phi3ForCausalLM):
        """Phi-3's cache drop as in transformers 5.5-5.19 (next_sequence_length kept: one token goes in)."""

        def prepare_inputs_for_generation(self, input_ids, **kwargs):
            cache = kwargs.get(CACHE_KWARG)
            if cache is not None and input_ids.shape[1] > LONGROPE_ORIGINAL_MAX >= cache.get_seq_length():
                kwargs[CACHE_KWARG] = None
            return GenerationMixin.prepare_inputs_for_generation(self, input_ids, **kwargs)

    _, seg, tok = pair("phi3_longrope")
    stock = OlderPhi3.from_pretrained(seg.name_or_path, attn_implementation="sdpa").eval()
    older = OlderPhi3.from_pretrained(seg.name_or_path, attn_implementation="segment_kv").eval()
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    kw = dict(BEAM_KW, num_beams=4, max_new_tokens=30, min_new_tokens=30)
    a = stock.generate(**enc, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b = older.generate(**enc, **kw)
    ours = [w for w in caught if "segment_kv" in str(w.message)]
    assert len(ours) == 1 and "without the segment cache" in str(ours[0].message), [str(w.message) for w in ours]
    _assert_same_beams(a, b, 4)
    assert type(b.past_key_values).__name__ == "DynamicCache"
