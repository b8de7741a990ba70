# SPDX-License-Identifier: MIT
"""The custom-op domain and its opset version (mirrored by csrc/common/domain.h)."""

DOMAIN = "ort_ops"
OPSET_VERSION = 1
