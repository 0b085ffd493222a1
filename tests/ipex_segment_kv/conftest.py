"""Fixtures of the ipex_segment_kv tests: float32 tiny models, stock (sdpa) and segment_kv copies."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")


@pytest.fixture(scope="session", autouse=True)
def _segment_kv_installed():
    """Registers segment_kv even where the import hook (.pth) is absent; idempotent."""
    from ipex_segment_kv.hook import install

    install()


@pytest.fixture(scope="session")
def pair(tiny_model):
    """``pair(arch) -> (stock, segment, tokenizer)``: one float32 tiny model loaded twice."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    loaded = {}

    def get(arch: str):
        if arch not in loaded:
            path = tiny_model(arch, dtype="float32")
            tok = AutoTokenizer.from_pretrained(path, padding_side="left")
            stock = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
            seg = AutoModelForCausalLM.from_pretrained(path, attn_implementation="segment_kv").eval()
            loaded[arch] = (stock, seg, tok)
        return loaded[arch]

    return get
