"""Export + run for every supported architecture: exact greedy tokens against transformers eager
(float32 both sides), zero dynamic dimensions, names by convention, save/reload, compile cache."""
from __future__ import annotations

import json

import pytest
import torch

from npu_testing import ARCHS, EXPORT_KW, F32, PROMPT, eager_greedy

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_eager_after_save_and_reload(arch, source_model, exported, tmp_path):
    from transformers import AutoTokenizer

    from optimum_npu import OVNPUModelForCausalLM, check_npu_ready

    src, out = source_model(arch), exported(arch)
    report = check_npu_ready(out)  # raises on any dynamic dimension, naming the node
    assert report.states == 2 * json.loads((out / "npu_export.json").read_text())["num_layers"] \
        * (1 + len(EXPORT_KW["kv_buckets"]) + 1)
    ids = AutoTokenizer.from_pretrained(out)(PROMPT, return_tensors="pt").input_ids
    assert EXPORT_KW["prefill_block"] < ids.shape[1] < 32  # two prefill blocks, then every bucket
    want = eager_greedy(src, ids, 64)

    model = OVNPUModelForCausalLM(out, device="CPU", ov_config=F32)
    got = model.generate(ids, max_new_tokens=64, do_sample=False)
    assert got[0].tolist() == want[0].tolist()

    saved = model.save_pretrained(tmp_path / "saved")
    first = OVNPUModelForCausalLM(saved, device="CPU", ov_config=F32)
    assert first.generate(ids, max_new_tokens=64, do_sample=False)[0].tolist() == want[0].tolist()
    second = OVNPUModelForCausalLM(saved, device="CPU", ov_config=F32)
    hits = second.compile_cache_hits()
    assert hits and all(hits.values()), hits
    assert (saved / "npu_compile_cache").is_dir()


def test_longrope_switch_in_graph_and_prompt_past_it(source_model, exported):
    """LongRoPE (Phi-3.5 style): both factor sets in the layer IRs, chosen in the graph by the
    sequence_length input (not frozen by the trace); a prompt longer than
    original_max_position_embeddings prefills with the long factors: greedy equals transformers."""
    import numpy as np
    import openvino as ov
    from transformers import AutoTokenizer

    from aipc_kernels.tools.tiny_model import LONGROPE_ORIGINAL_MAX as SWITCH
    from optimum_npu import OVNPUModelForCausalLM
    from optimum_npu.manifest import NPUExportManifest

    src, out = source_model("phi3_longrope"), exported("phi3_longrope")
    m = NPUExportManifest.read(out)
    assert m.longrope == dict(original_max_position_embeddings=SWITCH, input="sequence_length")
    f = m.layer_groups[0].decode["64"]
    ir = ov.Core().read_model(out / f.xml, out / f.weights)
    assert [p.get_any_name() for p in ir.inputs] == ["x", "position", "sequence_length"]
    req = ov.Core().compile_model(ir, "CPU", F32).create_infer_request()
    x = np.random.default_rng(0).standard_normal((1, 1, m.hidden_size)).astype(np.float32)

    def key_written(length: int) -> np.ndarray:
        req.reset_state()
        req.infer({"x": x, "position": np.array([20], dtype=np.int64),
                   "sequence_length": np.array([length], dtype=np.int64)})
        return {s.name: np.array(s.state.data) for s in req.query_state()}["cache_k_0"][0, :, 20]

    short, long = key_written(SWITCH), key_written(SWITCH + 1)
    assert np.array_equal(short, key_written(21)) and np.array_equal(long, key_written(60))
    assert not np.allclose(short, long, atol=1e-3)

    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(" ".join([PROMPT] * 3), return_tensors="pt").input_ids[:, :SWITCH + 8]
    assert ids.shape[1] == SWITCH + 8  # three prefill blocks, the first ones before the switch
    want = eager_greedy(src, ids, 24)
    model = OVNPUModelForCausalLM(out, device="CPU", ov_config=F32)
    assert model.generate(ids, max_new_tokens=24, do_sample=False)[0].tolist() == want[0].tolist()


def test_names_and_layout(exported):
    import openvino as ov

    from optimum_npu.manifest import NPUExportManifest

    out = exported("llama")
    m = NPUExportManifest.read(out)
    assert m.kv_buckets == [32, 64, 128] and m.prefill_capacity == 128 and m.max_seq_len == 128
    assert not list(out.glob("openvino_model*.xml"))  # the stock loader must not pick a chunk
    core = ov.Core()
    emb = core.read_model(out / m.embedding.xml, out / m.embedding.weights)
    assert [p.get_any_name() for p in emb.inputs] == ["token"]
    assert [p.get_any_name() for p in emb.outputs] == ["x"]
    head = core.read_model(out / m.head.xml, out / m.head.weights)
    assert [p.get_any_name() for p in head.outputs] == ["logits"]
    for group in m.layer_groups:
        assert len({f.weights for f in [group.prefill, *group.decode.values()]}) == 1  # shared
        for capacity, f in [(m.prefill_capacity, group.prefill),
                            *((int(c), f) for c, f in group.decode.items())]:
            ir = core.read_model(out / f.xml, out / f.weights)
            assert [p.get_any_name() for p in ir.inputs] == ["x", "position"]
            assert [p.get_any_name() for p in ir.outputs] == ["x_out"]
            ids = sorted(v.get_info().variable_id for v in ir.get_variables())
            assert ids == sorted(f"cache_{k}_{i}" for k in "kv" for i in range(group.first, group.last))
            for v in ir.get_variables():
                assert list(v.get_info().data_shape.to_shape())[2] == capacity


