# SPDX-License-Identifier: MIT
"""Run one op of the library in an onnxruntime session (tests and benchmarks)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ort_ops.ops._schema import OpSchema, single_op_model


def make_session(schema: OpSchema, inputs: Mapping[str, np.ndarray | None], *,
                 providers: Sequence[str] = ("CPUExecutionProvider",), intra_op_threads: int | None = None,
                 dynamic_shapes: bool = False, **attrs: Any):
    """An InferenceSession holding one ``schema`` node whose inputs are typed like ``inputs``
    (and shaped like them, unless ``dynamic_shapes``)."""
    import onnxruntime as ort

    from ort_ops._lib import session_options

    model = single_op_model(schema, inputs, dynamic_shapes=dynamic_shapes, **attrs)
    so = session_options(intra_op_threads=intra_op_threads)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=list(providers))


def run_single_op(schema: OpSchema, inputs: Mapping[str, np.ndarray | None], *,
                  providers: Sequence[str] = ("CPUExecutionProvider",), intra_op_threads: int | None = None,
                  **attrs: Any) -> list[np.ndarray]:
    """Builds a one-node model from ``schema`` and runs it; returns the outputs in schema order."""
    sess = make_session(schema, inputs, providers=providers, intra_op_threads=intra_op_threads, **attrs)
    feeds = {k: np.asarray(v) for k, v in inputs.items() if v is not None}
    return sess.run(None, feeds)
