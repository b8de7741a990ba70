# SPDX-License-Identifier: MIT
"""Harnesses for tests and benchmarks, not part of the runtime API: ctypes access to the CUDA
launchers (raw device pointers and a torch stream), so the kernels can be checked against
``ort_ops.reference`` and timed against torch peers without onnxruntime-gpu, and a float MoE
layer with its INT8 chain through the references.

``attention_launchers``: QuantizeKVCache and PagedAttentionInt8. ``moe_launchers``: the MoE chain
(GroupedMatmulSwigluQuant / Dequant, DynamicQuant, MoeInitRouting, MoeFinalizeRouting).
``moe_layer``: random MoE weights, the router, the float layer (float64 yardstick), the W8A8
error-budget model, the INT8 chain through the references and as one ONNX model.
"""
