"""Edits of converted OpenVINO graphs and of saved IRs: port names by convention
(:func:`name_ports`), KV Parameter/Result pairs turned into states (:func:`make_stateful`), and
static variants of one chunk made to share one ``.bin`` (:func:`merge_weights`, an offset rewrite
of the ``.xml``)."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path


def name_ports(ov_model, inputs: list[str], outputs: list[str]) -> None:
    """Names every Parameter and Result (tensor names and friendly names) by convention."""
    for port, name in zip(ov_model.inputs, inputs, strict=True):
        port.get_tensor().set_names({name})
        port.get_node().set_friendly_name(name)
    for port, name in zip(ov_model.outputs, outputs, strict=True):
        port.get_tensor().set_names({name})
        port.get_node().set_friendly_name(name)


def make_stateful(ov_model, pairs: dict[str, str]) -> None:
    """Turns each (Parameter ``name``, Result ``pairs[name]``) into an OpenVINO state whose
    variable id is ``name``: a ReadValue without initialiser (zeros after ``reset_state()``)
    where the Parameter was, an Assign where the Result was."""
    import openvino.opset6 as ops
    from openvino.op import assign
    from openvino.op.util import Variable, VariableInfo

    params = {p.output(0).get_any_name(): p for p in ov_model.get_parameters()}
    results = {r.input_value(0).get_any_name(): r for r in ov_model.get_results()}
    results.update({r.output(0).get_any_name(): r for r in ov_model.get_results()})
    for pname, rname in pairs.items():
        param, result = params[pname], results[rname]
        info = VariableInfo()
        info.data_shape = param.get_partial_shape()
        info.data_type = param.get_element_type()
        info.variable_id = pname
        variable = Variable(info)
        read = ops.read_value(variable, name=pname)
        read.output(0).get_tensor().set_names({pname})
        for target in list(param.output(0).get_target_inputs()):
            target.replace_source_output(read.output(0))
        value = result.input_value(0)  # Assign takes a single-output Node
        node = value.get_node()
        if node.get_output_size() != 1:
            node = ops.convert(value, value.get_element_type())
        sink = assign(node, variable)
        sink.set_friendly_name(rname)
        ov_model.add_variables([variable])
        ov_model.add_sinks([sink])
        ov_model.remove_result(result)
        ov_model.remove_parameter(param)
    ov_model.validate_nodes_and_infer_types()


_CONST_DATA = re.compile(rb'(<data\b[^>]*?\boffset=")(\d+)("\s+size=")(\d+)(")')


def merge_weights(xml: Path, bin_path: Path, shared_bin: Path) -> None:
    """Makes ``xml`` read its constants from ``shared_bin``: each constant whose bytes are already
    there points at them, the others are appended (64-byte aligned); ``bin_path`` is deleted.
    Variants of one chunk differ only in a few small shape constants, so they share the weights."""
    shared = shared_bin.read_bytes()
    index: dict[bytes, int] = {}
    for m in _CONST_DATA.finditer(shared_bin.with_suffix(".xml").read_bytes()):
        off, size = int(m.group(2)), int(m.group(4))
        index.setdefault(hashlib.sha1(shared[off:off + size]).digest() + size.to_bytes(8, "little"), off)
    mine = bin_path.read_bytes()
    appended = bytearray()
    base = len(shared)

    def relocate(m: re.Match) -> bytes:
        nonlocal appended
        off, size = int(m.group(2)), int(m.group(4))
        blob = mine[off:off + size]
        key = hashlib.sha1(blob).digest() + size.to_bytes(8, "little")
        if key not in index:
            pad = (-(base + len(appended))) % 64
            appended += b"\0" * pad
            index[key] = base + len(appended)
            appended += blob
        return m.group(1) + str(index[key]).encode() + m.group(3) + m.group(4) + m.group(5)

    text = _CONST_DATA.sub(relocate, xml.read_bytes())
    if appended:
        with open(shared_bin, "ab") as f:
            f.write(appended)
    xml.write_bytes(text)
    bin_path.unlink()
