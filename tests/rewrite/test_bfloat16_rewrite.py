# SPDX-License-Identifier: MIT
"""bfloat16 exports through the attention and MoE rewrites.

onnxruntime's CPU provider has no bfloat16 Mul/MatMul, so neither the probes nor these tests run a
bfloat16 graph as it is on the CPU: the probes run its float32 twin (``_graph.float32_twin``), and
the numbers here compare the float32 twin of the rewritten model with the float32 twin of the
original, under the same budgets as the fp32 fixtures. The twin itself is checked against an
independent computation: the fp32 export of the same torch model, its weights rounded to bfloat16.
The bfloat16 graphs as they are (bfloat16 activations between the ops' float32 Casts) run on
onnx's ReferenceEvaluator (numpy; our ops by their references) and, in the test marked ``cuda``,
on onnxruntime's CUDA provider.
"""

from __future__ import annotations

import collections
import pathlib

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from ort_ops.rewrite import rewrite_model
from ort_ops.rewrite._graph import float32_io, float32_twin, has_bfloat16
from ort_ops.rewrite.moe import fuse_moe
from ort_ops.runtime import DenseRunner
from ort_ops.testing import moe_layer as ml
from ort_ops.verify import teacher_forced_agreement, verify
from tests.tolerances import (
    ATTN_REWRITE_GREEDY_AGREEMENT,
    ATTN_REWRITE_LOGITS_ATOL,
    BF16_TWIN_VS_ROUNDED_FP32_REL_L2,
    MOE_REWRITE_GREEDY_AGREEMENT,
    MOE_REWRITE_LOGITS_REL_L2,
    MOE_REWRITE_STOP_TIE_MARGIN,
)

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
ATTENTION = FIXTURES / "attention" / "dynamo_sdpa_kv_bf16.onnx"
MOE = FIXTURES / "moe" / "mixtral_dynamo_batched_bf16.onnx"
# bfloat16 fixture -> the fp32 export of the same torch model (graphs/export_fixtures.py and
# export_moe_fixtures.py build both from one seed)
FP32_EXPORT = {ATTENTION: FIXTURES / "attention" / "dynamo_sdpa_kv.onnx",
               MOE: FIXTURES / "moe" / "mixtral_dynamo_batched.onnx"}
LAYERS = 2  # the attention fixture's
EOS = 2  # the export scripts' eos_token_id
BF16, F32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT


def _bytes(model: ir.Model) -> bytes:
    return ir.to_proto(model).SerializeToString()


def _twin_bytes(path_or_model) -> bytes:
    model = ir.load(str(path_or_model)) if isinstance(path_or_model, pathlib.Path) else path_or_model
    return _bytes(float32_twin(model))


def _rewritten(path: pathlib.Path) -> tuple[ir.Model, list]:
    return rewrite_model(str(path), moe=path == MOE, attention=path == ATTENTION)


def _logits(model: bytes, ids: np.ndarray, with_library: bool = False) -> np.ndarray:
    ids = np.asarray(ids, np.int64).reshape(1, -1)
    return DenseRunner(model, with_library=with_library).run(ids, np.ones_like(ids), None)[0][0]


@pytest.mark.parametrize("path", [ATTENTION, MOE], ids=["attention", "moe"])
def test_float32_twin_is_the_bfloat16_computation(path):
    """The twin has no bfloat16 left, leaves the model as it was, and computes what the fp32
    export computes on the bfloat16-rounded weights."""
    model = ir.load(str(path))
    twin = float32_twin(model)
    assert has_bfloat16(model) and not has_bfloat16(twin)
    fp32 = ir.load(str(FP32_EXPORT[path]))
    for v in fp32.graph.initializers.values():
        arr = v.const_value.numpy()
        if arr.dtype == np.float32:
            v.const_value = ir.tensor(arr.astype(ir.DataType.BFLOAT16.numpy()).astype(np.float32), name=v.name)
    ids = np.array([5, 9, 3, 17, 4, 11, 30, 6, 8])
    got, want = _logits(_bytes(twin), ids), _logits(_bytes(fp32), ids)
    assert np.all(np.isfinite(got))
    err = ml.relative_l2(got, want)
    print(f"{path.name}: twin vs fp32 export on bf16-rounded weights, logits relative L2 {err:.2e}")
    assert err <= BF16_TWIN_VS_ROUNDED_FP32_REL_L2


