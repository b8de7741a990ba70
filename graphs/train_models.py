# SPDX-License-Identifier: MIT
"""Trains small real language models on the Python standard library and exports them to ONNX.

    python graphs/train_models.py --tiny [--out DIR] [--models dense,moe[,moe_shared]] [--seed 0]
    python graphs/train_models.py --full [--out DIR]          # the GPU config (2k context)

Issue 21: accuracy figures need trained models (a random model's near-tied logits make token
agreement noise), and nothing can be downloaded, so this script makes them from text every
machine has: the ``.py`` files of the standard library of the Python running it
(``sysconfig.get_paths()["stdlib"]``; site-packages excluded). Files whose CRC-32 of the relative
path is 0 mod 16 are held out for evaluation; the rest train.

Steps, each deterministic from ``--seed`` (same Python, same library files, same torch):
  1. tokenizer: byte-level BPE (``tokenizers``), trained on the training files;
  2. token streams: every file encoded, files joined by ``<eos>`` (sorted path order);
  3. models (transformers classes, built from a config in code):
       dense       Llama-style decoder: GQA (query heads 2x the kv heads), RoPE, head_dim 64,
                   SwiGLU MLP, untied embeddings;
       moe         Mixtral-style: the same attention, 8 experts top-2 in every layer (router
                   softmax, top-2 renormalized), router load-balancing loss;
       moe_shared  Qwen2-MoE-style: 8 experts top-2 (not renormalized) plus a shared expert
                   gated by Sigmoid(Linear(h -> 1)) (the shared-expert variant);
  4. training: AdamW, linear warm-up then cosine decay, random windows of the training stream
     drawn by numpy's Generator(seed); CUDA (bf16 autocast) when present, else the CPU in
     float32 with one torch thread (the development machine's other core stays free);
  5. export: torch.onnx dynamo with a KV cache, through ``graphs/export_fixtures.export_dynamo``
     (the ``dynamo_sdpa_kv`` form the attention rewrite takes; MoE experts as
     ``batched_mm``, the form the MoE rewrite takes).

Writes into ``--out`` (default ``/tmp/ort_ops_models/<tiny|full>``): ``tokenizer.json``,
``eval_tokens.npy`` (the held-out stream, int32), ``train_tokens_head.npy`` (the first 64k
training tokens: calibration text for INT8 peers), per model ``<name>.onnx`` and ``<name>.pt``
(state dict), and ``manifest.json`` (seed, configs, corpus counts and hashes, losses). The
evaluation (benchmarks/eval_perplexity.py) reads only the ONNX files and ``eval_tokens.npy``.

Configs:
  --tiny  hidden 128, 2 layers, 2 query / 1 kv heads, vocab 2048, 4 windows of 512 tokens a step,
          280 steps: dense and moe together train and export in <= 10 minutes on this 2-core CPU
          with one torch thread (moe_shared adds ~5 minutes). Small and briefly trained: real
          text statistics, not a good language model.
  --full  hidden 512, 8 layers, 8 query / 2 kv heads, vocab 8192, 2048-token windows (test files
          of the library included in the corpus); minutes on one H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import numpy as np

MODELS = ("dense", "moe", "moe_shared")
HOLDOUT_MOD = 16  # a file is held out when crc32(relative path) % 16 == 0
SPECIAL = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2 (the fixtures' pad / bos / eos ids)
EOS_ID = 2
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
TEST_DIRS = {"test", "tests", "idle_test"}


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int           # dense MLP width
    expert_mlp: int    # width of one expert
    shared_mlp: int    # width of the shared expert (moe_shared)
    experts: int
    top_k: int
    seq: int           # training window
    batch: int
    steps: int
    lr: float
    warmup: int
    with_tests: bool   # the library's test directories join the corpus
    max_positions: int = 8192  # RoPE table; evaluation runs past the training window


TINY = Config(name="tiny", vocab=2048, hidden=128, layers=2, heads=2, kv_heads=1, mlp=384, expert_mlp=128,
              shared_mlp=256, experts=8, top_k=2, seq=512, batch=4, steps=280, lr=3e-3, warmup=20,
              with_tests=False)
FULL = Config(name="full", vocab=8192, hidden=512, layers=8, heads=8, kv_heads=2, mlp=1536, expert_mlp=512,
              shared_mlp=1024, experts=8, top_k=2, seq=2048, batch=32, steps=1000, lr=1e-3, warmup=100,
              with_tests=True)
HEAD_DIM = 64


# --- corpus and tokenizer -----------------------------------------------------------------------


def corpus_files(with_tests: bool) -> tuple[Path, list[Path], list[Path]]:
    """(stdlib root, training files, held-out files), each sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = SKIP_DIRS | (set() if with_tests else TEST_DIRS)
    files = sorted((p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts[:-1])),
                   key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise FileNotFoundError(f"train_models: no .py files under the standard library '{root}'")
    held = [p for p in files if zlib.crc32(p.relative_to(root).as_posix().encode()) % HOLDOUT_MOD == 0]
    train = [p for p in files if zlib.crc32(p.relative_to(root).as_posix().encode()) % HOLDOUT_MOD != 0]
    return root, train, held


