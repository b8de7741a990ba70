# SPDX-License-Identifier: MIT
"""Builds realistic-size decoders (random weights) and exports them with the
exporter people use, torch.onnx dynamo, with a KV cache (past in, present out).

    python graphs/export_realistic.py llama --out /tmp/llama1b          # Llama-3.2-1B shape, fp16
    python graphs/export_realistic.py qwen_moe --out /tmp/qwenmoe       # Qwen-MoE shape, fp16
    python graphs/export_realistic.py llama --tiny --dtype fp32 --out /tmp/tiny   # runs on a CPU

Shapes (``--layers`` / ``--vocab`` override either; ``--set KEY=VALUE`` any config keyword, e.g.
``--set hidden_size=512 --set num_experts=16`` for a smaller variant in a scaling run):
    llama     16 layers, hidden 2048, 32 query / 8 kv heads, head_dim 64, intermediate 8192,
              vocab 32000 (Llama-3.2-1B's, with a 32k vocabulary), RoPE theta 500000
    qwen_moe  8 layers (Qwen1.5-MoE-A2.7B has 24: ``--layers 24``), hidden 2048, 16 heads,
              head_dim 128, 60 experts top-4, expert intermediate 1408, a shared expert of 5632
              behind its Sigmoid gate, vocab 32000
    --tiny    the same families at CPU size: 2 layers, hidden 256 (llama: 4 / 2 heads; qwen_moe:
              2 / 2 heads, 8 experts top-4, expert intermediate 64, shared 128), head_dim 64
              (a head dim the paged kernels take), vocab 512

Writes into ``--out``:
    model.onnx (+ model.onnx.data when over ``--inline-limit-mb``): input_ids, attention_mask,
        position_ids [B, S] int64, past_key_values.{i}.key/value [B, Hkv, P, D] -> logits
        [B, S, V], present.{i}.key/value [B, Hkv, P+S, D]; float16 or float32 throughout.
    checkpoint/: the same weights as a transformers checkpoint (config.json + safetensors), for
        PyTorch eager and onnxruntime-genai's model builder in benchmarks/bench_generate_cuda.py.

``--exporter dynamo`` (default) is ``torch.onnx.export(dynamo=True)`` of a wrapper with flat
past/present tensors (the form of the fixture ``dynamo_sdpa_kv``); for qwen_moe the experts run
as transformers' ``batched_mm`` (the form ``ort-ops rewrite`` fuses: each token gathers its top-k
experts' weights, which the original graph then pays for on every token). ``--exporter
transformers`` uses transformers' own OnnxExporter (also torch.onnx dynamo): its default experts
become a per-expert loop that touches only the rows routed to each expert. Both exporters run
onnxscript's optimizer inside ``fast_multi_output_matching``, which keeps its result and takes
away a cost quadratic in the graph's size (large for the per-expert loop of 60 experts a layer).

Needs torch and transformers (``pip install torch transformers``; CI does not install them).
Downloads nothing. ``--init-range`` (default 0.02, transformers' own; the tiny preset 0.1 as the
fixtures use, so that greedy decoding has clear winners) sets the weights' spread. Large models
are not committed: build them where they run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

FAMILIES = ("llama", "qwen_moe")

# name -> config keywords; the tiny presets keep head_dim 64 and the families' structure.
SHAPES = {
    ("llama", False): dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=64, intermediate_size=8192, vocab_size=32000,
                           rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    ("llama", True): dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=64, intermediate_size=512, vocab_size=512),
    ("qwen_moe", False): dict(num_hidden_layers=8, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                              head_dim=128, intermediate_size=5632, moe_intermediate_size=1408,
                              shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
                              vocab_size=32000),
    ("qwen_moe", True): dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
                             head_dim=64, intermediate_size=128, moe_intermediate_size=64,
                             shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=4,
                             vocab_size=512),
}


def make_config(family: str, *, tiny: bool = False, layers: int | None = None, vocab: int | None = None,
                init_range: float | None = None, overrides: dict | None = None):
    """The transformers config of a family's preset, with overrides (``overrides``: any config
    keywords, e.g. a smaller ``hidden_size`` or ``num_experts`` to see how export time scales)."""
    from transformers import LlamaConfig, Qwen2MoeConfig

    if family not in FAMILIES:
        raise ValueError(f"export_realistic: family must be one of {FAMILIES}, got {family!r}")
    kw = dict(SHAPES[(family, tiny)])
    if layers is not None:
        kw["num_hidden_layers"] = layers
    if vocab is not None:
        kw["vocab_size"] = vocab
    kw.update(overrides or {})
    common = dict(max_position_embeddings=8192 + 512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, initializer_range=init_range if init_range is not None else (0.1 if tiny else 0.02))
    if family == "llama":
        return LlamaConfig(**kw, **common)
    # Every layer sparse (Qwen1.5-MoE's decoder_sparse_step 1); top-k weights not renormalized.
    return Qwen2MoeConfig(**kw, **common, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False)


def build_model(cfg, dtype: str, seed: int = 0):
    """A causal LM with random weights (transformers' initializer, seeded) in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return model.to({"fp16": torch.float16, "fp32": torch.float32}[dtype]).eval()


class _FlatDecoder:
    """(input_ids, attention_mask, position_ids, *past k/v) -> (logits, *present k/v): plain
    tensors for torch.onnx.export instead of a Cache object."""

    def __new__(cls, model):
        import torch
        from transformers import DynamicCache

        n = model.config.num_hidden_layers

        class Flat(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask, position_ids, *past):
                cache = DynamicCache(config=model.config)
                for i in range(n):
                    cache.update(past[2 * i], past[2 * i + 1], i)
                out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=cache, use_cache=True)
                flat = [out.logits]
                for i in range(n):
                    layer = out.past_key_values.layers[i]
                    flat += [layer.keys, layer.values]
                return tuple(flat)

        return Flat().eval()


