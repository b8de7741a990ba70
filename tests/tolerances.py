# SPDX-License-Identifier: MIT
"""The only home of test tolerances; each says why it is what it is."""

# INT8 codes and float32 scales that follow the contract's rule are bit-exact: every kernel does
# the same float32 operations in the same order as the numpy reference (no FMA contraction,
# round half to even), so there is nothing to tolerate.
INT8_EXACT_ATOL = 0
