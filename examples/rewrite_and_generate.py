# SPDX-License-Identifier: MIT
"""Rewrite a bundled tiny decoder to the INT8 paged KV cache and generate with it.

    python examples/rewrite_and_generate.py [MODEL.onnx]

The default model is tests/fixtures/attention/tx_sdpa_kv.onnx (transformers' exporter, random
weights, 2 layers). Prints what the rewrite did, then greedy continuations of three prompts of
different lengths decoded together on the paged cache, next to the original's (stock onnxruntime).
"""

from __future__ import annotations

import pathlib
import sys

import ort_ops
from ort_ops.runtime import PagedRunner

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT = HERE.parent / "tests" / "fixtures" / "attention" / "tx_sdpa_kv.onnx"


def main() -> int:
    src = sys.argv[1] if len(sys.argv) > 1 else str(DEFAULT)
    out = "/tmp/ort_ops_example.int8.onnx"
    _, results = ort_ops.rewrite_model(src, out)
    for r in results:
        print(f"{r.kind}: fused {r.fused} {r.details}")
        for d in r.declined:
            print(f"  declined {d.where}: {d.reason}")

    prompts = [[5, 17, 42], [7, 7, 9, 11, 30, 31, 64, 3], [100, 3, 8, 21, 50]]
    paged = ort_ops.generate(out, prompts, max_new_tokens=12)
    fp32 = ort_ops.generate(src, prompts, max_new_tokens=12)
    for p, a, b in zip(prompts, fp32, paged):
        print(f"prompt {p}\n  fp32      {a.tokens}\n  int8 paged {b.tokens}")

    # The runtime step by step: two sequences prefill together, then decode one token each;
    # the cache is bound in place, blocks come from the allocator and go back on release.
    runner = PagedRunner(out, num_blocks=8)
    logits = runner.step({"a": prompts[0], "b": prompts[1]})
    nxt = logits.argmax(-1)
    logits = runner.step({"a": [int(nxt[0])], "b": [int(nxt[1])]})
    print(f"blocks in use: {runner.cache.allocator.tables}, free: {runner.cache.allocator.free_blocks}")
    runner.release("a")
    runner.release("b")
    print(f"after release, free: {runner.cache.allocator.free_blocks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
