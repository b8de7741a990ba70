# SPDX-License-Identifier: MIT
"""Finds and loads the native library; reads its build info."""

from __future__ import annotations

import ctypes
import functools
import json
import os
import site
import sysconfig
from pathlib import Path

_LIB_NAMES = ("libort_ops.so", "libort_ops.dylib", "ort_ops.dll")
_PKG_LIB_DIR = Path(__file__).resolve().parent / "lib"


def _candidates() -> list[Path]:
    env = os.environ.get("ORT_OPS_LIBRARY")
    if env:
        return [Path(env)]
    # The package's own lib/ (wheel installs), then the installed copy an editable install
    # (`pip install -e .`) puts in site-packages while the sources stay in the tree.
    dirs = [_PKG_LIB_DIR]
    for base in {sysconfig.get_paths()["platlib"], sysconfig.get_paths()["purelib"],
                 site.getusersitepackages()}:
        d = Path(base) / "ort_ops" / "lib"
        if d not in dirs:
            dirs.append(d)
    return [d / n for d in dirs for n in _LIB_NAMES]


def get_library_path() -> str:
    """Path of the custom-op library to hand to ``SessionOptions.register_custom_ops_library``.

    ``ORT_OPS_LIBRARY`` names the file explicitly; otherwise it is looked up in ``ort_ops/lib``.

    Raises:
        FileNotFoundError: listing every path tried and how to build the library.
    """
    tried = _candidates()
    for p in tried:
        if p.is_file():
            return str(p)
    raise FileNotFoundError(
        "ort_ops: native library not found; tried "
        + ", ".join(str(p) for p in tried)
        + ". Build it with `pip install .` (or `pip install -e .`) from the source tree, "
        "or point ORT_OPS_LIBRARY at a built libort_ops.so."
    )


@functools.lru_cache(maxsize=None)
def _cdll(path: str) -> ctypes.CDLL:
    return ctypes.CDLL(path)


def build_info() -> dict:
    """What the library was built with and what it uses on this machine.

    Keys: version, ort_api_version (the ORT C API version it asks for), min_ort_version, cuda,
    cuda_archs, cpu_isa (detected instruction sets), cpu_isa_in_use (after ORT_OPS_CPU_ISA).
    """
    lib = _cdll(get_library_path())
    fn = lib.ort_ops_build_info
    fn.restype = ctypes.c_char_p
    return json.loads(fn().decode())


def check_device_errors() -> None:
    """Raises the error a CUDA op's kernels found in input values on the device, if any.

    CUDA ops never make the host wait for the GPU: values only the device reads (block tables,
    seq_lens, slots, group lists, expert ids, NaN/Inf) are checked by the kernels, which leave
    the outputs of that Run unspecified (never reading or writing out of bounds) and flag the
    node. The node's next Run fails with the error; calling this right after ``run()`` returns
    (ORT has then synchronized the GPU) reports it at once instead, and clears it, so the next
    good Run succeeds. A no-op for a library built without CUDA.

    Raises:
        ValueError: "<Op>: input '<name>' must ..." (plus how many other nodes also failed).
    """
    lib = _cdll(get_library_path())
    fn = lib.ort_ops_take_device_error
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    buf = ctypes.create_string_buffer(2048)
    count = fn(buf, len(buf))
    if count:
        more = f" (and {count - 1} other node(s) reported an error)" if count > 1 else ""
        raise ValueError(buf.value.decode() + more)


def selected_cpu_isa() -> str:
    """The CPU kernel variant sessions created now will use (ORT_OPS_CPU_ISA applied), or an
    "invalid ORT_OPS_CPU_ISA" note when the variable holds an unknown value."""
    fn = _cdll(get_library_path()).ort_ops_selected_cpu_isa
    fn.restype = ctypes.c_char_p
    return fn().decode()


def session_options(options=None, *, intra_op_threads: int | None = None,
                    graph_optimization_level=None):
    """onnxruntime.SessionOptions with the ort-ops library registered.

    Args:
        options: an existing SessionOptions to extend (a new one when None).
        intra_op_threads: size of ORT's intra-op thread pool (the kernels split work over it).
        graph_optimization_level: an ``onnxruntime.GraphOptimizationLevel``.
    """
    import onnxruntime as ort

    so = options if options is not None else ort.SessionOptions()
    so.register_custom_ops_library(get_library_path())
    if intra_op_threads is not None:
        so.intra_op_num_threads = intra_op_threads
    if graph_optimization_level is not None:
        so.graph_optimization_level = graph_optimization_level
    return so