def _read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab: int):
    """Byte-level BPE over the training files (single-threaded, so its merges do not depend on
    thread timing)."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator((_read(p) for p in files), vocab_size=vocab, min_frequency=2,
                            special_tokens=list(SPECIAL), show_progress=False)
    return tok


def encode_stream(tok, files: list[Path]) -> np.ndarray:
    """All files' tokens in order, each file followed by <eos>; int32."""
    parts = []
    encs = tok.encode_batch([_read(p) for p in files])
    for e in encs:
        parts.append(np.asarray(e.ids, np.int32))
        parts.append(np.asarray([EOS_ID], np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


# --- models -------------------------------------------------------------------------------------


def build_model(kind: str, cfg: Config):
    """A transformers causal LM of the given kind, float32, random init (seeded by the caller)."""
    common = {"vocab_size": cfg.vocab, "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers,
                  "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": HEAD_DIM,
                  "max_position_embeddings": cfg.max_positions, "rope_theta": 10000.0, "tie_word_embeddings": False,
                  "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": EOS_ID}
    if kind == "dense":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(intermediate_size=cfg.mlp, **common))
    if kind == "moe":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(intermediate_size=cfg.expert_mlp, num_local_experts=cfg.experts,
                                                num_experts_per_tok=cfg.top_k, router_aux_loss_coef=0.01,
                                                output_router_logits=True, **common))
    if kind == "moe_shared":
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        return Qwen2MoeForCausalLM(Qwen2MoeConfig(
            intermediate_size=cfg.mlp, moe_intermediate_size=cfg.expert_mlp,
            shared_expert_intermediate_size=cfg.shared_mlp, num_experts=cfg.experts,
            num_experts_per_tok=cfg.top_k, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
            router_aux_loss_coef=0.01, output_router_logits=True, **common))
    raise ValueError(f"train_models: model must be one of {MODELS}, got '{kind}'")


def _lr_at(step: int, cfg: Config) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _batches(stream: np.ndarray, cfg: Config, rng: np.random.Generator):
    hi = stream.size - cfg.seq - 1
    if hi <= 0:
        raise ValueError(f"train_models: {stream.size} training tokens, fewer than one {cfg.seq}-token window")
    while True:
        starts = rng.integers(0, hi, cfg.batch)
        yield np.stack([stream[s:s + cfg.seq] for s in starts]).astype(np.int64)


def eval_loss(model, stream: np.ndarray, seq: int, windows: int, device) -> float:
    """Mean next-token NLL (nats) of the model over ``windows`` consecutive held-out windows."""
    import torch

    model.eval()
    losses = []
    with torch.no_grad():
        for w in range(windows):
            ids = stream[w * seq:(w + 1) * seq]
            if ids.size < seq:
                break
            x = torch.from_numpy(ids.astype(np.int64))[None].to(device)
            logits = model(input_ids=x).logits[0, :-1].float()
            losses.append(float(torch.nn.functional.cross_entropy(logits, x[0, 1:])))
    model.train()
    return float(np.mean(losses)) if losses else float("nan")


def train(kind: str, cfg: Config, train_stream: np.ndarray, eval_stream: np.ndarray, seed: int, device,
          log=print) -> tuple[object, dict]:
    import torch

    torch.manual_seed(seed)
    model = build_model(kind, cfg).to(device)
    # CUDA: eager attention, whose backward is deterministic (sdpa's fused backward kernels are
    # not); the CPU's sdpa is the math path, deterministic and faster than eager there.
    model.set_attn_implementation("sdpa" if device.type == "cpu" else "eager")
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    rng = np.random.default_rng(seed)
    batches = _batches(train_stream, cfg, rng)
    t0, c0 = time.time(), time.process_time()
    history = []
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        x = torch.from_numpy(next(batches)).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=x, labels=x)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == cfg.steps - 1:
            loss = float(out.loss.detach())
            history.append((step, loss))
            log(f"  {kind} step {step:5d}/{cfg.steps} loss {loss:.3f} ({time.time() - t0:.0f} s)", flush=True)
    model = model.float().cpu().eval()
    model.set_attn_implementation("sdpa")  # the form export_fixtures exports
    ev = eval_loss(model, eval_stream, min(cfg.seq, 512), 8, torch.device("cpu"))
    # CPU seconds too: on a shared machine the wall time says more about the neighbours.
    return model, {"train_seconds": round(time.time() - t0, 1),
                   "train_cpu_seconds": round(time.process_time() - c0, 1), "loss_history": history,
                   "final_train_loss": history[-1][1], "heldout_nll_torch_fp32": ev,
                   "heldout_ppl_torch_fp32": math.exp(ev), "heldout_eval_window": min(cfg.seq, 512),
                   "parameters": sum(p.numel() for p in model.parameters())}


