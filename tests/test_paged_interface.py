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
