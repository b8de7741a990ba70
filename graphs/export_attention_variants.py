# SPDX-License-Identifier: MIT
"""Exports tiny decoders whose attention has a sliding window, a logit softcap or sinks.

    python graphs/export_attention_variants.py [--out tests/fixtures/attention] [--only NAME ...]

Same tooling and shapes as graphs/export_fixtures.py (torch 2.14.1, transformers 5.24, installed
by hand; nothing downloaded: configs in code, random weights, ``initializer_range`` 0.1 and untied
embeddings for the reasons given there): 2 layers, hidden 64, 2 query heads, 1 kv head, head_dim
64, vocab 128, exported by torch.onnx dynamo (opset 20) with ``past_key_values.{i}.key/value``
in and ``present.{i}.key/value`` out. The cache is a full one (``DynamicCache()`` without a
config): past and present hold every position on every layer and the window lives in the mask,
as in optimum's exports of these models. The window is 24 positions, shorter than the contexts
``ort-ops verify`` reaches (prompts of 5-23 tokens plus 32 new ones) and not a multiple of the
16-position cache block.

Forms:
    mistral_window_kv   Mistral, sdpa, ``sliding_window`` 24 on every layer: the mask is causal
                        and hides keys more than 23 positions back.
    gemma2_softcap_kv   Gemma 2, eager (its sdpa path cannot softcap), layer 0 sliding (24),
                        layer 1 global; ``attn_logit_softcapping`` 2.0 (Gemma 2 ships 50.0, which
                        on a random model's small logits would leave tanh linear and the softcap
                        untested; q_proj is scaled by 4 for the same reason),
                        ``query_pre_attn_scalar`` 256 (scale 1/16, not 1/sqrt(64)),
                        final logit softcap 30: MatMul, Mul(scale), Div(2), Tanh, Mul(2), Add(mask),
                        Softmax, MatMul.
    gptoss_sinks_kv     gpt-oss, eager (sinks live only there), layer 0 sliding (24), layer 1
                        global, q/k/v/o with bias, 4 experts top-2 (``batched_mm``; the MoE is
                        not this script's subject). ``sinks`` set to -1.0 .. 2.0 over the heads
                        (a random init leaves them near 0, where they barely move the softmax):
                        Concat(scores + mask, sinks expanded) - ReduceMax, Softmax, Slice [..., :-1].
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphs.export_fixtures import (  # noqa: E402
    HEAD_DIM, HEADS, HIDDEN, KV_HEADS, NUM_LAYERS, SEED, VOCAB, export_dynamo, run_exports, strip_and_tag)

WINDOW = 24
FORMS = ("mistral_window_kv", "gemma2_softcap_kv", "gptoss_sinks_kv")
_COMMON = dict(hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS, num_attention_heads=HEADS,
               num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate_size=64, vocab_size=VOCAB,
               max_position_embeddings=1024, tie_word_embeddings=False, initializer_range=0.1,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)
_ALTERNATING = ["sliding_attention", "full_attention"]


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(**_COMMON, sliding_window=WINDOW)
    cfg._attn_implementation = "sdpa"
    return MistralForCausalLM(cfg)


def _gemma2():
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(**_COMMON, sliding_window=WINDOW, layer_types=_ALTERNATING, attn_logit_softcapping=2.0,
                       final_logit_softcapping=30.0, query_pre_attn_scalar=256)
    cfg._attn_implementation = "eager"
    m = Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)  # scores of a few units, where tanh(s / 2) bends
    return m


def _gptoss():
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(**_COMMON, sliding_window=WINDOW, layer_types=_ALTERNATING, num_local_experts=4,
                       num_experts_per_tok=2)
    cfg._attn_implementation = "eager"
    m = GptOssForCausalLM(cfg)
    m.set_experts_implementation("batched_mm")
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, HEADS))
    return m


def export(name: str, out_dir: Path) -> Path:
    import torch

    build = {"mistral_window_kv": _mistral, "gemma2_softcap_kv": _gemma2, "gptoss_sinks_kv": _gptoss}.get(name)
    if build is None:
        raise ValueError(f"export_attention_variants: unknown form '{name}', expected one of {FORMS}")
    torch.manual_seed(SEED)
    model = build().eval()
    out = out_dir / f"{name}.onnx"
    export_dynamo(model, out, opset=20, full_cache=True)
    return strip_and_tag(out, name, "graphs/export_attention_variants.py")


def main(argv=None) -> int:
    return run_exports(FORMS, export, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
