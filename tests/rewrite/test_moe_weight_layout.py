# SPDX-License-Identifier: MIT
"""The MoE rewrite's weight_layout option (``ort-ops rewrite --moe-weight-layout ENK``): the
gate/up weight of every GroupedMatmulSwigluQuant it emits (routed blocks, the com.microsoft MoE
form and the shared expert) is stored [E, 2I, H] with the node attribute weight_layout="ENK",
and the model's outputs on CPU are bit-identical to the default ("EKN") rewrite's. Likewise
``--moe-weight-layout EN16K4``: gate/up [E, ceil(2I/16), H/4, 16, 4] and the GroupedMatmulDequant
(down) weight [E, ceil(H/16), I/4, 16, 4] (AMX B tiles, ``pack_en16k4``), both nodes with
weight_layout="EN16K4"; ENK leaves the down weight [E, I, H] with no attribute."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import numpy_helper

from ort_ops.cli import main
from ort_ops.rewrite.moe import fuse_moe
from ort_ops.rewrite.pipeline import RewriteOptions
from tests.ops.conftest import gemm_isa  # noqa: F401 - the kernel variants (AMX on and off, AVX2, scalar)

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "moe"
# One fixture per emission path: stacked experts, com.microsoft MoE, stacked + shared expert.
CASES = ["mixtral_dynamo_batched", "mixtral_tfexport_ortcuda", "qwen2moe_dynamo_shared"]


def _rewrite(name: str, layout: str) -> onnx.ModelProto:
    model = ir.load(str(FIXTURES / f"{name}.onnx"))
    result = fuse_moe(model, RewriteOptions(moe_weight_layout=layout))
    assert result.fused == 1, result.declined
    return ir.to_proto(model)


def _swiglu_weights(model: onnx.ModelProto, op: str = "GroupedMatmulSwigluQuant") -> list[tuple[str | None, np.ndarray]]:
    """(weight_layout attribute or None, weight initializer) of each node ``op``."""
    inits = {t.name: t for t in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if node.op_type == op:
            attrs = {a.name: a.s.decode() for a in node.attribute if a.name == "weight_layout"}
            out.append((attrs.get("weight_layout"), numpy_helper.to_array(inits[node.input[1]])))
    return out


def _logits(model: onnx.ModelProto, ids: np.ndarray) -> np.ndarray:
    from ort_ops.runtime import DenseRunner

    ids = np.asarray(ids, np.int64).reshape(1, -1)
    return DenseRunner(model.SerializeToString(), with_library=True).run(ids, np.ones_like(ids), None)[0][0]


@pytest.mark.parametrize("name", CASES)
def test_enk_rewrite_matches_ekn_bit_for_bit(name, rng):
    ekn, enk = _rewrite(name, "EKN"), _rewrite(name, "ENK")
    wa, wb = _swiglu_weights(ekn), _swiglu_weights(enk)
    assert len(wa) == len(wb) >= 1 and len(wa) == (2 if "shared" in name else 1)
    for (la, a), (lb, b) in zip(wa, wb):
        assert la is None and lb == "ENK"  # EKN is the op's default: no attribute written
        assert b.shape == (a.shape[0], a.shape[2], a.shape[1])
        np.testing.assert_array_equal(b, a.transpose(0, 2, 1))
    da, db = _swiglu_weights(ekn, "GroupedMatmulDequant"), _swiglu_weights(enk, "GroupedMatmulDequant")
    assert len(da) == len(db) == len(wa)
    for (la, a), (lb, b) in zip(da, db):  # the down weight stays [E, I, H] (the CUDA GMD reads EKN only)
        assert la is None and lb is None
        np.testing.assert_array_equal(b, a)
    vocab = 64  # the export script's vocabulary
    for length in (1, 5, 37):  # decode-sized and prompt-sized inputs, fresh random tokens
        ids = rng.integers(3, vocab, length)
        la, lb = _logits(ekn, ids), _logits(enk, ids)
        assert np.isfinite(la).all()
        np.testing.assert_array_equal(lb, la)


@pytest.mark.parametrize("name", CASES)
def test_en16k4_rewrite_matches_ekn_bit_for_bit(name, rng, gemm_isa):
    from ort_ops.ops.grouped_matmul_swiglu_quant import pack_en16k4

    ekn, packed = _rewrite(name, "EKN"), _rewrite(name, "EN16K4")
    wa, wb = _swiglu_weights(ekn), _swiglu_weights(packed)
    assert len(wa) == len(wb) == (2 if "shared" in name else 1)
    for (la, a), (lb, b) in zip(wa, wb):
        assert la is None and lb == "EN16K4"
        e, h, n = a.shape
        assert b.shape == (e, (n + 15) // 16, h // 4, 16, 4)
        np.testing.assert_array_equal(b, pack_en16k4(a))
    da, db = _swiglu_weights(ekn, "GroupedMatmulDequant"), _swiglu_weights(packed, "GroupedMatmulDequant")
    assert len(da) == len(db) == len(wa)
    for (la, a), (lb, b) in zip(da, db):  # the down projection [E, I, H] packed too
        assert la is None and lb == "EN16K4"
        e, i, h = a.shape
        assert b.shape == (e, (h + 15) // 16, i // 4, 16, 4)
        np.testing.assert_array_equal(b, pack_en16k4(a))
    vocab = 64
    for length in (1, 5, 37):
        ids = rng.integers(3, vocab, length)
        la, lb = _logits(ekn, ids), _logits(packed, ids)
        assert np.isfinite(la).all()
        np.testing.assert_array_equal(lb, la)


def test_bad_layout_refused_before_any_change():
    model = ir.load(str(FIXTURES / "mixtral_dynamo_batched.onnx"))
    before = len(list(model.graph))
    with pytest.raises(ValueError, match=r"moe_weight_layout must be one of EKN, ENK, EN16K4, got 'NKE'"):
        fuse_moe(model, RewriteOptions(moe_weight_layout="NKE"))
    assert len(list(model.graph)) == before
    from ort_ops.rewrite import rewrite_model

    with pytest.raises(ValueError, match=r"moe_weight_layout must be one of EKN, ENK, EN16K4, got 'ekn'"):
        rewrite_model(str(FIXTURES / "mixtral_dynamo_batched.onnx"), moe_weight_layout="ekn")


def test_cli_moe_weight_layout_flag(tmp_path, capsys):
    src = FIXTURES / "mixtral_dynamo_batched.onnx"
    out = tmp_path / "enk.onnx"
    assert main(["rewrite", "--quiet", "--moe-weight-layout", "ENK", str(src), str(out)]) == 0
    assert "weight layout: ENK" in capsys.readouterr().out
    assert [layout for layout, _ in _swiglu_weights(onnx.load(str(out)))] == ["ENK"]
    out2 = tmp_path / "ekn.onnx"
    assert main(["rewrite", "--quiet", "--json", str(src), str(out2)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "weight layout" not in report["results"][0]["details"]["forms"]
    assert [layout for layout, _ in _swiglu_weights(onnx.load(str(out2)))] == [None]
    with pytest.raises(SystemExit):
        main(["rewrite", "--quiet", "--moe-weight-layout", "KNE", str(src), str(out2)])
    assert "invalid choice: 'KNE'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["rewrite", "--help"])
    assert "--moe-weight-layout {EKN,ENK,EN16K4}" in capsys.readouterr().out


def test_en16k4_keeps_ekn_for_a_hidden_size_not_a_multiple_of_4():
    """EN16K4 packs H in groups of 4: a block with another H keeps EKN (warned), instead of the
    rewrite failing halfway with earlier blocks already changed."""
    from ort_ops.rewrite.moe import _swiglu_weight

    q = (np.arange(2 * 6 * 32) % 255 - 127).astype(np.int8).reshape(2, 6, 32)  # H = 6
    with pytest.warns(UserWarning, match="multiple of 4"):
        w, attrs = _swiglu_weight(q, "EN16K4")
    assert attrs == {} and np.array_equal(w, q)
    w, attrs = _swiglu_weight(np.ones((2, 8, 32), np.int8), "EN16K4")
    assert attrs == {"weight_layout": "EN16K4"} and w.shape == (2, 2, 2, 16, 4)


def test_en16k4_keeps_ekn_for_an_intermediate_size_not_a_multiple_of_4():
    """The down projection [E, I, H] packs I in groups of 4: another I keeps EKN (warned, naming
    the down weight) while a packable gate/up of the same block is still packed."""
    from ort_ops.rewrite.moe import _down_weight

    q = (np.arange(2 * 6 * 32) % 255 - 127).astype(np.int8).reshape(2, 6, 32)  # I = 6
    with pytest.warns(UserWarning, match=r"intermediate size to be a multiple of 4, got 6: this block's down"):
        w, attrs = _down_weight(q, "EN16K4")
    assert attrs == {} and np.array_equal(w, q)
    w, attrs = _down_weight(np.ones((2, 8, 33), np.int8), "EN16K4")
    assert attrs == {"weight_layout": "EN16K4"} and w.shape == (2, 3, 2, 16, 4)
    for layout in ("EKN", "ENK"):
        w, attrs = _down_weight(q, layout)
        assert attrs == {} and w is q