def _sample(cfg, dtype, batch: int = 2, seq: int = 3, past: int = 4):
    # batch 2: torch.export specializes a dimension whose example size is 1.
    import torch

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, cfg.vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    pos = torch.arange(past, past + seq).expand(batch, seq).contiguous()
    shape = (batch, cfg.num_key_value_heads, past, cfg.head_dim)
    kv = [torch.randn(shape, generator=g).to(dtype) for _ in range(2 * cfg.num_hidden_layers)]
    return ids, mask, pos, kv


def _names(n_layers: int):
    ins = ["input_ids", "attention_mask", "position_ids"]
    outs = ["logits"]
    for i in range(n_layers):
        ins += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        outs += [f"present.{i}.key", f"present.{i}.value"]
    return ins, outs


@contextlib.contextmanager
def fast_multi_output_matching():
    """Inside this context, onnxscript's pattern matcher refuses a node at once when a rule whose
    pattern has several output nodes (SlicesSplit, one of the rules its optimizer runs after
    constant folding) cannot start a match there: the node's op type is not the one of the
    pattern's first output node.

    The matcher makes that same check first for every combination it tries, but before it, it
    lists every node of the graph by op type, for each node it is asked about: quadratic in the
    number of nodes, and the per-expert graphs of transformers' exporter (an unrolled matmul per
    expert and layer) have tens of thousands. The rewrites it makes are the same, so the export
    is. Without onnxscript, or where its matcher has another shape, nothing is changed."""
    try:
        from onnxscript.rewriter import _basics, _matcher, _pattern_ir
    except ImportError:
        yield
        return
    cls = getattr(_matcher, "SimplePatternMatcher", None)
    original = getattr(cls, "match", None)
    if original is None or not hasattr(_pattern_ir, "StringConstantPattern"):
        yield
        return

    def match(self, model, graph_or_function, node, *args, **kwargs):
        pattern = self.pattern
        if not pattern.has_single_output_node:
            first = pattern.output_nodes[0].op
            if isinstance(first, _pattern_ir.StringConstantPattern) and node.op_type != first.value():
                return _basics.MatchResult().fail(f"OpType mismatch: expected {first.value()}, got {node.op_type}.")
        return original(self, model, graph_or_function, node, *args, **kwargs)

    cls.match = match
    try:
        yield
    finally:
        cls.match = original


def export_dynamo(model, path: Path, external: bool) -> None:
    import torch

    cfg = model.config
    if hasattr(model, "set_experts_implementation") and getattr(cfg, "num_experts", None):
        model.set_experts_implementation("batched_mm")
    ids, mask, pos, kv = _sample(cfg, model.dtype)
    ins, outs = _names(cfg.num_hidden_layers)
    auto = torch.export.Dim.AUTO  # torch.export finds total = past + seq itself
    shapes = ([{0: auto, 1: auto}] * 3) + [tuple([{0: auto, 2: auto}] * (2 * cfg.num_hidden_layers))]
    prog = torch.onnx.export(_FlatDecoder(model), (ids, mask, pos, *kv), input_names=ins, output_names=outs,
                             dynamo=True, opset_version=20, dynamic_shapes=tuple(shapes), optimize=True)
    prog.save(str(path), external_data=external)


