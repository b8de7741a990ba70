# SPDX-License-Identifier: MIT
"""The paged model's interface: the one contract between the rewrite that makes a paged model
(``ort_ops.rewrite.paged_attention_int8``) and the runtime that serves it (``ort_ops.runtime``).

A paged model takes, besides its token inputs (``input_ids``, ``position_ids``: int64 [1, T], the
new tokens of all sequences packed), the step tables below, and per layer i the INT8 cache
``kv_cache.{i}.{part}`` as inputs and ``kv_cache_out.{i}.{part}`` as outputs (the runtime binds
each output to its input's buffer, so a step writes only its new slots). Besides the logits it
has the greedy pick ``next_token`` (int64 ArgMax of the logits over the vocabulary), so a greedy
decode step can bring back token ids instead of logits. Its ``metadata_props[PAGED_META_KEY]`` is
the JSON whose keys META_KEYS lists (make_metadata, read_metadata); OPTIONAL_META_KEYS are the
keys added after version 1 was fixed, absent from paged models written before them.

Alphabet: T packed new tokens, S sequences, M blocks a sequence may hold, N cache blocks,
Hkv kv heads, Bs block size, D head dim.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

PAGED_META_KEY = "ort_ops.paged"
META_VERSION = 1

# The step tables: name -> (numpy dtype, symbolic shape).
SLOT_MAPPING = "slot_mapping"  # cache slot of each new token: block * Bs + offset
BLOCK_TABLES = "block_tables"  # blocks of each sequence, in order (unused entries: any valid id)
SEQ_LENS = "seq_lens"          # context length of each sequence after this step
CU_SEQLENS_Q = "cu_seqlens_q"  # sequence s owns packed rows cu[s] .. cu[s+1]-1 (at least one)
STEP_TABLES: dict[str, tuple[np.dtype, tuple[str, ...]]] = {
    SLOT_MAPPING: (np.dtype(np.int64), ("total_tokens",)),
    BLOCK_TABLES: (np.dtype(np.int32), ("num_seqs", "max_blocks")),
    SEQ_LENS: (np.dtype(np.int32), ("num_seqs",)),
    CU_SEQLENS_Q: (np.dtype(np.int32), ("num_seqs_plus_1",)),
}

# The four cache tensors of a layer, in the order QuantizeKVCache and PagedAttentionInt8 take them.
CACHE_PARTS = ("key", "value", "key_scale", "value_scale")


def cache_input_name(layer: int, part: str) -> str:
    return f"kv_cache.{layer}.{part}"


def cache_output_name(layer: int, part: str) -> str:
    return f"kv_cache_out.{layer}.{part}"


def cache_shapes(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int):
    """(shape, numpy dtype) of a layer's key [N, Hkv, Bs, D], value [N, Hkv, D, Bs] (tokens
    innermost), key_scale and value_scale [N, Hkv, Bs], in CACHE_PARTS order."""
    n, h, b, d = num_blocks, num_kv_heads, block_size, head_dim
    return (((n, h, b, d), np.dtype(np.int8)), ((n, h, d, b), np.dtype(np.int8)),
            ((n, h, b), np.dtype(np.float32)), ((n, h, b), np.dtype(np.float32)))


# The metadata's keys: what the rewrite writes and the runtime reads.
META_KEYS = {
    "version": "META_VERSION",
    "num_layers": "number of paged layers",
    "num_kv_heads": "kv heads of layer 0",
    "head_dim": "head dim of layer 0",
    "layer_dims": "[[Hkv, D], ...] per layer",
    "block_size": "Bs",
    "pv_quant": "the ops' pv_quant attribute",
    "qk_quant": "the ops' qk_quant attribute",
    "input_ids": "name of the token ids input",
    "position_ids": "name of the positions input",
    "logits": "name of the logits output (or None)",
    "logits_rows": '"last": one row per sequence (its last new token); "all": one per packed token',
    "next_token": ('name of the greedy token output: ArgMax(logits, axis=-1, keepdims=0) int64, [1, S] '
                   'or [1, T] as logits_rows says; ties go to the first maximum (select_last_index=0, '
                   'as np.argmax); None: the model has none (no logits, or written before the key)'),
    "cache_inputs": "[[cache_input_name(i, part) for part in CACHE_PARTS] for each layer]",
    "cache_outputs": "[[cache_output_name(i, part) for part in CACHE_PARTS] for each layer]",
    "removed_inputs": "the original's inputs the paged model no longer has",
    "removed_outputs": "the original's outputs the paged model no longer has",
}

# Keys a version-1 model may lack (written before the key existed) -> the value read_metadata
# gives it then. Adding one keeps META_VERSION: older models still read, and mean what they did.
OPTIONAL_META_KEYS: dict[str, Any] = {"next_token": None}

# The greedy token output's name in the models the rewrite writes.
NEXT_TOKEN = "ort_ops.next_token"


def make_metadata(**fields: Any) -> str:
    """The metadata JSON of a paged model; every key of META_KEYS must be given (those of
    OPTIONAL_META_KEYS may be left out: they get their default), no other."""
    fields = {"version": META_VERSION, **OPTIONAL_META_KEYS, **fields}
    missing, extra = set(META_KEYS) - set(fields), set(fields) - set(META_KEYS)
    if missing or extra:
        raise ValueError(f"ort_ops.paged_interface: metadata keys missing {sorted(missing)}, unknown {sorted(extra)}")
    return json.dumps(fields)


def read_metadata(proto) -> dict | None:
    """The paged metadata of a ModelProto, None if the model is not paged. Keys of
    OPTIONAL_META_KEYS that the model lacks get their default.

    Raises:
        ValueError: metadata of another version, or without a key the runtime needs.
    """
    for p in proto.metadata_props:
        if p.key == PAGED_META_KEY:
            meta = json.loads(p.value)
            if meta.get("version") != META_VERSION:
                raise ValueError(f"ort_ops.paged_interface: paged metadata version {meta.get('version')!r}, "
                                 f"this ort_ops reads version {META_VERSION}; rewrite the model again")
            missing = sorted(set(META_KEYS) - set(meta) - set(OPTIONAL_META_KEYS))
            if missing:
                raise ValueError(f"ort_ops.paged_interface: paged metadata lacks {missing}; rewrite the model again")
            return {**OPTIONAL_META_KEYS, **meta}
    return None