def test_float32_io_keeps_the_bfloat16_graph():
    """float32 at the interface only: the Casts at the inputs/outputs, every bfloat16 weight kept."""
    model = ir.load(str(ATTENTION))
    wrapped = ir.to_proto(float32_io(model))
    onnx.checker.check_model(wrapped)
    assert all(v.type.tensor_type.elem_type in (F32, onnx.TensorProto.INT64) for v in wrapped.graph.input)
    assert all(v.type.tensor_type.elem_type == F32 for v in wrapped.graph.output)
    original = onnx.load(str(ATTENTION))
    assert collections.Counter(t.data_type for t in wrapped.graph.initializer) == \
        collections.Counter(t.data_type for t in original.graph.initializer)
    casts = collections.Counter(n.attribute[0].i for n in wrapped.graph.node if n.op_type == "Cast")
    before = collections.Counter(n.attribute[0].i for n in original.graph.node if n.op_type == "Cast")
    assert casts - before == {BF16: 4, F32: 5}  # 4 past inputs in, logits + 4 presents out


def _casts_around(model: onnx.ModelProto, op_type: str, inputs: list[int], output: int) -> None:
    """Each ``op_type`` node reads its ``inputs`` through a Cast to float32, and its output
    ``output`` reaches a Cast to bfloat16 (the ops take float32/float16 activations)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    consumers = collections.defaultdict(list)
    for n in model.graph.node:
        for i in n.input:
            consumers[i].append(n)
    nodes = [n for n in model.graph.node if n.op_type == op_type]
    assert nodes
    for node in nodes:
        for i in inputs:
            p = producer[node.input[i]]
            while p.op_type in ("Reshape", "Transpose", "Gather"):  # layout ops the rewrite puts between
                p = producer[p.input[0]]
            assert (p.op_type, p.attribute[0].i) == ("Cast", F32), (node.name, i, p.op_type)
        frontier, seen = [node.output[output]], False
        for _ in range(4):
            nxt = []
            for v in frontier:
                for c in consumers[v]:
                    if c.op_type == "Cast" and c.attribute[0].i == BF16:
                        seen = True
                    nxt += list(c.output)
            frontier = nxt
        assert seen, node.name


def test_attention_fixture_fused_every_layer():
    model, results = _rewritten(ATTENTION)
    result = results[0]
    assert result.fused == LAYERS and not result.declined, [(d.where, d.reason) for d in result.declined]
    assert result.details["interface"] == "paged" and result.details["forms"] == {"matmul": LAYERS}
    proto = ir.to_proto(model)
    census = collections.Counter(n.op_type for n in proto.graph.node)
    assert census["QuantizeKVCache"] == LAYERS and census["PagedAttentionInt8"] == LAYERS
    assert not {"Softmax", "Attention"} & set(census), census
    # query, key, value in float32; the attention output back to bfloat16; logits stay bfloat16
    _casts_around(proto, "PagedAttentionInt8", [0], 0)
    _casts_around(proto, "QuantizeKVCache", [0, 1], 0)
    assert proto.graph.output[0].type.tensor_type.elem_type == BF16


def test_moe_fixture_fused():
    model = ir.load(str(MOE))
    # the expert weights as the model holds them: the bfloat16 [E=4, ., .] stacks (gate_up, down)
    experts = [v for v in model.graph.initializers.values() if v.dtype == ir.DataType.BFLOAT16
               and len(v.shape) == 3 and v.shape[0] == 4]
    assert len(experts) == 2
    result = fuse_moe(model)
    assert result.fused == 1 and not result.declined, result.declined
    (block,) = result.details["blocks"]
    assert block["experts"] == 4 and block["top_k"] == 2 and block["intermediate"] == 32
    assert block["weight_bytes_before"] == sum(v.const_value.nbytes for v in experts) > 0
    assert block["weight_bytes_after"] < block["weight_bytes_before"] / 1.75
    proto = ir.to_proto(model)
    census = collections.Counter(n.op_type for n in proto.graph.node)
    assert all(census[op] == 1 for op in ("DynamicQuant", "MoeInitRouting", "GroupedMatmulSwigluQuant",
                                          "GroupedMatmulDequant", "MoeFinalizeRouting")), census
    assert not {v.name for v in experts} & {t.name for t in proto.graph.initializer}
    _casts_around(proto, "DynamicQuant", [0], 0)
    final = next(n for n in proto.graph.node if n.op_type == "MoeFinalizeRouting")
    casts = [n for n in proto.graph.node if final.output[0] in n.input]
    assert [(n.op_type, n.attribute[0].i) for n in casts] == [("Cast", BF16)]


def test_attention_twin_greedy_agreement():
    """The fp32 fixture's service-level check, on the float32 twins of the bfloat16 original and
    of its rewrite (the INT8 ops between their Casts, which the twin makes float32 -> float32)."""
    model, _ = _rewritten(ATTENTION)
    report = verify(_twin_bytes(ATTENTION), _twin_bytes(model), max_new_tokens=32, eos_token_id=None)
    o = report["overall"]
    print(o)
    assert report["rewritten_interface"] == "paged"
    assert o["token_agreement"] >= ATTN_REWRITE_GREEDY_AGREEMENT
    assert o["length_match"] and o["eos_match"]
    assert o["logits_max_abs_err"] <= ATTN_REWRITE_LOGITS_ATOL


def test_moe_twin_logits_and_greedy_agreement(rng, tmp_path):
    """The fp32 fixtures' budgets on the twins: logits within the INT8 budget of the original's
    twin, and teacher-forced greedy agreement with it."""
    model = ir.load(str(MOE))
    fuse_moe(model)
    original, rewritten = tmp_path / "original.onnx", tmp_path / "rewritten.onnx"
    original.write_bytes(_twin_bytes(MOE))
    rewritten.write_bytes(_twin_bytes(model))
    ids = np.load(MOE.with_suffix(".npz"))["input_ids"]
    got, want = _logits(rewritten.read_bytes(), ids, True), _logits(original.read_bytes(), ids)
    assert np.all(np.isfinite(got))
    err = ml.relative_l2(got, want)
    print(f"logits relative L2, rewritten twin vs original twin: {err:.4f}")
    assert err <= MOE_REWRITE_LOGITS_REL_L2
    prompts = [rng.integers(3, 64, size=int(rng.integers(4, 12))).tolist() for _ in range(8)]
    tf = teacher_forced_agreement(str(original), str(rewritten), prompts, max_new_tokens=24,
                                  eos_token_id=EOS, tie_margin=MOE_REWRITE_STOP_TIE_MARGIN)
    print(f"teacher-forced agreement {tf['agreement']:.3f} over {tf['positions']}")
    assert tf["stop_decisions_match"], tf["per_prompt"]
    assert tf["agreement"] >= MOE_REWRITE_GREEDY_AGREEMENT


# --- the bfloat16 graphs themselves, on onnx's ReferenceEvaluator (numpy, bfloat16 included) ------
#
# The twins above cannot show that the Casts the rewrite puts around the ops are right in the
# bfloat16 graph itself; onnx's ReferenceEvaluator runs bfloat16 Mul/MatMul (as ml_dtypes arrays),
# so the original and the rewritten bfloat16 graphs run here as they are, our ops by their numpy
# references (the schema's input names mapping the node's inputs onto the reference's arguments).


def _reference_ops(modules: list[str]) -> list[type]:
    """OpRun classes running ``ort_ops.ops.<module>.reference`` for each op module named."""
    import importlib

    from onnx.reference.op_run import OpRun

    from ort_ops._domain import DOMAIN

    classes = []
    for name in modules:
        mod = importlib.import_module(f"ort_ops.ops.{name}")

        def _run(self, *inputs, _mod=mod):
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in self.onnx_node.attribute}
            attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
            out = _mod.reference(**dict(zip(_mod.SCHEMA.input_names(), inputs)), **attrs)
            return tuple(out) if isinstance(out, (tuple, list)) else (out,)

        # run: the attributes go to the reference as they are (no OpRun attribute plumbing)
        classes.append(type(mod.SCHEMA.name, (OpRun,), {"op_domain": DOMAIN, "_run": _run,
                                                         "run": lambda self, *a, **k: self._run(*a)}))
    return classes


def test_moe_bfloat16_graphs_on_reference_evaluator():
    """The rewritten bfloat16 graph (bfloat16 hidden state -> Cast -> INT8 chain -> Cast back)
    against the original bfloat16 graph, both as they are: the INT8 logits budget."""
    from onnx.reference import ReferenceEvaluator

    model = ir.load(str(MOE))
    fuse_moe(model)
    ops = _reference_ops(["dynamic_quant", "moe_init_routing", "grouped_matmul_swiglu_quant",
                          "grouped_matmul_dequant", "moe_finalize_routing"])
    ids = np.load(MOE.with_suffix(".npz"))["input_ids"]
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    got = ReferenceEvaluator(ir.to_proto(model), new_ops=ops).run(None, feeds)[0]
    want = ReferenceEvaluator(onnx.load(str(MOE))).run(None, feeds)[0]
    assert got.dtype == want.dtype == ir.DataType.BFLOAT16.numpy()
    got, want = got.astype(np.float32)[0], want.astype(np.float32)[0]
    assert np.all(np.isfinite(got))
    err = ml.relative_l2(got, want)
    print(f"bfloat16 graphs: logits relative L2, rewritten vs original {err:.4f}")
    assert err <= MOE_REWRITE_LOGITS_REL_L2


def test_attention_bfloat16_graphs_on_reference_evaluator():
    """The paged bfloat16 graph (Q.K and P.V unquantized: K/V INT8 is the change) under the
    contract's attention (test_attention_variants_rewrite's evaluator), three prompts packed in one
    prefill, against the original bfloat16 graph on each prompt: the logits budget."""
    from onnx.reference import ReferenceEvaluator

    from ort_ops.verify import make_prompts
    from tests.rewrite.test_attention_variants_rewrite import _paged_prefill_logits

    model, _ = rewrite_model(str(ATTENTION), qk_quant="none", pv_quant="none", moe=False)
    prompts = make_prompts(128, lengths=(5, 11, 17), seed=7)
    got = _paged_prefill_logits(ir.to_proto(model), prompts)
    assert got.dtype == ir.DataType.BFLOAT16.numpy()
    original = onnx.load(str(ATTENTION))
    evaluator = ReferenceEvaluator(original)
    want = []
    for p in prompts:
        ids = np.array([p], np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(len(p))[None]}
        for i in original.graph.input:
            if "past" in i.name:  # an empty bfloat16 cache [1, Hkv, 0, D]
                dims = [d.dim_value for d in i.type.tensor_type.shape.dim]
                feeds[i.name] = np.zeros((1, dims[1], 0, dims[3]), ir.DataType.BFLOAT16.numpy())
        want.append(evaluator.run(["logits"], feeds)[0][0, -1].astype(np.float32))
    got = got.astype(np.float32)
    assert np.all(np.isfinite(got))
    err = np.abs(got - np.stack(want)).max()
    print(f"bfloat16 graphs: last-token logits max abs err, rewritten vs original {err:.4f}")
    assert err <= ATTN_REWRITE_LOGITS_ATOL


@pytest.mark.cuda
@pytest.mark.parametrize("path", [ATTENTION, MOE], ids=["attention", "moe"])
def test_bfloat16_models_verify_on_cuda(path):
    """The bfloat16 models as they are, original and rewritten, on the CUDA provider (which runs
    bfloat16): ``verify --device cuda`` through float32 interfaces (``float32_io``: onnxruntime's
    Python API has no bfloat16 arrays), the fp32 fixtures' budgets."""
    import onnxruntime as ort

    import ort_ops

    if "CUDAExecutionProvider" not in ort.get_available_providers() or not ort_ops.build_info()["cuda"]:
        pytest.skip("needs onnxruntime's CUDA provider and a CUDA build of the library")
    model, _ = _rewritten(path)
    original = _bytes(float32_io(ir.load(str(path))))
    report = verify(original, _bytes(float32_io(model)), max_new_tokens=32, eos_token_id=None, device="cuda")
    o = report["overall"]
    print(path.name, o)
    assert report["device"] == "cuda"
    assert o["token_agreement"] >= (ATTN_REWRITE_GREEDY_AGREEMENT if path == ATTENTION else MOE_REWRITE_GREEDY_AGREEMENT)
    assert o["length_match"] and o["eos_match"]
    if path == ATTENTION:
        assert o["logits_max_abs_err"] <= ATTN_REWRITE_LOGITS_ATOL
