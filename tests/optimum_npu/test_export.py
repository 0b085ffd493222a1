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
