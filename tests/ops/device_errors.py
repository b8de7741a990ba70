# SPDX-License-Identifier: MIT
"""How a CUDA-EP session reports a bad value that only the device sees (DESIGN.md, "Bad input on
the CUDA EP"): the kernels flag the node, ``ort_ops.check_device_errors()`` raises the op's named
error after the Run, and if nobody asks, the node's next Run fails with it. Either way the error
is reported once, and the session then answers good inputs correctly."""

import pytest


def assert_reported_both_ways(sess, bad_feeds, good_feeds, match):
    """Runs ``bad_feeds`` twice on ``sess``: once followed by check_device_errors() (must raise
    ``match``), once followed by a good Run (must raise ``match`` itself). Returns the outputs of
    a final good Run, which must succeed, for the caller to compare with the reference."""
    import ort_ops

    ort_ops.check_device_errors()  # nothing pending from earlier tests
    sess.run(None, bad_feeds)
    with pytest.raises(ValueError, match=match):
        ort_ops.check_device_errors()
    ort_ops.check_device_errors()  # taken once: nothing left
    sess.run(None, good_feeds)  # so the next good Run succeeds

    sess.run(None, bad_feeds)
    with pytest.raises(Exception, match=match):
        sess.run(None, good_feeds)  # not taken: the node's next Run reports it
    return sess.run(None, good_feeds)
