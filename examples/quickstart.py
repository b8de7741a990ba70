# SPDX-License-Identifier: MIT
"""Smallest end-to-end check: run DynamicQuant in an onnxruntime session with the ort-ops
library registered and compare it with the numpy reference, bit for bit."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

import ort_ops
from ort_ops import reference
from ort_ops.ops import dynamic_quant
from ort_ops.ops._schema import single_op_model


def main() -> int:
    rng = np.random.default_rng()
    x = rng.standard_normal((64, 4096)).astype(np.float32)
    smooth = rng.uniform(0.5, 2.0, 4096).astype(np.float32)
    model = single_op_model(dynamic_quant.SCHEMA, {"x": x, "smooth_scale": smooth})
    sess = ort.InferenceSession(model.SerializeToString(), ort_ops.session_options(),
                                providers=["CPUExecutionProvider"])
    y, scale = sess.run(None, {"x": x, "smooth_scale": smooth})
    ry, rscale = reference.dynamic_quant(x, smooth)
    codes_equal = np.array_equal(y, ry)
    scales_equal = np.array_equal(scale, rscale)
    print(f"DynamicQuant on {x.shape}: codes bit-exact vs reference: {codes_equal}, "
          f"scales bit-exact: {scales_equal}")
    return 0 if codes_equal and scales_equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
