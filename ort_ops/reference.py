# SPDX-License-Identifier: MIT
"""numpy reference of every op: ``ort_ops.reference.<op>`` is the spec the kernels are tested against.

Each op's reference lives beside its schema in ``ort_ops/ops/<op>.py``; this module gathers them.
"""

from ort_ops.ops._quant import dequantize_rows, quantize_rows
from ort_ops.ops.dynamic_quant import reference as dynamic_quant
from ort_ops.ops.grouped_matmul_dequant import reference as grouped_matmul_dequant
from ort_ops.ops.grouped_matmul_swiglu_quant import reference as grouped_matmul_swiglu_quant
from ort_ops.ops.moe_finalize_routing import reference as moe_finalize_routing
from ort_ops.ops.moe_init_routing import reference as moe_init_routing
from ort_ops.ops.paged_attention_int8 import exact_attention
from ort_ops.ops.paged_attention_int8 import reference as paged_attention_int8
from ort_ops.ops.quantize_kv_cache import reference as quantize_kv_cache
from ort_ops.ops.rotary_quantize_kv_cache import reference as rotary_quantize_kv_cache
from ort_ops.ops.swiglu import reference as swiglu

__all__ = ["dequantize_rows", "dynamic_quant", "exact_attention", "grouped_matmul_dequant",
           "grouped_matmul_swiglu_quant", "moe_finalize_routing", "moe_init_routing", "paged_attention_int8", "quantize_kv_cache",
           "quantize_rows", "rotary_quantize_kv_cache", "swiglu"]
