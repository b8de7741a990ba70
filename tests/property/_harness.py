# SPDX-License-Identifier: MIT
"""Runs single ops for the property tests: sessions cached per signature, every input and output
bound through IOBinding (outputs optionally bound in place onto an input's buffer), and the check
an invalid input must pass (a one-line error naming the op and the input, the process alive, every
input buffer, caches bound in place included, unchanged byte for byte).

Sessions are built with symbolic dims (``single_op_model(dynamic_shapes=True)``), so ORT checks
only dtypes and ranks and the op's own validation sees every shape; one session serves all inputs
of the same dtypes, ranks, attributes and ISA cap, which keeps a few hundred examples per op cheap.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping, Sequence

import numpy as np
import onnxruntime as ort

from ort_ops.ops._run import make_session
from ort_ops.ops._schema import OpSchema

# Refused Runs are expected here by the thousand; ORT would log each one to stderr as an error.
ort.set_default_logger_severity(4)

_SESSIONS: dict = {}
_MAX_SESSIONS = 256


def _isa_env(isa: str | None) -> dict[str, str | None]:
    """Environment of a session with the ISA cap ``isa`` ("amx": AVX-512 VNNI with AMX tiles)."""
    if isa is None:
        return {}
    if isa == "amx":
        return {"ORT_OPS_CPU_ISA": "avx512vnni", "ORT_OPS_CPU_AMX": None}
    return {"ORT_OPS_CPU_ISA": isa, "ORT_OPS_CPU_AMX": "0"}


def session(schema: OpSchema, inputs: Mapping[str, np.ndarray | None], attrs: Mapping[str, Any],
            isa: str | None = None):
    """A cached session of one ``schema`` node typed like ``inputs`` (dtype and rank only)."""
    sig = tuple((k, np.asarray(v).dtype.str, np.asarray(v).ndim) for k, v in inputs.items() if v is not None)
    key = (schema.name, sig, tuple(sorted(attrs.items())), isa)
    sess = _SESSIONS.get(key)
    if sess is None:
        env = _isa_env(isa)
        old = {k: os.environ.get(k) for k in env}
        try:
            for k, v in env.items():  # the library reads the cap when the kernel is created
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            sess = make_session(schema, inputs, dynamic_shapes=True, intra_op_threads=2, **attrs)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if len(_SESSIONS) >= _MAX_SESSIONS:
            _SESSIONS.clear()
        _SESSIONS[key] = sess
    return sess


def run(schema: OpSchema, inputs: Mapping[str, np.ndarray | None], attrs: Mapping[str, Any] | None = None, *,
        in_place: Mapping[str, str] | None = None, isa: str | None = None, sess=None) -> list[np.ndarray]:
    """Runs one node through IOBinding; returns the outputs in schema order (optional outputs only
    when the model has them: ``single_op_model`` adds them with the optional inputs they answer).

    Every input is wrapped as an OrtValue over its own numpy buffer (no copy); ``in_place`` maps an
    output name to the input whose OrtValue it is bound to (the paged cache's in-place update), so
    after the Run that numpy array holds the output. ``sess``: run on this session instead of the
    cached one (a thread's own session).
    """
    attrs = dict(attrs or {})
    in_place = dict(in_place or {})
    sess = sess or session(schema, inputs, attrs, isa)
    io = sess.io_binding()
    values = {}
    for name, arr in inputs.items():
        if arr is None:
            continue
        values[name] = ort.OrtValue.ortvalue_from_numpy(arr)
        io.bind_ortvalue_input(name, values[name])
    outputs = [o.name for o in sess.get_outputs()]  # the schema's, less optional ones left out
    for out in outputs:
        if out in in_place:
            io.bind_ortvalue_output(out, values[in_place[out]])
        else:
            io.bind_output(out)
    sess.run_with_iobinding(io)
    got = io.get_outputs()
    return [inputs[in_place[o]] if o in in_place else got[i].numpy() for i, o in enumerate(outputs)]


def error_names(message: str, op: str, input_name: str) -> bool:
    """Whether an error message names the op and the input: the library's "<op>: ... input
    '<name>' ..." / "... (dim k of input '<name>')", or ORT's session-creation refusal of a fixed
    dtype "... input parameter (<name>) of operator (<op>) ...". A ``input_name`` with a space is
    a fragment the message must hold as it is ("head_dim must": the dim, named as the op's
    contract names it)."""
    if " " in input_name:
        return f"{op}: " in message and input_name in message
    ours = f"{op}: " in message and re.search(rf"'{re.escape(input_name)}'", message) is not None
    orts = f"({input_name}) of operator ({op})" in message
    return ours or orts


def assert_refused(schema: OpSchema, inputs: Mapping[str, np.ndarray | None], attrs: Mapping[str, Any] | None,
                   names: str | Sequence[str], *, in_place: Mapping[str, str] | None = None,
                   isa: str | None = None, reference=None) -> str:
    """The op refuses ``inputs``: an exception whose one-line message names the op and one of
    ``names``; every input buffer (the in-place caches included) is unchanged byte for byte; the
    numpy reference (called as ``reference(**inputs, **attrs)``) refuses them too with a ValueError
    naming the op. Returns the kernel's message."""
    names = [names] if isinstance(names, str) else list(names)
    before = {k: np.array(v, copy=True) for k, v in inputs.items() if v is not None}
    try:
        run(schema, inputs, attrs, in_place=in_place, isa=isa)
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception classes
        msg = str(e)
    else:
        raise AssertionError(f"{schema.name}: accepted an input that must be refused (one of {names})")
    assert "\n" not in msg.strip(), f"error message is not one line: {msg!r}"
    assert any(error_names(msg, schema.name, n) for n in names), f"error names none of {names}: {msg}"
    for k, v in before.items():
        got = inputs[k]
        assert got.shape == v.shape and got.tobytes() == v.tobytes(), f"input '{k}' changed by a refused Run"
    if reference is not None:
        try:
            reference(**{k: v for k, v in inputs.items() if v is not None}, **dict(attrs or {}))
        except ValueError as e:
            assert f"{schema.name}: " in str(e), f"reference error does not name the op: {e}"
        else:
            raise AssertionError(f"{schema.name}: the reference accepts what the kernel refused: {msg}")
    return msg
