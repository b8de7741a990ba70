# SPDX-License-Identifier: MIT
"""ort-ops: INT8 KV cache, INT8 paged attention and INT8 MoE as ONNX Runtime custom ops."""

from ort_ops._domain import DOMAIN, OPSET_VERSION
from ort_ops._lib import build_info, check_device_errors, get_library_path, session_options
# ``ort_ops.rewrite(...)``: the subpackage is callable (it runs rewrite_model), so the name serves
# both as the function and as the package of the fusions (ort_ops.rewrite.<module>).
import ort_ops.rewrite as rewrite  # noqa: E402
from ort_ops.runtime import generate  # noqa: E402

__version__ = "0.1.0"

__all__ = ["DOMAIN", "OPSET_VERSION", "__version__", "build_info", "check_device_errors", "generate",
           "get_library_path", "rewrite", "session_options"]
