# SPDX-License-Identifier: MIT
"""Exports tiny random-weight decoders with the real exporters, as test fixtures.

    python graphs/export_fixtures.py [--out tests/fixtures/attention] [--only NAME ...]

Needs torch 2.13 (the CPU wheel; the last three forms were exported with torch 2.14.1) and
transformers 5.24 installed by hand (CI does not: the
fixtures are committed). Downloads nothing: the models are built from a config in code with
random weights. Every fixture is a Llama-style decoder
(2 layers, hidden 64, 2 query heads, 1 kv head (GQA), head_dim 64, vocab 128, MLP 64), so each file
stays near 0.4 MB. The weights are drawn with a larger spread than a trained model's
(``initializer_range`` 0.1) so that greedy decoding has clearer winners, as a trained model's
does: with the default 0.02 a random model's top two logits often differ by ~1e-3, and INT8 K/V
noise flips tokens (77% agreement measured), which says nothing about the rewrite; with 0.25 the
attention is so sharp that the same noise moves logits by 0.3-0.7. Embeddings are untied: tied
ones make a random model repeat its last token, and then agreement proves nothing either.

Forms (name: exporter, what the attention looks like):
    tx_sdpa_kv        transformers.exporters.OnnxExporter (torch.onnx dynamo), past_key_values:
                      sqrt(scale) on Q and K^T, float mask, Where on fully-masked rows
    tx_ortcpu_kv      the same with ort_fusions="cpu": com.microsoft RotaryEmbedding and an attention
                      that onnxscript fused to MultiHeadAttention and unfused again (Q/K/V through a
                      BSHD round trip, K^T by Transpose(0,2,3,1)). On this model transformers 5.24
                      emits no GroupQueryAttention (its GQA rule expects the older mask pattern).
    dynamo_sdpa_kv    torch.onnx.export(dynamo=True, opset 20), past as flat inputs
    dynamo_eager      torch.onnx.export(dynamo=True, opset 20), attn_implementation="eager",
                      prefill only (no cache): MatMul, Mul(scale), Add(mask), Softmax, MatMul
    dynamo_attn23_kv  torch.onnx.export(dynamo=True, opset 23): the ONNX Attention op
    torchscript_kv    torch.onnx.export(dynamo=False, opset 17), the legacy exporter optimum uses:
                      past_key_values.{i}.key/value in, present.{i}.key/value out
    dynamo_cachepos_kv  torch.onnx.export(dynamo=True, opset 20) of a model called without
                      position_ids: transformers computes cache_position = arange(P, P + S) with
                      P from Shape(past_key_values.*), and RoPE and the mask read it
    dynamo_rope23_kv  the same at opset 23: the ONNX RotaryEmbedding (cos/sin [1, S, D/2] computed
                      from the cache length, no position_ids input, so onnxruntime runs it only
                      on batches of one) next to the ONNX Attention op
    tx_ortcpu_gqa_prefill  transformers' OnnxExporter with ort_fusions="cpu", use_cache=True and
                      no past: prefill-only, com.microsoft GroupQueryAttention (packed QKV,
                      do_rotary with per-token cos/sin caches, the mask as attention_bias),
                      present outputs cache.layers.{i}.keys/values
    dynamo_sdpa_kv_fp16  dynamo_sdpa_kv with the model in float16 (weights, activations, past).
    dynamo_sdpa_kv_bf16  the same in bfloat16 (onnxruntime's CPU provider has no bfloat16
                      Mul/MatMul: the rewrite probes its float32 twin, the CPU tests run the twins).

Each model's ``metadata_props`` records the form and the generator.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

NUM_LAYERS = 2
HIDDEN = 64
HEADS = 2
KV_HEADS = 1
HEAD_DIM = 64
VOCAB = 128
SEED = 1234

FORMS = ("tx_sdpa_kv", "tx_ortcpu_kv", "dynamo_sdpa_kv", "dynamo_eager", "dynamo_attn23_kv", "torchscript_kv",
         "dynamo_cachepos_kv", "dynamo_rope23_kv", "tx_ortcpu_gqa_prefill", "dynamo_sdpa_kv_fp16",
         "dynamo_sdpa_kv_bf16")


def _config(attn_implementation: str = "sdpa"):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate_size=64,
                      vocab_size=VOCAB, max_position_embeddings=1024, tie_word_embeddings=False,
                      initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = attn_implementation
    return cfg


def _model(attn_implementation: str = "sdpa"):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    return LlamaForCausalLM(_config(attn_implementation)).eval()


def _sample(with_past: bool, batch: int = 2, seq: int = 3, past: int = 4, config=None):
    """Example inputs for the exporters; ``config`` (a transformers config) gives the vocabulary
    and cache dims, the fixtures' constants when None."""
    import torch

    vocab = config.vocab_size if config is not None else VOCAB
    layers = config.num_hidden_layers if config is not None else NUM_LAYERS
    kv_heads = config.num_key_value_heads if config is not None else KV_HEADS
    head_dim = config.head_dim if config is not None else HEAD_DIM
    ids = torch.randint(3, vocab, (batch, seq))
    p = past if with_past else 0
    mask = torch.ones(batch, p + seq, dtype=torch.int64)
    pos = torch.arange(p, p + seq).expand(batch, seq).contiguous()
    kv = [(torch.randn(batch, kv_heads, p, head_dim), torch.randn(batch, kv_heads, p, head_dim))
          for _ in range(layers)] if with_past else []
    return ids, mask, pos, kv