def export(model, kind: str, path: Path) -> None:
    """ONNX with a KV cache (graphs/export_fixtures.py's dynamo form); MoE experts as batched_mm."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from export_fixtures import export_dynamo

    if kind != "dense":
        model.set_experts_implementation("batched_mm")
    model.config.output_router_logits = False
    export_dynamo(model, path, opset=20, with_past=True)
    import onnx

    m = onnx.load(str(path))
    for node in m.graph.node:  # exporter stack traces: half the file, no use here
        del node.metadata_props[:]
        node.doc_string = ""
    onnx.helper.set_model_props(m, {"ort_ops.generated_by": "graphs/train_models.py",
                                    "ort_ops.trained_model": kind, "ort_ops.eos_token_id": str(EOS_ID)})
    onnx.save(m, str(path))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group(required=True)
    size.add_argument("--tiny", action="store_true", help="CPU config (<= 10 min on 2 cores)")
    size.add_argument("--full", action="store_true", help="GPU config (2k context)")
    ap.add_argument("--out", help="output directory (default /tmp/ort_ops_models/<tiny|full>)")
    ap.add_argument("--models", default="dense,moe", help=f"comma list of {', '.join(MODELS)} (default dense,moe)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, help="override the config's training steps")
    ap.add_argument("--device", default="auto", help="auto (cuda when present) | cpu | cuda")
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # progress shows up in logs of long runs
    cfg = TINY if args.tiny else FULL
    if args.steps:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    kinds = [k for k in args.models.split(",") if k]
    bad = [k for k in kinds if k not in MODELS]
    if bad:
        print(f"train_models: --models must name {', '.join(MODELS)}, got '{bad[0]}'", file=sys.stderr)
        return 2
    out = Path(args.out or f"/tmp/ort_ops_models/{cfg.name}")
    out.mkdir(parents=True, exist_ok=True)

    # Determinism before torch starts: cuBLAS needs a fixed workspace for deterministic GEMMs.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          (args.device if args.device != "auto" else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(1)
    # warn_only: an op without a deterministic CUDA kernel warns instead of failing the run.
    torch.use_deterministic_algorithms(True, warn_only=True)

    t0 = time.time()
    root, train_files, held_files = corpus_files(cfg.with_tests)
    tok = train_tokenizer(train_files, cfg.vocab)
    tok_json = tok._tokenizer.to_str()
    (out / "tokenizer.json").write_text(tok_json)
    train_stream = encode_stream(tok, train_files)
    eval_stream = encode_stream(tok, held_files)
    np.save(out / "eval_tokens.npy", eval_stream)
    np.save(out / "train_tokens_head.npy", train_stream[:65536])
    print(f"corpus {root}: {len(train_files)} training files ({train_stream.size} tokens), "
          f"{len(held_files)} held out ({eval_stream.size} tokens); tokenizer {time.time() - t0:.0f} s")
    manifest = {
        "generated_by": "graphs/train_models.py", "seed": args.seed, "config": dataclasses.asdict(cfg),
        "head_dim": HEAD_DIM, "device": str(device), "torch": torch.__version__, "python": sys.version.split()[0],
        "corpus": {"stdlib": str(root), "train_files": len(train_files), "heldout_files": len(held_files),
                   "train_tokens": int(train_stream.size), "heldout_tokens": int(eval_stream.size),
                   "heldout_rule": f"crc32(relative path) % {HOLDOUT_MOD} == 0",
                   "heldout_sha256": _sha(eval_stream.tobytes()), "tokenizer_sha256": _sha(tok_json.encode())},
        "models": {},
    }
    for kind in kinds:
        print(f"training {kind} ({cfg.name}) on {device}")
        model, info = train(kind, cfg, train_stream, eval_stream, args.seed, device)
        torch.save(model.state_dict(), out / f"{kind}.pt")
        # Two runs with one seed must give these same bytes (the determinism check).
        info["weights_sha256"] = _sha(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values()))
        export(model, kind, out / f"{kind}.onnx")
        info["onnx_bytes"] = (out / f"{kind}.onnx").stat().st_size
        manifest["models"][kind] = info
        print(f"  {kind}: held-out ppl (torch fp32, {info['heldout_eval_window']}-token windows) "
              f"{info['heldout_ppl_torch_fp32']:.2f}; {out / (kind + '.onnx')} ({info['onnx_bytes'] / 1e6:.1f} MB)")
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"done in {time.time() - t0:.0f} s: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
