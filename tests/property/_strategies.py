# SPDX-License-Identifier: MIT
"""Data for the property tests. Hypothesis draws the shapes, dtypes, attributes and a value regime;
the arrays come from a numpy Generator seeded by a drawn integer (drawing every element through
Hypothesis would be slow and would not shrink any better than the seed)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from tests.conftest import available_isas

# Value regimes of float inputs: ordinary magnitudes, the extremes of the dtype (tiny and
# subnormal, huge but finite), exact rounding ties (x.5 at amax 127), all zeros, and a few outliers
# among zeros (one nonzero code per row).
REGIMES = ("normal", "tiny", "huge", "ties", "zeros", "outliers")

seeds = st.integers(0, 2**32 - 1)
regimes = st.sampled_from(REGIMES)
float_dtypes = st.sampled_from([np.float32, np.float16])


def isas():
    """The CPU kernel variants this machine runs (tests/conftest.py's cap values)."""
    return st.sampled_from(available_isas())


def floats(rng: np.random.Generator, shape, dtype, regime: str) -> np.ndarray:
    """Finite values of ``dtype`` in ``regime`` (module docstring)."""
    f16 = np.dtype(dtype) == np.float16
    n = rng.standard_normal(shape)
    if regime == "normal":
        x = n * 10.0 ** rng.uniform(-3, 3)
    elif regime == "tiny":
        x = n * (1e-6 if f16 else 1e-38)  # float16 subnormals start below 6.1e-5, float32's at 1.2e-38
    elif regime == "huge":
        x = n * (1e4 if f16 else 1e37)
        x = np.clip(x, -6e4 if f16 else -3e38, 6e4 if f16 else 3e38)
    elif regime == "ties":
        # integers and halves with one +-127 per row: codes are x itself, halves are exact ties
        x = rng.integers(-254, 255, shape) / 2.0
        if len(shape) and shape[-1]:
            x.reshape(-1, shape[-1])[:, 0] = 127.0
    elif regime == "zeros":
        x = np.zeros(shape)
    else:
        x = np.zeros(shape)
        mask = rng.random(shape) < 0.05
        x[mask] = n[mask] * 1e3
    return np.asarray(x).astype(dtype)


def misaligned(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` whose data starts one byte past a 64-byte aligned address inside a larger
    buffer. ORT passes such a buffer bound through IOBinding on as it is; the ops refuse it
    (reading it through typed pointers would be undefined behaviour)."""
    a = np.ascontiguousarray(a)
    raw = np.zeros(a.nbytes + 64 + a.itemsize + 1, np.uint8)
    start = (-raw.ctypes.data) % 64 + 1
    view = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    view[...] = a
    return view
