# SPDX-License-Identifier: MIT
"""PagedAttentionInt8 on the CPU with its variant attributes against the plain op, in one run:
softcap (Gemma 2's 50), window (1024) and both, decode of one sequence at 16k context (32 query /
8 kv heads, head_dim 128, block 16, one intra-op thread). Sessions are timed interleaved, 15
rounds, so load changes hit every case alike; medians, and each case's ratio to the plain op.

    ORT_OPS_LIBRARY=... python benchmarks/bench_attention_variants.py
"""

import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ort_ops  # noqa: E402
from ort_ops.ops import paged_attention_int8 as pa  # noqa: E402

RNG = np.random.default_rng(0)
HQ, HKV, D, B, L = 32, 8, 128, 16, 16384
N = L // B + 1
INPUTS = {"query": RNG.standard_normal((1, HQ, D)).astype(np.float32),
          "key_cache": RNG.integers(-127, 128, (N, HKV, B, D), dtype=np.int8),
          "value_cache": RNG.integers(-127, 128, (N, HKV, D, B), dtype=np.int8),
          "key_scale": RNG.uniform(0.001, 0.01, (N, HKV, B)).astype(np.float32),
          "value_scale": RNG.uniform(0.001, 0.01, (N, HKV, B)).astype(np.float32),
          "block_tables": RNG.permutation(N)[: L // B][None].astype(np.int32),
          "seq_lens": np.array([L], np.int32)}
CASES = {"plain": {}, "softcap 50": {"softcap": 50.0}, "window 1024": {"window": 1024},
         "window 1024 + softcap 50": {"window": 1024, "softcap": 50.0}}


def session(**attrs) -> ort.InferenceSession:
    """One PagedAttentionInt8 node over INPUTS with these attributes, one intra-op thread."""
    def info(name, arr):
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), list(arr.shape))

    node = pa.SCHEMA.make_node(list(INPUTS), ["output"], **attrs)
    graph = helper.make_graph([node], "g", [info(n, a) for n, a in INPUTS.items()],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(ort_ops.DOMAIN, ort_ops.OPSET_VERSION)])
    so = ort_ops.session_options()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def main() -> int:
    sessions = {k: session(**v) for k, v in CASES.items()}
    times = {k: [] for k in CASES}
    for _ in range(15):  # interleaved, so load changes hit every case alike
        for k, s in sessions.items():
            t = time.perf_counter()
            s.run(None, INPUTS)
            times[k].append(time.perf_counter() - t)
    base = np.median(times["plain"])
    print(f"PagedAttentionInt8 CPU decode, 1 sequence x {L} keys, {HQ}/{HKV} heads, head_dim {D}, 1 thread; median of 15")
    for k in CASES:
        print(f"{k:<26} {np.median(times[k]) * 1e3:8.2f} ms   x plain {np.median(times[k]) / base:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
