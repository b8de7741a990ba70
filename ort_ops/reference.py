# SPDX-License-Identifier: MIT
"""numpy reference of every op: ``ort_ops.reference.<op>`` is the spec the kernels are tested against.

Each op's reference lives beside its schema in ``ort_ops/ops/<op>.py``; this module gathers them.
"""

from ort_ops.ops._quant import dequantize_rows, quantize_rows
from ort_ops.ops.dynamic_quant import reference as dynamic_quant

__all__ = ["dequantize_rows", "dynamic_quant", "quantize_rows"]
