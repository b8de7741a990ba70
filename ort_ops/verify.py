# SPDX-License-Identifier: MIT
"""``ort-ops verify``: the service-level check of a rewritten decoder against its original.

Both models greedily decode the same prompts (different lengths, one batch): the original on
stock onnxruntime in fp32 (left-padded batch, past/present fed back), the rewritten one with the
runtime (paged KV cache when it is paged; otherwise the same loop with the library registered).
The rewritten model runs twice: teacher-forced on the original's tokens (every step sees the
same context, so one near-tie does not shift everything after it) and free-running.
Per prompt and overall (teacher-forced, what ``--min-agreement`` judges):

    token_agreement     share of steps where the rewritten model's greedy token is the original's
    logits_max_abs_err  max |logits_orig - logits_rewritten| over all steps (same contexts)
    length_match        the rewritten model, fed the original's tokens, stops at the same step
                        (picks EOS where the original did and nowhere before; or never, when the
                        original ran to max_new_tokens)
    eos_match           both stop on EOS, or neither does

``free_running`` holds the same three checks for the rewritten model decoding on its own
(token agreement position-wise over the longer output).
"""

from __future__ import annotations

import dataclasses

import numpy as np

DEFAULT_PROMPT_LENGTHS = (5, 11, 17, 23)


@dataclasses.dataclass
class PromptReport:
    prompt_len: int
    tokens_original: list
    tokens_rewritten: list  # teacher-forced greedy choices
    token_agreement: float
    logits_max_abs_err: float
    length_match: bool
    eos_match: bool
    free_running: dict


def make_prompts(vocab: int, lengths=DEFAULT_PROMPT_LENGTHS, seed: int = 0, avoid=()) -> list[list[int]]:
    """Deterministic random prompts with token ids in [3, vocab) minus ``avoid`` (e.g. EOS)."""
    rng = np.random.default_rng(seed)
    hi = max(4, min(vocab, 32000))
    out = []
    for n in lengths:
        toks = rng.integers(3, hi, n)
        for a in avoid:
            toks[toks == a] = 3 if a != 3 else 4
        out.append([int(t) for t in toks])
    return out


def vocab_size(model, *, providers=None) -> int:
    """The logits' last dimension, read from a one-token run of the original (on ``providers``,
    default the CPU EP)."""
    from ort_ops.runtime import DenseRunner

    runner = DenseRunner(model, providers=providers)
    logits, _ = runner.run(np.array([[3]], np.int64), np.ones((1, 1), np.int64), None)
    return int(logits.shape[-1])


def _stop_step(tokens, eos) -> int | None:
    """Index of the first EOS among ``tokens`` (None: none)."""
    if eos is None:
        return None
    return next((j for j, t in enumerate(tokens) if t == eos), None)


def compare(orig, forced, free, eos) -> PromptReport:
    """orig: the original's free-running Generation; forced: the rewritten model teacher-forced
    on orig.tokens; free: the rewritten model free-running."""
    a, t = orig.tokens, forced.tokens
    agree = sum(int(x == y) for x, y in zip(a, t)) / len(a) if a else 1.0
    err = float(np.max(np.abs(orig.logits - forced.logits))) if len(a) else 0.0
    stop_o = len(a) - 1 if orig.stopped_by_eos else None
    stop_t = _stop_step(t, eos)
    eos_match = (stop_o is None) == (stop_t is None)
    length_match = stop_o == stop_t
    b = free.tokens
    n = max(len(a), len(b))
    free_report = {
        "token_agreement": sum(int(x == y) for x, y in zip(a, b)) / n if n else 1.0,
        "length_match": len(a) == len(b),
        "eos_match": orig.stopped_by_eos == free.stopped_by_eos,
        "tokens": b,
    }
    return PromptReport(0, a, t, agree, err, length_match, eos_match, free_report)


def runs_one_sequence_only(proto) -> bool:
    """True when onnxruntime runs the model on one sequence at a time only: an ONNX
    RotaryEmbedding without position_ids takes cos/sin caches of [B, S, D/2] and ORT wants B to be
    the input's batch, while torch.onnx computes them [1, S, D/2] (positions from the cache
    length, shared by the batch). Such an original is decoded one prompt at a time."""
    for n in proto.graph.node:
        if n.op_type == "RotaryEmbedding" and n.domain in ("", "ai.onnx") and (len(n.input) < 4 or not n.input[3]):
            return True
    return False


