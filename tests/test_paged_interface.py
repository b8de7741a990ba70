# SPDX-License-Identifier: MIT
"""The paged interface is one contract: what the rewrite writes is what the runtime reads."""

from __future__ import annotations

import onnx
import pytest

from ort_ops import paged_interface as pi
from tests.test_runtime import _paged_model


def test_a_rewritten_model_has_the_interface_the_runtime_reads():
    proto = onnx.load_from_string(_paged_model())
    meta = pi.read_metadata(proto)
    assert meta is not None and set(meta) == set(pi.META_KEYS)
    inputs = {i.name: i for i in proto.graph.input}
    outputs = {o.name for o in proto.graph.output}
    for name, (dtype, shape) in pi.STEP_TABLES.items():
        t = inputs[name].type.tensor_type
        assert onnx.helper.tensor_dtype_to_np_dtype(t.elem_type) == dtype
        assert [d.dim_param for d in t.shape.dim] == list(shape)
    for layer in range(meta["num_layers"]):
        assert meta["cache_inputs"][layer] == [pi.cache_input_name(layer, p) for p in pi.CACHE_PARTS]
        assert all(n in inputs for n in meta["cache_inputs"][layer])
        assert all(n in outputs for n in meta["cache_outputs"][layer])


def test_metadata_is_checked_both_ways():
    with pytest.raises(ValueError, match="metadata keys missing"):
        pi.make_metadata(num_layers=1)
    proto = onnx.load_from_string(_paged_model())
    for p in proto.metadata_props:
        if p.key == pi.PAGED_META_KEY:
            p.value = p.value.replace('"version": 1', '"version": 99')
    with pytest.raises(ValueError, match="version 99"):
        pi.read_metadata(proto)


def test_optional_keys_may_be_absent():
    """Keys added after version 1 (next_token) may be missing from a model written before them:
    read_metadata fills their default; a required key missing is still refused."""
    import json

    assert set(pi.OPTIONAL_META_KEYS) <= set(pi.META_KEYS)
    proto = onnx.load_from_string(_paged_model())
    assert pi.read_metadata(proto)["next_token"] == pi.NEXT_TOKEN
    (prop,) = [p for p in proto.metadata_props if p.key == pi.PAGED_META_KEY]
    meta = json.loads(prop.value)
    del meta["next_token"]
    prop.value = json.dumps(meta)
    read = pi.read_metadata(proto)
    assert read["next_token"] is None and set(read) == set(pi.META_KEYS)
    fields = {k: v for k, v in meta.items() if k != "version"}
    assert json.loads(pi.make_metadata(**fields))["next_token"] is None
    del meta["logits"]
    prop.value = json.dumps(meta)
    with pytest.raises(ValueError, match=r"lacks \['logits'\]"):
        pi.read_metadata(proto)
