# SPDX-License-Identifier: MIT
"""Paged KV-cache runtime for rewritten decoders, and greedy generation.

Alphabet: S sequences in a step, T packed tokens of the step, N cache blocks, Bs block size,
M blocks per sequence (block-table width), V vocabulary.

A *paged* model (``ort-ops rewrite`` of a KV-cache decoder; its ``metadata_props["ort_ops.paged"]``
describes it) takes the tokens of all sequences of a step packed as one row: ``input_ids`` and
``position_ids`` [1, T], ``slot_mapping`` int64 [T] (cache slot of each new token),
``block_tables`` int32 [S, M], ``seq_lens`` int32 [S] (context length after the step),
``cu_seqlens_q`` int32 [S+1] (sequence s owns rows cu[s] .. cu[s+1]-1) and, per layer, the INT8
caches and their scales. The runtime binds every ``kv_cache_out.*`` output to the buffer of its
``kv_cache.*`` input (IOBinding), so a step writes only its new slots.

    cache = PagedKVCache.for_model(model, num_blocks=256)
    runner = PagedRunner(model, cache)
    logits_SV = runner.step({seq_id: new_tokens, ...})       # prefill, then one token per step
    out = generate(model, prompts, max_new_tokens=32, eos_token_id=2)

Models that are not paged (an original export, or a prefill-only rewrite) run through
``DenseRunner``: left-padded batches, attention_mask and position_ids, past/present fed back when
the model has them, the whole sequence recomputed when it has not.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterable, Sequence

import numpy as np

PAGED_META_KEY = "ort_ops.paged"


def _load_proto(model):
    import onnx

    if isinstance(model, (str, bytes)) and not (isinstance(model, bytes) and len(model) > 4096):
        path = model.decode() if isinstance(model, bytes) else model
        try:
            return onnx.load(path, load_external_data=True)
        except FileNotFoundError:
            raise FileNotFoundError(f"ort_ops.runtime: model file '{path}' not found") from None
        except Exception as e:  # noqa: BLE001 - one clear line for the CLI
            raise ValueError(f"ort_ops.runtime: '{path}' is not a readable ONNX model ({str(e).splitlines()[0]})") from None
    if isinstance(model, bytes):
        return onnx.load_from_string(model)
    return model


def paged_metadata(model) -> dict | None:
    """The paged interface description of a model (path, bytes or ModelProto), None if not paged."""
    proto = _load_proto(model)
    for p in proto.metadata_props:
        if p.key == PAGED_META_KEY:
            return json.loads(p.value)
    return None


def _dtype_of(elem_type: int):
    from onnx import helper

    return helper.tensor_dtype_to_np_dtype(elem_type)


# --- the cache ---------------------------------------------------------------------------------


class BlockAllocator:
    """Hands out cache blocks to sequences and takes them back.

    Blocks are the unit of the paged cache; a sequence of length L holds ceil(L / Bs) of them, in
    order, in its block table. Freed blocks are reused (lowest number first, for locality).
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"BlockAllocator: num_blocks and block_size must be positive, got "
                             f"{num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() gives the lowest
        self.tables: dict = {}  # seq id -> list of blocks
        self.lengths: dict = {}  # seq id -> tokens cached

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def reserve(self, seq_id, new_length: int) -> None:
        """Makes sure ``seq_id`` owns enough blocks for ``new_length`` tokens."""
        table = self.tables.setdefault(seq_id, [])
        self.lengths.setdefault(seq_id, 0)
        need = -(-new_length // self.block_size) - len(table)
        if need > len(self._free):
            raise RuntimeError(f"ort_ops.runtime: KV cache full: sequence {seq_id!r} needs {need} more "
                               f"block(s), {len(self._free)} free of {self.num_blocks}; "
                               "create the cache with more blocks")
        for _ in range(max(need, 0)):
            table.append(self._free.pop())

    def reserve_all(self, new_lengths: dict) -> None:
        """``reserve`` for several sequences, all or nothing: when the blocks they need together
        are more than the free ones, nothing is reserved (a partial reservation would leave
        blocks with sequences whose step never ran, and a new sequence holding blocks the caller
        may never release)."""
        need = sum(max(-(-n // self.block_size) - len(self.tables.get(s, [])), 0) for s, n in new_lengths.items())
        if need > len(self._free):
            raise RuntimeError(f"ort_ops.runtime: KV cache full: the step needs {need} more block(s), "
                               f"{len(self._free)} free of {self.num_blocks}; create the cache with more blocks")
        for s, n in new_lengths.items():
            self.reserve(s, n)

    def slots(self, seq_id, start: int, count: int) -> np.ndarray:
        """Cache slots (block * Bs + offset) of positions start .. start+count-1."""
        table = self.tables[seq_id]
        pos = np.arange(start, start + count)
        blocks = np.asarray(table, np.int64)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def release(self, seq_id) -> None:
        """Returns the sequence's blocks to the pool."""
        for b in self.tables.pop(seq_id, []):
            self._free.append(b)
        self._free.sort(reverse=True)
        self.lengths.pop(seq_id, None)


class PagedKVCache:
    """Per-layer INT8 caches and scales (numpy buffers that OrtValues wrap without copying) and
    the block allocator of their blocks."""

    def __init__(self, num_layers: int, layer_dims: Sequence[Sequence[int]], block_size: int,
                 num_blocks: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.buffers: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for i in range(num_layers):
            hkv, d = layer_dims[i]
            self.buffers.append((
                np.zeros((num_blocks, hkv, block_size, d), np.int8),   # key   [N, Hkv, Bs, D]
                np.zeros((num_blocks, hkv, d, block_size), np.int8),   # value [N, Hkv, D, Bs]
                np.zeros((num_blocks, hkv, block_size), np.float32),   # key_scale
                np.zeros((num_blocks, hkv, block_size), np.float32),   # value_scale
            ))

    @classmethod
    def for_model(cls, model, num_blocks: int = 256) -> PagedKVCache:
        meta = paged_metadata(model)
        if meta is None:
            raise ValueError("ort_ops.runtime: the model is not paged (no 'ort_ops.paged' metadata); "
                             "rewrite it with `ort-ops rewrite` first")
        return cls(meta["num_layers"], meta["layer_dims"], meta["block_size"], num_blocks)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for layer in self.buffers for a in layer)


# --- runners -----------------------------------------------------------------------------------


def _session(proto, providers: Sequence[str], with_library: bool, intra_op_threads: int | None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if intra_op_threads is not None:
        so.intra_op_num_threads = intra_op_threads
    if with_library:
        from ort_ops._lib import session_options

        session_options(so)
    return ort.InferenceSession(proto.SerializeToString(), so, providers=list(providers))


class PagedRunner:
    """Runs a paged model step by step over a PagedKVCache, caches bound in place."""

    def __init__(self, model, cache: PagedKVCache | None = None, *, num_blocks: int = 256,
                 providers: Sequence[str] = ("CPUExecutionProvider",), intra_op_threads: int | None = None):
        import onnxruntime as ort

        proto = _load_proto(model)
        meta = paged_metadata(proto)
        if meta is None:
            raise ValueError("ort_ops.runtime: the model is not paged (no 'ort_ops.paged' metadata)")
        self.meta = meta
        self.cache = cache or PagedKVCache(meta["num_layers"], meta["layer_dims"], meta["block_size"], num_blocks)
        if self.cache.block_size != meta["block_size"]:
            raise ValueError(f"ort_ops.runtime: cache block size {self.cache.block_size} != the model's "
                             f"{meta['block_size']}")
        self.session = _session(proto, providers, True, intra_op_threads)
        self._float = {i.name: i.type for i in self.session.get_inputs()}
        self._cache_values = []
        for layer in self.cache.buffers:
            self._cache_values.append([ort.OrtValue.ortvalue_from_numpy(a) for a in layer])
        self.logits_name = meta["logits"] or self.session.get_outputs()[0].name

    def step(self, batch: dict) -> np.ndarray:
        """Runs the new tokens of several sequences in one packed step.

        Args:
            batch: {seq_id: new token ids (list/array)}; a sequence seen for the first time is a
                prefill, later ones continue from its cached length (decode or chunked prefill).

        Returns:
            float32 [S, V]: the logits of each sequence's last new token, in ``batch`` order.
        """
        alloc = self.cache.allocator
        batch = {seq_id: np.asarray(toks, np.int64).reshape(-1) for seq_id, toks in batch.items()}
        for seq_id, toks in batch.items():
            if toks.size == 0:
                raise ValueError(f"ort_ops.runtime: sequence {seq_id!r} has no new tokens")
        alloc.reserve_all({seq_id: alloc.lengths.get(seq_id, 0) + toks.size for seq_id, toks in batch.items()})
        ids, pos, slots, lens, cu, tables = [], [], [], [], [0], []
        for seq_id, toks in batch.items():
            start = alloc.lengths.get(seq_id, 0)
            ids.append(toks)
            pos.append(np.arange(start, start + toks.size, dtype=np.int64))
            slots.append(alloc.slots(seq_id, start, toks.size))
            lens.append(start + toks.size)
            cu.append(cu[-1] + toks.size)
            tables.append(alloc.tables[seq_id])
        width = max(len(t) for t in tables)
        # Unused table entries hold block 0: a valid block the op never reads (past seq_lens).
        bt = np.zeros((len(tables), width), np.int32)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = t
        io = self.session.io_binding()
        io.bind_cpu_input(self.meta["input_ids"], np.concatenate(ids)[None, :])
        io.bind_cpu_input(self.meta["position_ids"], np.concatenate(pos)[None, :])
        io.bind_cpu_input("slot_mapping", np.concatenate(slots).astype(np.int64))
        io.bind_cpu_input("block_tables", bt)
        io.bind_cpu_input("seq_lens", np.asarray(lens, np.int32))
        io.bind_cpu_input("cu_seqlens_q", np.asarray(cu, np.int32))
        for layer, (ins, outs) in enumerate(zip(self.meta["cache_inputs"], self.meta["cache_outputs"])):
            for name_in, name_out, ov in zip(ins, outs, self._cache_values[layer]):
                io.bind_ortvalue_input(name_in, ov)
                io.bind_ortvalue_output(name_out, ov)  # in place: the op writes only new slots
        io.bind_output(self.logits_name)
        self.session.run_with_iobinding(io)
        logits = io.get_outputs()[-1].numpy()  # the caches stay where they are: no copy
        for seq_id, n in zip(batch, lens):
            alloc.lengths[seq_id] = n
        rows = logits.reshape(-1, logits.shape[-1])
        if self.meta.get("logits_rows") == "last":  # lm_head already saw only the last tokens
            return rows.astype(np.float32)
        return rows[np.asarray(cu[1:]) - 1].astype(np.float32)

    def release(self, seq_id) -> None:
        self.cache.allocator.release(seq_id)


class DenseRunner:
    """Runs an ordinary decoder (past/present, or no cache at all) on left-padded batches: the
    reference the paged model is compared with, and the runner of prefill-only rewrites."""

    def __init__(self, model, *, providers: Sequence[str] = ("CPUExecutionProvider",),
                 with_library: bool = False, intra_op_threads: int | None = None):
        proto = _load_proto(model)
        self.session = _session(proto, providers, with_library, intra_op_threads)
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.ids_name = next((n for n in self.inputs if n.endswith("input_ids")), None)
        if self.ids_name is None:
            raise ValueError("ort_ops.runtime: the model has no input_ids input")
        self.mask_name = next((n for n in self.inputs if "attention_mask" in n), None)
        self.pos_name = next((n for n in self.inputs if "position_ids" in n), None)
        self.past = [n for n in self.inputs if "past" in n.lower()]
        self.present = [o for o in self.outputs[1:]]
        if self.past and len(self.past) != len(self.present):
            raise ValueError(f"ort_ops.runtime: {len(self.past)} past inputs but {len(self.present)} "
                             "other outputs")
        self.logits_name = self.outputs[0]
        unknown = set(self.inputs) - {self.ids_name, self.mask_name, self.pos_name, *self.past}
        if unknown:
            raise ValueError(f"ort_ops.runtime: the model has inputs a decoder runner cannot feed: {sorted(unknown)}")

    def _past_shape(self, name: str, batch: int):
        shape = self.inputs[name].shape
        # some exporters write static dims as digit strings ("64")
        dims = [batch] + [int(d) if isinstance(d, str) and d.isdigit() else d for d in (shape[1], 0, shape[3])]
        if not all(isinstance(d, int) for d in dims):
            raise ValueError(f"ort_ops.runtime: past input '{name}' must have static head dims, got {shape}")
        return dims

    def run(self, ids_BS: np.ndarray, mask_BT: np.ndarray, past: list | None):
        feeds = {self.ids_name: ids_BS.astype(np.int64)}
        if self.mask_name:
            feeds[self.mask_name] = mask_BT.astype(np.int64)
        if self.pos_name:
            pos = np.maximum(np.cumsum(mask_BT, axis=1) - 1, 0)[:, -ids_BS.shape[1]:]
            feeds[self.pos_name] = pos.astype(np.int64)
        if self.past:
            b = ids_BS.shape[0]
            if past is None:
                past = [np.zeros(self._past_shape(n, b), _ort_np_dtype(self.inputs[n].type)) for n in self.past]
            feeds.update(dict(zip(self.past, past)))
        outs = self.session.run(None, feeds)
        return outs[0], outs[1:] if self.past else None


def _ort_np_dtype(ort_type: str):
    return {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}.get(
        ort_type, np.float32)


# --- generation ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Generation:
    """Greedy generation of one prompt: the new tokens, why it stopped, and the logits of each step
    (``[steps, V]`` float32, kept when asked)."""

    tokens: list
    stopped_by_eos: bool
    logits: np.ndarray | None = None


class _Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal or forced)."""

    def __init__(self, total: int, label: str, enabled: bool | None):
        self.total, self.label, self.n = total, label, 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.enabled:
            width = 30
            done = int(width * self.n / max(self.total, 1))
            sys.stderr.write(f"\r{self.label} [{'#' * done}{'.' * (width - done)}] {self.n}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _limit(forced, i, max_new_tokens):
    return max_new_tokens if forced is None else len(forced[i])


def _greedy_paged(runner: PagedRunner, prompts, max_new_tokens, eos, keep_logits, progress, forced=None):
    ids = [f"seq{i}" for i in range(len(prompts))]
    results = [Generation([], False, [] if keep_logits else None) for _ in prompts]
    active = {}
    for i, p in enumerate(prompts):
        active[ids[i]] = (i, list(p))
    batch = {sid: toks for sid, (i, toks) in active.items()}
    bar = _Progress(max_new_tokens, "generate", progress)
    try:
        for _ in range(max_new_tokens):
            if not batch:
                break
            logits = runner.step(batch)
            nxt = {}
            for row, sid in enumerate(batch):
                i = active[sid][0]
                tok = int(np.argmax(logits[row]))
                r = results[i]
                r.tokens.append(tok)
                if keep_logits:
                    r.logits.append(logits[row])
                step = len(r.tokens)
                if forced is None and eos is not None and tok in eos:
                    r.stopped_by_eos = True
                    runner.release(sid)
                elif step >= _limit(forced, i, max_new_tokens):
                    runner.release(sid)
                else:
                    nxt[sid] = [tok if forced is None else forced[i][step - 1]]
            batch = nxt
            bar.update()
    finally:
        for sid in list(batch):
            runner.release(sid)
        bar.close()
    return results


def _greedy_dense(runner: DenseRunner, prompts, max_new_tokens, eos, keep_logits, progress, forced=None,
                  pad_id=0):
    b = len(prompts)
    longest = max(len(p) for p in prompts)
    ids = np.full((b, longest), pad_id, np.int64)
    mask = np.zeros((b, longest), np.int64)
    for i, p in enumerate(prompts):  # left padding
        ids[i, longest - len(p):] = p
        mask[i, longest - len(p):] = 1
    results = [Generation([], False, [] if keep_logits else None) for _ in prompts]
    done = np.zeros(b, bool)
    past = None
    step_ids = ids
    bar = _Progress(max_new_tokens, "generate", progress)
    for _ in range(max_new_tokens):
        logits, present = runner.run(step_ids if runner.past else ids, mask, past)
        last = logits[:, -1, :].astype(np.float32)
        nxt = np.argmax(last, axis=-1)
        for i in range(b):
            if done[i]:
                continue
            tok = int(nxt[i])
            results[i].tokens.append(tok)
            if keep_logits:
                results[i].logits.append(last[i])
            if forced is not None:
                nxt[i] = forced[i][len(results[i].tokens) - 1] if len(results[i].tokens) <= len(forced[i]) else pad_id
            if forced is None and eos is not None and tok in eos:
                results[i].stopped_by_eos = True
                done[i] = True
            elif len(results[i].tokens) >= _limit(forced, i, max_new_tokens):
                done[i] = True
        bar.update()
        if done.all():
            break
        # finished rows keep running on a pad token (their outputs are ignored)
        new_tok = np.where(done, pad_id, nxt)[:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones((b, 1), np.int64)], axis=1)
        ids = np.concatenate([ids, new_tok], axis=1)
        step_ids, past = new_tok, present
    bar.close()
    return results


def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 32,
             eos_token_id: int | Iterable[int] | None = None, num_blocks: int | None = None,
             return_logits: bool = False, providers: Sequence[str] = ("CPUExecutionProvider",),
             with_library: bool | None = None, progress: bool | None = False,
             intra_op_threads: int | None = None, forced_tokens: Sequence[Sequence[int]] | None = None
             ) -> list[Generation]:
    """Greedy decoding of a batch of prompts of different lengths.

    A paged model (``ort-ops rewrite`` output) runs on the paged KV cache: all prompts are
    prefilled in one packed step, then each step decodes one token per unfinished sequence, and a
    finished sequence's blocks go back to the pool at once. Any other decoder runs on left-padded
    batches (past/present fed back when it has them).

    Args:
        model: path, bytes or ModelProto.
        prompts: token id lists (at least one token each).
        max_new_tokens: stop after this many new tokens.
        eos_token_id: stop a sequence when it emits this token (or any of these).
        num_blocks: paged cache size (default: enough for every prompt plus max_new_tokens).
        return_logits: keep each step's logits [V] in the results.
        with_library: register the ort-ops library (default: when the model uses its domain).
        progress: a progress bar on stderr (None: when stderr is a terminal).
        forced_tokens: teacher forcing: per prompt, the tokens to feed after each step instead of
            the model's own choice (e.g. another model's output); the model's argmax is still
            what ``tokens`` records, no EOS stop, and it runs len(forced_tokens[i]) steps.

    Returns:
        One Generation per prompt: new tokens (the EOS included when it stopped on it),
        stopped_by_eos, logits [steps, V] if asked.
    """
    proto = _load_proto(model)
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("ort_ops.generate: every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"ort_ops.generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    if forced_tokens is not None:
        forced_tokens = [list(map(int, f)) for f in forced_tokens]
        if len(forced_tokens) != len(prompts) or any(len(f) == 0 for f in forced_tokens):
            raise ValueError("ort_ops.generate: forced_tokens needs one non-empty list per prompt")
        max_new_tokens = max(len(f) for f in forced_tokens)
    eos = None if eos_token_id is None else set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
    meta = paged_metadata(proto)
    if meta is not None:
        bs = meta["block_size"]
        need = sum(-(-(len(p) + max_new_tokens) // bs) for p in prompts)
        runner = PagedRunner(proto, num_blocks=num_blocks or need, providers=providers,
                             intra_op_threads=intra_op_threads)
        results = _greedy_paged(runner, prompts, max_new_tokens, eos, return_logits, progress, forced_tokens)
    else:
        from ort_ops._domain import DOMAIN

        uses_lib = any(o.domain == DOMAIN for o in proto.opset_import)
        runner = DenseRunner(proto, providers=providers, intra_op_threads=intra_op_threads,
                             with_library=uses_lib if with_library is None else with_library)
        if any(n.op_type == "GroupQueryAttention" for n in proto.graph.node):
            # ORT's GroupQueryAttention reads padding from seqlens_k as right padding; this loop
            # pads on the left, so such a model decodes one prompt at a time (no padding at all).
            results = []
            for i, p in enumerate(prompts):
                f = None if forced_tokens is None else [forced_tokens[i]]
                results += _greedy_dense(runner, [p], max_new_tokens, eos, return_logits, progress, f)
        else:
            results = _greedy_dense(runner, prompts, max_new_tokens, eos, return_logits, progress, forced_tokens)
    for r in results:
        if return_logits:
            r.logits = np.stack(r.logits) if r.logits else np.zeros((0, 0), np.float32)
    return results