# How a bfloat16 pair runs: onnxruntime's Python API neither feeds nor returns bfloat16 arrays,
# and its CPU provider has no bfloat16 MatMul.
_BF16_HOW = {"cpu": "both models as their float32 twins (the CPU EP has no bfloat16 MatMul)",
             "cuda": "both models with float32 inputs and outputs around their bfloat16 graphs"}


def _is_bfloat16(proto) -> bool:
    from onnx import TensorProto

    g = proto.graph
    return (any(t.data_type == TensorProto.BFLOAT16 for t in g.initializer)
            or any(v.type.tensor_type.elem_type == TensorProto.BFLOAT16 for v in (*g.input, *g.output)))


def _bfloat16_runnable(src, device: str):
    """A bfloat16 model as a ModelProto that onnxruntime runs on ``device``: its float32 twin on
    the CPU (rewrite._graph.float32_twin), float32 inputs and outputs around the bfloat16 graph on
    CUDA (rewrite._graph.float32_io). Loads the whole model (twins hold float32 weight copies)."""
    import onnx_ir as ir

    from ort_ops.rewrite._graph import float32_io, float32_twin

    model = ir.load(src) if isinstance(src, str) else ir.serde.deserialize_model(src)
    return ir.to_proto(float32_twin(model) if device == "cpu" else float32_io(model))


def verify(original, rewritten, *, prompts=None, max_new_tokens: int = 32, eos_token_id=None,
           seed: int = 0, progress: bool | None = False, device: str | None = None, providers=None,
           cuda_graph: bool | None = None) -> dict:
    """Runs both models on the same prompts; returns the report as a dict (``--json`` prints it).

    Args:
        original, rewritten: paths (or ModelProtos).
        prompts: token id lists (default: 4 random prompts of lengths 5, 11, 17, 23).
        max_new_tokens: per prompt.
        eos_token_id: stop token (None: the original's metadata ``ort_ops.eos_token_id`` if any).
        device / providers: where both models run ("cpu" | "cuda", ``runtime.resolve_device``):
            the original on stock onnxruntime on that EP, the rewritten one on the paged runtime
            (its cache on the GPU on "cuda").
        cuda_graph: the rewritten model's decode steps as CUDA graphs on "cuda" (default on).

    Returns:
        {"overall": {...}, "prompts": [{...}, ...], "rewritten_interface": "paged" | "dense"}.
    """
    from ort_ops.runtime import _load_proto, generate, paged_metadata, resolve_device

    device, providers = resolve_device(device, providers)
    # Graphs only (metadata, vocabulary); the sessions read paths themselves, weights included.
    p_orig, p_rew = _load_proto(original, load_external_data=False), _load_proto(rewritten, load_external_data=False)
    src_orig = original if isinstance(original, str) else _load_proto(original)
    src_rew = rewritten if isinstance(rewritten, str) else _load_proto(rewritten)
    bf16 = _is_bfloat16(p_orig)
    if bf16:
        src_orig, src_rew = _bfloat16_runnable(src_orig, device), _bfloat16_runnable(src_rew, device)
    if eos_token_id is None:
        meta = {p.key: p.value for p in p_orig.metadata_props}
        if "ort_ops.eos_token_id" in meta:
            eos_token_id = int(meta["ort_ops.eos_token_id"])
    if prompts is None:
        prompts = make_prompts(vocab_size(src_orig, providers=providers), seed=seed,
                               avoid=() if eos_token_id is None else (eos_token_id,))
    if runs_one_sequence_only(p_orig):
        a = [generate(src_orig, [p], max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                      return_logits=True, with_library=False, progress=progress, providers=providers)[0]
             for p in prompts]
    else:
        a = generate(src_orig, prompts, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                     return_logits=True, with_library=False, progress=progress, providers=providers)
    forced = generate(src_rew, prompts, forced_tokens=[x.tokens for x in a], return_logits=True,
                      progress=progress, providers=providers, cuda_graph=cuda_graph)
    b = generate(src_rew, prompts, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                 progress=progress, providers=providers, cuda_graph=cuda_graph)
    reports = []
    for p, x, t, y in zip(prompts, a, forced, b):
        r = compare(x, t, y, eos_token_id)
        r.prompt_len = len(p)
        reports.append(r)
    positions = sum(len(r.tokens_original) for r in reports)
    agree = sum(r.token_agreement * len(r.tokens_original) for r in reports)
    free_pos = sum(max(len(r.tokens_original), len(r.free_running["tokens"])) for r in reports)
    free_agree = sum(r.free_running["token_agreement"] * max(len(r.tokens_original), len(r.free_running["tokens"]))
                     for r in reports)
    overall = {
        "token_agreement": agree / positions if positions else 1.0,
        "logits_max_abs_err": max(r.logits_max_abs_err for r in reports),
        "length_match": all(r.length_match for r in reports),
        "eos_match": all(r.eos_match for r in reports),
        "prompts": len(reports),
        "max_new_tokens": max_new_tokens,
        "eos_token_id": eos_token_id,
        "free_running": {
            "token_agreement": free_agree / free_pos if free_pos else 1.0,
            "length_match": all(r.free_running["length_match"] for r in reports),
            "eos_match": all(r.free_running["eos_match"] for r in reports),
        },
    }
    return {
        "overall": overall,
        "prompts": [dataclasses.asdict(r) for r in reports],
        "rewritten_interface": "paged" if paged_metadata(p_rew) else "dense",
        **({"bfloat16": _BF16_HOW[device]} if bf16 else {}),
        "device": device,
    }