class _FlatDecoder:
    """A torch.nn.Module wrapper with flat tensor inputs/outputs (input_ids, attention_mask,
    position_ids, past k/v per layer) -> (logits, present k/v per layer), so torch.onnx.export
    sees plain tensors rather than a Cache object."""

    def __new__(cls, model, with_past: bool, with_positions: bool = True, full_cache: bool = False):
        import torch
        from transformers import DynamicCache

        class Flat(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask, position_ids, *past):
                cache = None
                if with_past:
                    # full_cache: every layer keeps all its past (no config, so no sliding-window
                    # layer that crops what it stores): past and present cover the whole context,
                    # as optimum's exports of sliding-window models do, and the window lives in the mask
                    cache = DynamicCache() if full_cache else DynamicCache(config=model.config)
                    for i in range(model.config.num_hidden_layers):
                        cache.update(past[2 * i], past[2 * i + 1], i)
                out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, past_key_values=cache, use_cache=with_past)
                if not with_past:
                    return out.logits
                flat = [out.logits]
                for i in range(model.config.num_hidden_layers):
                    layer = out.past_key_values.layers[i]
                    flat += [layer.keys, layer.values]
                return tuple(flat)

        class FlatNoPositions(Flat):
            # positions come from the cache length inside the model (transformers' cache_position)
            def forward(self, input_ids, attention_mask, *past):
                return super().forward(input_ids, attention_mask, None, *past)

        return Flat() if with_positions else FlatNoPositions()


def _io_names(with_past: bool, past_fmt: str, present_fmt: str, with_positions: bool = True,
              num_layers: int = NUM_LAYERS):
    ins = ["input_ids", "attention_mask"] + (["position_ids"] if with_positions else [])
    outs = ["logits"]
    if with_past:
        for i in range(num_layers):
            ins += [past_fmt.format(i=i, kv="key"), past_fmt.format(i=i, kv="value")]
            outs += [present_fmt.format(i=i, kv="key"), present_fmt.format(i=i, kv="value")]
    return ins, outs


def export_dynamo(model, out: Path, *, opset: int = 20, with_past: bool = True, full_cache: bool = False) -> None:
    """torch.onnx.export(dynamo=True) of a transformers causal LM in the ``dynamo_sdpa_kv`` form:
    flat inputs (input_ids, attention_mask, position_ids, past_key_values.{i}.key/value) and
    outputs (logits, present.{i}.key/value), every dim but the heads' dynamic, dims and layer
    count from the model's config. graphs/train_models.py exports its trained models with it.
    ``full_cache``: past/present keep every position on every layer (see ``_FlatDecoder``)."""
    import torch

    ids, mask, pos, kv = _sample(with_past, config=model.config)
    flat = _FlatDecoder(model, with_past, full_cache=full_cache).eval()
    args = (ids, mask, pos, *[t for pair in kv for t in pair])
    layers = model.config.num_hidden_layers
    ins, outs = _io_names(with_past, "past_key_values.{i}.{kv}", "present.{i}.{kv}", True, layers)
    auto = torch.export.Dim.AUTO  # torch.export finds the relations (total = past + seq) itself
    shapes = [{0: auto, 1: auto}] * 3
    if with_past:
        shapes.append(tuple([{0: auto, 2: auto}] * (2 * layers)))  # *past: one (nested) argument
    prog = torch.onnx.export(flat, args, input_names=ins, output_names=outs, dynamo=True,
                             opset_version=opset, dynamic_shapes=tuple(shapes), optimize=True)
    prog.save(str(out), external_data=False)


