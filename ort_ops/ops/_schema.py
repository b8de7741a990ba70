# SPDX-License-Identifier: MIT
"""Op schemas, declared once in Python and used to build single-op graphs.

Each op module in ``ort_ops.ops`` holds a ``SCHEMA`` (names, dtypes, optional inputs, attributes
with defaults) and its numpy reference. The C++ op lists its inputs in the same order; tests
build their graphs from the schema so that drift between the two fails fast.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper

from ort_ops._domain import DOMAIN, OPSET_VERSION

# ONNX IR version of the models we build: 10 is what onnxruntime >= 1.17 reads (the onnx package
# may default to a newer one that the runtime refuses).
IR_VERSION = 10
ONNX_OPSET = 20

FLOAT_TYPES = ("float32", "float16")


@dataclasses.dataclass(frozen=True)
class Arg:
    """One input or output: its name, the numpy dtypes it accepts and whether it is optional."""

    name: str
    dtypes: tuple[str, ...]
    optional: bool = False
    doc: str = ""


@dataclasses.dataclass(frozen=True)
class Attr:
    """One attribute: its ONNX type ("int", "float", "string") and its default (None: required)."""

    name: str
    kind: str
    default: Any = None
    doc: str = ""


@dataclasses.dataclass(frozen=True)
class OpSchema:
    """The contract of one op as DESIGN.md defines it."""

    name: str
    inputs: tuple[Arg, ...]
    outputs: tuple[Arg, ...]
    attrs: tuple[Attr, ...] = ()
    doc: str = ""

    def input_names(self) -> list[str]:
        return [a.name for a in self.inputs]

    def output_names(self) -> list[str]:
        return [a.name for a in self.outputs]

    def attr_defaults(self) -> dict[str, Any]:
        return {a.name: a.default for a in self.attrs if a.default is not None}

    def check_attrs(self, attrs: Mapping[str, Any]) -> None:
        known = {a.name for a in self.attrs}
        unknown = set(attrs) - known
        if unknown:
            raise ValueError(f"{self.name}: unknown attribute(s) {sorted(unknown)}, expected {sorted(known)}")

    def check_dtypes(self, values: Mapping[str, Any]) -> None:
        """Raises the kernels' ValueError ("<op>: input 'x' must be float32 or float16, got float64")
        for a present input whose numpy dtype the schema does not list."""
        for arg in self.inputs:
            v = values.get(arg.name)
            if v is not None and np.asarray(v).dtype.name not in arg.dtypes:
                raise ValueError(f"{self.name}: input '{arg.name}' must be {' or '.join(arg.dtypes)}, "
                                 f"got {np.asarray(v).dtype.name}")

    def make_node(self, inputs: Sequence[str], outputs: Sequence[str] | None = None,
                  name: str | None = None, **attrs: Any) -> onnx.NodeProto:
        """A NodeProto of this op in our domain; ``inputs`` uses "" for an absent optional input."""
        self.check_attrs(attrs)
        if len(inputs) > len(self.inputs):
            raise ValueError(f"{self.name}: {len(inputs)} inputs given, at most {len(self.inputs)} expected")
        outputs = list(outputs) if outputs is not None else self.output_names()
        return helper.make_node(self.name, list(inputs), outputs, name=name or self.name,
                                domain=DOMAIN, **attrs)


def _tensor_type(arr: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(np.asarray(arr).dtype)


def single_op_model(schema: OpSchema, inputs: Mapping[str, np.ndarray | None],
                    output_dtypes: Mapping[str, np.dtype] | None = None,
                    dynamic_shapes: bool = False, **attrs: Any) -> onnx.ModelProto:
    """A model holding one node of ``schema``; every present input becomes a graph input.

    ``inputs`` maps schema input names to arrays (their dtype and shape type the graph input);
    a missing or None entry leaves an optional input out. Output types are left to the runtime's
    inference unless ``output_dtypes`` names them. ``dynamic_shapes`` declares every input dim
    symbolic, so one session takes inputs of any shape.
    """
    names: list[str] = []
    graph_inputs = []
    last_present = max((i for i, a in enumerate(schema.inputs)
                        if inputs.get(a.name) is not None), default=-1)
    for i, arg in enumerate(schema.inputs[: last_present + 1]):
        value = inputs.get(arg.name)
        if value is None:
            if not arg.optional:
                raise ValueError(f"{schema.name}: input '{arg.name}' is required")
            names.append("")
            continue
        names.append(arg.name)
        value = np.asarray(value)
        dims = [f"{arg.name}_{d}" for d in range(value.ndim)] if dynamic_shapes else list(value.shape)
        graph_inputs.append(helper.make_tensor_value_info(arg.name, _tensor_type(value), dims))
    # Optional outputs (MoeInitRouting's sorted_x_scale) come with the optional inputs they answer.
    with_optional = any(a.optional and inputs.get(a.name) is not None for a in schema.inputs)
    graph_outputs = []
    for arg in schema.outputs:
        if arg.optional and not with_optional:
            continue
        dt = (output_dtypes or {}).get(arg.name)
        if dt is None:
            graph_outputs.append(onnx.ValueInfoProto(name=arg.name))
        else:
            graph_outputs.append(helper.make_tensor_value_info(
                arg.name, helper.np_dtype_to_tensor_dtype(np.dtype(dt)), None))
    node = schema.make_node(names, [o.name for o in graph_outputs], **attrs)
    graph = helper.make_graph([node], f"{schema.name}_single", graph_inputs, graph_outputs)
    return helper.make_model(graph, ir_version=IR_VERSION,
                             opset_imports=[helper.make_opsetid("", ONNX_OPSET),
                                            helper.make_opsetid(DOMAIN, OPSET_VERSION)])
