# SPDX-License-Identifier: MIT
"""Harnesses for tests and benchmarks, not part of the runtime API: ctypes access to the CUDA
launchers (raw device pointers and a torch stream), so the kernels can be checked against
``ort_ops.reference`` and timed against torch peers without onnxruntime-gpu.

``attention_launchers``: QuantizeKVCache and PagedAttentionInt8. ``moe_launchers``: the MoE chain
(GroupedMatmulSwigluQuant / Dequant, DynamicQuant, MoeInitRouting, MoeFinalizeRouting).
"""