# --- teacher-forced agreement ---------------------------------------------------------------------
# Free-running agreement above counts every position after the first differing token as a
# disagreement. On tiny random-weight models (flat next-token distributions) one near-tie flipped
# by INT8 rounding therefore decides a whole prompt's score. Teacher forcing scores each decision
# on the original's own context, so a flip costs one position.


def teacher_forced_agreement(original, rewritten, prompts, *, max_new_tokens: int = 32,
                             eos_token_id: int | None = None, tie_margin: float = 0.0) -> dict:
    """Greedy continuation of each prompt by the original; the rewritten model then reads
    prompt + continuation in one dense forward and picks its next token at every position.

    Args:
        original, rewritten: paths or ModelProtos; ``rewritten`` must be dense (not paged).
        prompts: token id lists.
        eos_token_id: the stop token (stop decisions = EOS chosen or not).
        tie_margin: stop decisions are compared only where the original's EOS logit is further
            than this from its best other logit (a closer call is a tie for rounding to break).

    Returns:
        {"agreement": matching / positions, "positions": int, "stop_decisions_match": bool,
         "per_prompt": [{"prompt_len", "agree", "positions", "stop_mismatches"}]}.
    """
    from ort_ops.runtime import DenseRunner, _load_proto, generate, paged_metadata

    p_orig, p_rew = _load_proto(original), _load_proto(rewritten)  # each parsed once, for both its uses
    if paged_metadata(p_rew):
        raise ValueError("ort_ops.verify: teacher forcing needs a dense rewritten model (rewrite with --no-attention)")
    gens = generate(p_orig, prompts, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                    with_library=False)
    orig_runner = DenseRunner(p_orig, with_library=False)
    rew_runner = DenseRunner(p_rew, with_library=True)
    per, agree, total, stop_ok = [], 0, 0, True
    for p, g in zip(prompts, gens):
        want = np.array(g.tokens, np.int64)
        ctx = np.array([list(p) + g.tokens[:-1]], np.int64)
        mask = np.ones_like(ctx)
        ref = orig_runner.run(ctx, mask, None)[0][0, len(p) - 1:].astype(np.float32)
        got = rew_runner.run(ctx, mask, None)[0][0, len(p) - 1:].argmax(-1)
        n_agree = int(np.sum(got == want))
        mism = 0
        if eos_token_id is not None:
            gap = ref[:, eos_token_id] - np.delete(ref, eos_token_id, axis=1).max(axis=1)
            clear = np.abs(gap) > tie_margin
            mism = int(np.sum(((got == eos_token_id) != (want == eos_token_id)) & clear))
        stop_ok &= mism == 0
        agree, total = agree + n_agree, total + len(want)
        per.append({"prompt_len": len(p), "agree": n_agree, "positions": len(want), "stop_mismatches": mism})
    return {"agreement": agree / total if total else 1.0, "positions": total,
            "stop_decisions_match": bool(stop_ok), "per_prompt": per}
