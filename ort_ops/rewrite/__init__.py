# SPDX-License-Identifier: MIT
"""Graph rewrites: exported models -> models that run on the ort_ops INT8 ops.

``rewrite_model`` (also ``ort_ops.rewrite_model``) loads a model, runs the enabled fusions of
``pipeline.FUSIONS`` and saves the result; ``ort-ops rewrite`` is its command line. This module
stays import-light: the fusions load onnxscript/onnx_ir when they run.
"""

from __future__ import annotations

from pathlib import Path

from ort_ops.ops._moe import EKN


def load_model(path):
    """An onnx_ir.Model from a path, or a one-line ValueError/FileNotFoundError naming the file.

    Refused: a missing file, one that does not parse, an empty one or one without a graph (an
    empty file parses as an empty ModelProto), and one whose external data file is missing or
    shorter than its tensors need (onnx_ir would only find out when a tensor is first read).
    """
    import onnx_ir as ir

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"model file '{path}' not found")
    if p.stat().st_size == 0:
        raise ValueError(f"'{path}' is empty (0 bytes), not an ONNX model")
    try:
        model = ir.load(str(p))
    except Exception as e:  # noqa: BLE001 - any parse failure is "not an ONNX model" to the user
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"'{path}' is not a readable ONNX model ({first[:200]})") from None
    if len(model.graph) == 0 and not len(model.graph.outputs):
        raise ValueError(f"'{path}' holds no graph (no nodes, no outputs): not an ONNX model")
    for graph in model.graphs():
        for value in graph.initializers.values():
            t = value.const_value
            if isinstance(t, ir.ExternalTensor):
                data = Path(t.path)
                if not data.is_file():
                    raise FileNotFoundError(f"'{path}' keeps tensor '{value.name}' in external data file "
                                            f"'{t.location}', which is missing (looked for '{data}')")
                if data.stat().st_size < (t.offset or 0) + (t.length or 0):
                    raise ValueError(f"'{path}': external data file '{data}' is shorter than tensor "
                                     f"'{value.name}' needs ({data.stat().st_size} < {(t.offset or 0) + (t.length or 0)} bytes)")
    return model


def save_model(model, path) -> None:
    """Saves an onnx_ir.Model; weights go to ``<name>.data`` beside it when past ~1.8 GB
    (protobuf's 2 GB limit), inline otherwise. The model file is written to a temporary file in
    the same directory and renamed into place (``ort_ops._atomic``): a failed save leaves no
    partial model behind (nor a partial ``.data`` file it had started)."""
    import onnx_ir as ir

    from ort_ops._atomic import atomic_output

    size = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    data = Path(path).with_name(f"{Path(path).name}.data")
    existed = data.exists()
    try:
        with atomic_output(path) as tmp:
            if size > 1_800_000_000:
                # The model names its data file, so that file is written under its final name.
                ir.save(model, str(tmp), external_data=data.name)
            else:
                ir.save(model, str(tmp))
    except OSError as e:
        if size > 1_800_000_000 and not existed:
            data.unlink(missing_ok=True)
        if str(e).startswith("cannot write"):
            raise
        raise OSError(f"cannot write '{path}' ({e.strerror or e})") from None


def rewrite_model(model, output=None, *, block_size: int = 16, pv_quant: str = "s8", qk_quant: str = "s8",
                  attention: bool = True, moe: bool = True, moe_weight_layout: str = EKN, norms: bool = True,
                  concat_matmuls: bool = True, rotary: bool = True, swiglu: bool = True,
                  rotary_kv: bool = True):
    """Runs the fusions on a model.

    Args:
        model: a path or an onnx_ir.Model (changed in place).
        output: where to save the result (None: not saved).
        block_size: tokens per KV-cache block of paged models.
        pv_quant: P.V quantization of PagedAttentionInt8 ("s8", "u8" or "none").
        qk_quant: Q.K quantization ("s8" or "none").
        attention, moe: which fusions run.
        norms: RMSNorm chains as ORT's SimplifiedLayerNormalization (one kernel a norm;
            ort_ops/rewrite/rmsnorm.py).
        concat_matmuls: MatMuls reading one activation with constant weights (Q / K / V, gate /
            up) as one MatMul of the joined weights and a Split (ort_ops/rewrite/matmul_concat.py).
        swiglu: the MLP's Split -> SiLU(gate) -> Mul(., up) as one ort_ops SwiGLU node, after
            concat_matmuls (ort_ops/rewrite/swiglu.py).
        rotary_kv: each layer's Split of the joined Q/K/V projection, the RotaryEmbeddings of Q
            and K and the QuantizeKVCache as one ort_ops RotaryQuantizeKVCache node, after
            attention, rotary and concat_matmuls (ort_ops/rewrite/rotary_kv.py).
        rotary: RoPE chains of paged models as ORT's com.microsoft RotaryEmbedding (one kernel per
            Q and per K of a layer instead of 7-8, and the Transposes around them; ort_ops/rewrite/rotary.py).
        moe_weight_layout: how the MoE gate/up weights are stored for GroupedMatmulSwigluQuant:
            "EKN" ([E, H, 2I], the default; the fast layout on CPU and pre-Hopper GPUs) or "ENK"
            ([E, 2I, H], transposed offline; the Hopper wgmma kernel's, for prefill-heavy serving
            on H100/H200; other GPUs run it on the mma.sync kernel's K-major path) or "EN16K4"
            ([E, ceil(2I/16), H/4, 16, 4], AMX B tiles packed offline: the CPU's AMX panels read it without a
            per-Run pack; CPU only, H a multiple of 4).

    Returns:
        (onnx_ir.Model, list of pipeline.FusionResult).
    """
    from ort_ops.rewrite.pipeline import RewriteOptions, run_fusions

    if pv_quant not in ("s8", "u8", "none"):
        raise ValueError(f"rewrite: pv_quant must be one of s8, u8, none, got '{pv_quant}'")
    if qk_quant not in ("s8", "none"):
        raise ValueError(f"rewrite: qk_quant must be one of s8, none, got '{qk_quant}'")
    if block_size < 1 or block_size & (block_size - 1) or not 8 <= block_size <= 256:
        raise ValueError(f"rewrite: block_size must be a power of two in 8..256, got {block_size}")
    from ort_ops.rewrite.moe import check_weight_layout

    check_weight_layout(moe_weight_layout)
    m = load_model(model) if isinstance(model, (str, Path)) else model
    options = RewriteOptions(block_size=block_size, pv_quant=pv_quant, qk_quant=qk_quant,
                             attention=attention, moe=moe, moe_weight_layout=moe_weight_layout, norms=norms,
                             concat_matmuls=concat_matmuls, rotary=rotary, swiglu=swiglu,
                             rotary_kv=rotary_kv)
    results = run_fusions(m, options)
    if output is not None:
        save_model(m, output)
    return m, results
