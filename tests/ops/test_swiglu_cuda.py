# SPDX-License-Identifier: MIT
"""SwiGLU on NVIDIA GPUs against ort_ops.reference.swiglu (bit-exact: the kernel does the
reference's float32 operations with _rn intrinsics in the same order, the contract's exp_f32).

Two kinds, both ``@pytest.mark.cuda`` (they skip without a GPU, torch or onnxruntime-gpu, or a
CUDA build of the library): the launcher through ctypes on torch tensors (vector and scalar
paths), and one-node sessions on ORT's CUDA EP, including capture into a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import pytest

from ort_ops import reference
from tests.ops.test_moe_cuda import _providers_of, cuda_ep_session, torch_cuda  # noqa: F401  (fixtures)
from tests.ops.test_swiglu import _assert_exact

cuda = pytest.mark.cuda


@cuda
@pytest.mark.parametrize("shape", [(2,), (14,), (3, 34), (4, 5, 130), (5, 16384), (300, 2 * 4099), (0, 8), (3, 0)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_swiglu_cuda_matches_reference(torch_cuda, rng, shape, dtype):  # noqa: F811
    """Widths divisible by 8 take the 16-byte vector path, the others (I = 7, 17, 65, 4099) the
    scalar one; both equal the reference bit for bit."""
    from ort_ops.testing.moe_launchers import swiglu

    x = (rng.standard_normal(shape) * 8).astype(dtype)
    y = swiglu(torch_cuda.from_numpy(x).cuda())
    _assert_exact(y.cpu().numpy(), reference.swiglu(x))


@cuda
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_swiglu_cuda_unaligned_view_and_non_finite(torch_cuda, rng, dtype):  # noqa: F811
    """A view starting one element into its storage (not 16-byte aligned: the scalar path) and
    the contract's non-finite cases (-Inf gate -> NaN, +Inf -> +-Inf, NaN -> NaN)."""
    from ort_ops.testing.moe_launchers import swiglu

    x = (rng.standard_normal((6, 64)) * 8).astype(dtype)
    x[0, :4] = [np.inf, -np.inf, np.nan, 0.0]
    x[0, 32:36] = [-1.0, 1.0, 1.0, np.inf]
    flat = torch_cuda.from_numpy(np.concatenate([np.zeros(1, dtype), x.ravel()])).cuda()
    view = flat[1:].view(6, 64)
    assert view.data_ptr() % 16 != 0
    _assert_exact(swiglu(view).cpu().numpy(), reference.swiglu(x))
    _assert_exact(swiglu(torch_cuda.from_numpy(x).cuda()).cpu().numpy(), reference.swiglu(x))


@cuda
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_swiglu_cuda_ep_session(cuda_ep_session, rng, dtype):  # noqa: F811
    from ort_ops.ops import swiglu as swiglu_mod

    x = (rng.standard_normal((37, 4, 256)) * 5).astype(dtype)
    sess = cuda_ep_session({"x": x}, schema=swiglu_mod.SCHEMA)
    (y,) = sess.run(None, {"x": x})
    assert _providers_of(sess, "SwiGLU") == {"CUDAExecutionProvider"}
    _assert_exact(y, reference.swiglu(x))
    with pytest.raises(Exception, match=r"SwiGLU: input 'x' must have an even last dim \(2 \* I\), got 255"):
        sess.run(None, {"x": x[..., :255].copy()})


@cuda
def test_swiglu_cuda_graph_capture(rng):
    """The op runs inside ORT's CUDA graph capture (no host sync, no host-memory input) and the
    replays give the reference's bits for new input values."""
    import onnxruntime as ort

    from ort_ops import build_info
    from ort_ops._lib import session_options
    from ort_ops.ops import swiglu as swiglu_mod
    from ort_ops.ops._schema import single_op_model

    if "CUDAExecutionProvider" not in ort.get_available_providers() or not build_info()["cuda"]:
        pytest.skip("needs onnxruntime-gpu and a CUDA build of the library")
    x = rng.standard_normal((16, 512)).astype(np.float16)
    model = single_op_model(swiglu_mod.SCHEMA, {"x": x})
    sess = ort.InferenceSession(model.SerializeToString(), session_options(),
                                providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
    x_ort = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    y_ort = ort.OrtValue.ortvalue_from_shape_and_type((16, 256), np.float16, "cuda", 0)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x", x_ort)
    binding.bind_ortvalue_output("y", y_ort)
    for _ in range(3):  # the first Run captures, the others replay
        x_new = rng.standard_normal((16, 512)).astype(np.float16)
        x_ort.update_inplace(x_new)
        sess.run_with_iobinding(binding)
        _assert_exact(y_ort.numpy(), reference.swiglu(x_new))
