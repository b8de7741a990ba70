# SPDX-License-Identifier: MIT
"""ort-ops: INT8 KV cache, INT8 paged attention and INT8 MoE as ONNX Runtime custom ops."""

from ort_ops._domain import DOMAIN, OPSET_VERSION
from ort_ops._lib import build_info, check_device_errors, get_library_path, session_options
from ort_ops.rewrite import rewrite_model  # noqa: E402
from ort_ops.runtime import generate  # noqa: E402

__version__ = "0.1.0"

__all__ = ["DOMAIN", "OPSET_VERSION", "__version__", "build_info", "check_device_errors", "generate",
           "get_library_path", "rewrite_model", "session_options"]