def test_stock_dynamic_ir_is_rejected_naming_a_node(source_model, tmp_path):
    from optimum.intel import OVModelForCausalLM

    from optimum_npu.check import NPUReadinessError, check_ir

    stock = OVModelForCausalLM.from_pretrained(source_model("llama"), export=True, compile=False)
    with pytest.raises(NPUReadinessError, match=r"node '.*' .*dynamic shape"):
        check_ir(stock.model, "openvino_model.xml")


def test_position_is_not_frozen_into_the_graph(exported):
    """The same decode IR at different positions writes K/V at that position and masks the rest
    (tracing an int(position) would silently bake the example's position into constants)."""
    import numpy as np
    import openvino as ov

    from optimum_npu.manifest import NPUExportManifest

    out = exported("llama")
    m = NPUExportManifest.read(out)
    f = m.layer_groups[0].decode["32"]
    req = ov.Core().compile_model(ov.Core().read_model(out / f.xml, out / f.weights), "CPU",
                                  F32).create_infer_request()
    x = np.random.default_rng(0).standard_normal((1, 1, m.hidden_size)).astype(np.float32)
    for position in (0, 5, 17):
        req.reset_state()
        req.infer({"x": x, "position": np.array([position], dtype=np.int64)})
        k = {s.name: np.array(s.state.data) for s in req.query_state()}["cache_k_0"]
        written = np.flatnonzero(np.abs(k[0, 0]).sum(-1))
        assert written.tolist() == [position]


@pytest.mark.parametrize("mode", ["int8_sym", "int8_asym", "int4_sym"])
def test_streamed_vocab_quantization_equals_nncf(mode, source_model, monkeypatch):
    """The embedding quantized block by block from the checkpoint (several blocks) gives exactly
    what nncf.compress_weights gives on the whole table."""
    import nncf
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    from optimum_npu import vocab
    from aipc_kernels.core.hf_checkpoint import HFCheckpoint

    monkeypatch.setattr(vocab, "ROWS", 100)  # the tiny vocabulary spans several blocks
    reader = HFCheckpoint(source_model("llama"))
    table = reader.get("model.embed_tokens.weight")
    shape = tuple(table.shape)
    int4 = mode.startswith("int4")
    quant = dict(weight_format="int4" if int4 else "int8", mode=mode,
                 group_size=32 if int4 else -1, ratio=1.0, all_layers=True)
    q = vocab.quantize_rows(lambda a, b: reader.rows("model.embed_tokens.weight", a, b), shape,
                            quant)
    ours = vocab.embedding_model(q, quant, shape, shape[0], None, ("token", "x"))

    token = ops.parameter([1, shape[0]], ov.Type.i64, name="token")
    ref = ov.Model([ops.result(ops.gather(ops.constant(table.float().numpy()), token,
                                          ops.constant(np.int64(0))))], [token])
    kw = dict(group_size=32, ratio=1.0, all_layers=True) if int4 else {}
    ref = nncf.compress_weights(ref, mode=nncf.CompressWeightsMode(mode), **kw)
    ids = np.arange(shape[0], dtype=np.int64)[None]
    core = ov.Core()
    a = core.compile_model(ours, "CPU", F32)(ids)[0]
    b = core.compile_model(ref, "CPU", F32)(ids)[0]
    assert np.array_equal(a, b)
    assert np.abs(a[0] - table.float().numpy()).max() < 0.2 * np.abs(table.float().numpy()).max()


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_int8_export_tracks_eager(arch, source_model, tmp_path):
    """INT8 export (16-bit tracing, streamed vocabulary, linear weights freed after NNCF): the
    logits of a two-block prompt and of the next decode steps stay close to float32 eager."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optimum_npu import OVNPUModelForCausalLM, export_npu_model

    src = source_model(arch)
    out = export_npu_model(src, tmp_path / "int8", max_seq_len=64, prefill_block=16,
                           kv_buckets=[32], layers_per_chunk=1, weight_format="int8")
    model = OVNPUModelForCausalLM(out, device="CPU", ov_config=F32)
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32,
                                               attn_implementation="eager")
    ids = AutoTokenizer.from_pretrained(src)(PROMPT, return_tensors="pt").input_ids
    out = model(ids)
    for step in range(3):
        with torch.no_grad():
            want = ref(ids).logits[0, -1]
        got = out.logits[0, -1]
        cos = torch.nn.functional.cosine_similarity(got, want, dim=0)
        assert cos > 0.99, (step, float(cos))
        nxt = want.argmax().view(1, 1)
        ids = torch.cat([ids, nxt], dim=1)
        out = model(nxt, past_key_values=out.past_key_values)
