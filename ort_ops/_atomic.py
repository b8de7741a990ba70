# SPDX-License-Identifier: MIT
"""Output files that appear whole or not at all.

``atomic_output(path)`` hands out a temporary file name in the target's own directory (so the
final rename stays on one file system and is atomic); when the block ends normally the file is
renamed onto ``path``, and on any error the temporary file is removed and ``path`` is left as it
was. A reader therefore never sees a half-written model, and a failed ``ort-ops rewrite`` leaves
nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_output(path):
    """Yields a temporary path beside ``path``; renames it onto ``path`` on success.

    Raises:
        OSError: "cannot write '<path>' (<reason>)" when the directory is missing or not writable.
    """
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as e:
        raise OSError(f"cannot write '{path}' ({e.strerror or e})") from None
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