def _export_torch(name: str, out: Path, *, dynamo: bool, opset: int, with_past: bool,
                  attn_implementation: str = "sdpa", with_positions: bool = True, dtype: str = "float32"):
    import torch

    model = _model(attn_implementation).to(getattr(torch, dtype))
    ids, mask, pos, kv = _sample(with_past)
    kv = [(k.to(getattr(torch, dtype)), v.to(getattr(torch, dtype))) for k, v in kv]
    flat = _FlatDecoder(model, with_past, with_positions)
    args = (ids, mask, *([pos] if with_positions else []), *[t for pair in kv for t in pair])
    ins, outs = _io_names(with_past, "past_key_values.{i}.{kv}", "present.{i}.{kv}", with_positions)
    n_plain = len(ins) - 2 * NUM_LAYERS * with_past
    if dynamo:
        # Dim.AUTO lets torch.export find the relations (total = past + seq) itself.
        auto = torch.export.Dim.AUTO
        # forward(input_ids, attention_mask, position_ids, *past): *past is one (nested) argument.
        shapes = [{0: auto, 1: auto}] * n_plain
        if with_past:
            shapes.append(tuple([{0: auto, 2: auto}] * (2 * NUM_LAYERS)))
        prog = torch.onnx.export(flat, args, input_names=ins, output_names=outs, dynamo=True,
                                 opset_version=opset, dynamic_shapes=tuple(shapes), optimize=True)
        prog.save(str(out), external_data=False)
    else:
        axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"},
                "position_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
        for n in ins[n_plain:]:
            axes[n] = {0: "batch", 2: "past"}
        for n in outs[1:]:
            axes[n] = {0: "batch", 2: "total"}
        torch.onnx.export(flat, args, str(out), input_names=ins, output_names=outs, dynamo=False,
                          opset_version=opset, dynamic_axes=axes)


def _export_transformers(name: str, out: Path, *, ort_fusions: str | None, with_past: bool = True):
    import onnx_ir as ir
    import torch
    from transformers import DynamicCache
    from transformers.exporters import OnnxConfig, OnnxExporter

    model = _model("sdpa")
    ids, mask, pos, kv = _sample(with_past)
    if with_past:
        cache = DynamicCache(config=model.config)
        for i, (k, v) in enumerate(kv):
            cache.update(k, v, i)
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "past_key_values": cache}
    else:
        # use_cache with no past: a prefill graph that starts the cache (present outputs only)
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "use_cache": True}
    exported = OnnxExporter().export(model, inputs, config=OnnxConfig(dynamic=True, ort_fusions=ort_fusions))
    proto = ir.to_proto(exported.program)
    import onnx

    onnx.save(proto, str(out))
    del torch


def export(name: str, out_dir: Path) -> Path:
    out = out_dir / f"{name}.onnx"
    if name == "tx_sdpa_kv":
        _export_transformers(name, out, ort_fusions=None)
    elif name == "tx_ortcpu_kv":
        _export_transformers(name, out, ort_fusions="cpu")
    elif name == "dynamo_sdpa_kv":
        _export_torch(name, out, dynamo=True, opset=20, with_past=True)
    elif name == "dynamo_eager":
        _export_torch(name, out, dynamo=True, opset=20, with_past=False, attn_implementation="eager")
    elif name == "dynamo_attn23_kv":
        _export_torch(name, out, dynamo=True, opset=23, with_past=True)
    elif name == "dynamo_cachepos_kv":
        _export_torch(name, out, dynamo=True, opset=20, with_past=True, with_positions=False)
    elif name == "dynamo_rope23_kv":
        _export_torch(name, out, dynamo=True, opset=23, with_past=True, with_positions=False)
    elif name == "tx_ortcpu_gqa_prefill":
        _export_transformers(name, out, ort_fusions="cpu", with_past=False)
    elif name in ("dynamo_sdpa_kv_fp16", "dynamo_sdpa_kv_bf16"):
        _export_torch(name, out, dynamo=True, opset=20, with_past=True,
                      dtype="float16" if name.endswith("fp16") else "bfloat16")
    elif name == "torchscript_kv":
        _export_torch(name, out, dynamo=False, opset=17, with_past=True)
    else:
        raise ValueError(f"export_fixtures: unknown form '{name}', expected one of {FORMS}")
    return strip_and_tag(out, name, "graphs/export_fixtures.py")


def strip_and_tag(out: Path, name: str, generated_by: str, eos_token_id: int = 2) -> Path:
    """Drops the node metadata exporters write (stack traces and module paths, ~half the file)
    and records the fixture's form, generator and EOS token in ``metadata_props``."""
    import onnx

    m = onnx.load(str(out))
    for node in m.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    onnx.helper.set_model_props(m, {"ort_ops.fixture_form": name,
                                    "ort_ops.generated_by": generated_by,
                                    "ort_ops.eos_token_id": str(eos_token_id)})
    onnx.save(m, str(out))
    return out


def run_exports(forms, export_one, doc: str, argv=None) -> int:
    """The command line of an attention-fixture script: ``export_one(name, out_dir)`` for every
    form (or ``--only`` some) into ``--out`` (default tests/fixtures/attention); every form is
    tried and reported, and the exit status is 1 if any failed."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "attention"))
    ap.add_argument("--only", nargs="*", choices=forms)
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in args.only or forms:
        t = time.time()
        try:
            path = export_one(name, out_dir)
            print(f"{name}: {path} ({path.stat().st_size / 1e6:.2f} MB, {time.time() - t:.0f} s)")
        except Exception as e:  # noqa: BLE001 - report every form, then fail
            failed.append(name)
            print(f"{name}: FAILED {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                  file=sys.stderr)
    return 1 if failed else 0


def main(argv=None) -> int:
    return run_exports(FORMS, export, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