def export_transformers(model, path: Path, external: bool) -> None:
    import onnx_ir as ir
    from transformers import DynamicCache
    from transformers.exporters import OnnxConfig, OnnxExporter

    cfg = model.config
    ids, mask, pos, kv = _sample(cfg, model.dtype)
    cache = DynamicCache(config=cfg)
    for i in range(cfg.num_hidden_layers):
        cache.update(kv[2 * i], kv[2 * i + 1], i)
    exported = OnnxExporter().export(model, {"input_ids": ids, "attention_mask": mask, "position_ids": pos,
                                             "past_key_values": cache}, OnnxConfig(dynamic=True))
    # transformers 5.2x wraps the ir.Model as ``.program``; earlier 5.x return torch's ONNXProgram,
    # whose ir.Model is ``.model``.
    program = exported.program if hasattr(exported, "program") else exported.model
    if external:
        ir.save(program, str(path), external_data=path.name + ".data")
    else:
        ir.save(program, str(path))


def save_tokenizer(folder: Path, vocab: int) -> None:
    """A fast tokenizer of ``vocab`` byte-level word pieces beside the checkpoint: onnxruntime-genai's
    model builder reads one from the checkpoint folder (without it, it tries to convert a slow one,
    which needs sentencepiece). The benchmarks feed token ids; the pieces themselves are arbitrary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab):
        pieces[f"t{i}"] = i
    tok = Tokenizer(models.WordLevel(pieces, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(folder))


def _finish(path: Path, props: dict) -> None:
    """Drops torch's per-node stack traces and doc strings (a third of a small file) and records
    how the model was made. Reads the graph only: external weights stay where they are."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    for node in m.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    onnx.helper.set_model_props(m, {**{p.key: p.value for p in m.metadata_props}, **props})
    onnx.save(m, str(path))


def build(family: str, out: Path, *, dtype: str = "fp16", tiny: bool = False, layers: int | None = None,
          vocab: int | None = None, exporter: str = "dynamo", seed: int = 0, init_range: float | None = None,
          inline_limit_mb: float = 1024, checkpoint: bool = True, overrides: dict | None = None) -> Path:
    """Builds, exports and saves one model; returns the path of model.onnx."""
    if exporter not in ("dynamo", "transformers"):
        raise ValueError(f"export_realistic: exporter must be dynamo or transformers, got {exporter!r}")
    out.mkdir(parents=True, exist_ok=True)
    cfg = make_config(family, tiny=tiny, layers=layers, vocab=vocab, init_range=init_range, overrides=overrides)
    model = build_model(cfg, dtype, seed)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    external = nbytes > inline_limit_mb * 2**20
    path = out / "model.onnx"
    with fast_multi_output_matching():
        (export_dynamo if exporter == "dynamo" else export_transformers)(model, path, external)
    _finish(path, {"ort_ops.generated_by": "graphs/export_realistic.py", "ort_ops.family": family,
                   "ort_ops.dtype": dtype, "ort_ops.exporter": exporter,
                   "ort_ops.config": json.dumps({k: getattr(cfg, k) for k in [*SHAPES[(family, tiny)], *(overrides or {})]
                                                 if k != "rope_parameters"})})
    if checkpoint:
        model.save_pretrained(str(out / "checkpoint"))
        save_tokenizer(out / "checkpoint", model.config.vocab_size)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("family", choices=FAMILIES)
    ap.add_argument("--out", required=True, help="output folder (model.onnx, model.onnx.data, checkpoint/)")
    ap.add_argument("--dtype", choices=("fp16", "fp32"), default="fp16",
                    help="weights and activations of the export (default fp16; fp32 for the CPU EP)")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU-size preset (2 layers, hidden 256, vocab 512); with --dtype fp32 it runs in a test")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the preset's)")
    ap.add_argument("--exporter", choices=("dynamo", "transformers"), default="dynamo",
                    help="torch.onnx.export(dynamo=True) of flat past/present (default) or transformers' "
                         "OnnxExporter")
    ap.add_argument("--init-range", type=float, default=None,
                    help="std of the random weights (default 0.02; --tiny 0.1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config keyword of the preset (repeatable; VALUE read as JSON), e.g. "
                         "--set hidden_size=512 --set num_experts=16: smaller variants of a family's shape")
    ap.add_argument("--inline-limit-mb", type=float, default=1024,
                    help="weights above this go to model.onnx.data (protobuf caps a file at 2 GB)")
    ap.add_argument("--no-checkpoint", dest="checkpoint", action="store_false",
                    help="skip the transformers checkpoint (PyTorch / GenAI baselines need it)")
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--set wants KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    t = time.time()
    try:
        path = build(args.family, Path(args.out), dtype=args.dtype, tiny=args.tiny, layers=args.layers,
                     vocab=args.vocab, exporter=args.exporter, seed=args.seed, init_range=args.init_range,
                     inline_limit_mb=args.inline_limit_mb, checkpoint=args.checkpoint, overrides=overrides)
    except ImportError as e:
        print(f"export_realistic: needs torch and transformers ({e})", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in path.parent.glob("model.onnx*"))
    print(f"{args.family}: {path} ({size / 1e6:.1f} MB, {time.time() - t:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
