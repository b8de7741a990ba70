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
    tokens_S = runner.step_greedy({seq_id: [token], ...})     # the same step, greedy token ids back
    out = generate(model, prompts, max_new_tokens=32, eos_token_id=2)

On ``device="cuda"`` (ORT's CUDA execution provider) every layer's caches are OrtValues that ORT
allocated on the GPU, bound once as input and output of the same name (in place); each step
builds the step tables on the host and copies each to the GPU once (one OrtValue per table,
read by every layer), and only the logits come back, or, for ``step_greedy``, only the greedy
token ids (the model's ``next_token`` output; the logits stay on the device).
``cache_on_device=True`` runs that same binding path on the CPU EP (OrtValues in host memory),
which is how the tests exercise it.

Models that are not paged (an original export, or a prefill-only rewrite) run through
``DenseRunner``: left-padded batches, attention_mask and position_ids, past/present fed back when
the model has them, the whole sequence recomputed when it has not.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Iterable, Sequence

import numpy as np

from ort_ops.paged_interface import (  # noqa: E402 - the contract with the rewrite
    BLOCK_TABLES, CU_SEQLENS_Q, PAGED_META_KEY, SEQ_LENS, SLOT_MAPPING, cache_shapes, read_metadata)


def _load_proto(model, load_external_data: bool = True):
    """A ModelProto from a path, serialized bytes or a ModelProto. ``load_external_data=False``
    reads only the graph (enough for metadata and node types; a multi-GB model's weights stay on
    disk for the session to map)."""
    import onnx

    if isinstance(model, (str, bytes)) and not (isinstance(model, bytes) and len(model) > 4096):
        path = model.decode() if isinstance(model, bytes) else model
        try:
            return onnx.load(path, load_external_data=load_external_data)
        except FileNotFoundError:
            raise FileNotFoundError(f"ort_ops.runtime: model file '{path}' not found") from None
        except Exception as e:  # noqa: BLE001 - one clear line for the CLI
            raise ValueError(f"ort_ops.runtime: '{path}' is not a readable ONNX model ({str(e).splitlines()[0]})") from None
    if isinstance(model, bytes):
        return onnx.load_from_string(model)
    return model


def paged_metadata(model) -> dict | None:
    """The paged interface description of a model (path, bytes or ModelProto), None if not paged."""
    return read_metadata(_load_proto(model, load_external_data=False))


# --- devices ------------------------------------------------------------------------------------

DEVICES = ("cpu", "cuda")
_CUDA_EP = "CUDAExecutionProvider"


def _provider_name(p) -> str:
    return p if isinstance(p, str) else p[0]  # onnxruntime also takes (name, options) pairs


def resolve_device(device: str | None = None, providers: Sequence | None = None) -> tuple[str, list]:
    """The device ("cpu" | "cuda") and the onnxruntime providers of the runtime's sessions.

    Either may be given: ``device="cuda"`` means providers [CUDA, CPU] (the CPU EP takes the
    nodes CUDA has no kernel for), ``device="cpu"`` [CPU]; a providers list that names the CUDA EP
    means "cuda". Nothing given: "cpu".

    Raises:
        ValueError: an unknown device, providers that contradict the device, or "cuda" when
            this onnxruntime has no CUDA execution provider (one line naming what is missing).
    """
    import onnxruntime as ort

    if device is not None and device not in DEVICES:
        raise ValueError(f"ort_ops.runtime: device must be one of {', '.join(DEVICES)}, got {device!r}")
    if providers is not None:
        providers = list(providers)
        names = [_provider_name(p) for p in providers]
        if not names:
            raise ValueError("ort_ops.runtime: providers must name at least one execution provider")
        implied = "cuda" if _CUDA_EP in names else "cpu"
        if device is not None and device != implied:
            raise ValueError(f"ort_ops.runtime: device {device!r} contradicts providers {names}"
                             + (f" (device 'cuda' needs {_CUDA_EP} among them)" if device == "cuda" else ""))
        device = implied
    else:
        device = device or "cpu"
        providers = [_CUDA_EP, "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    if device == "cuda" and _CUDA_EP not in ort.get_available_providers():
        raise ValueError(f"ort_ops.runtime: device 'cuda' needs onnxruntime with the {_CUDA_EP} "
                         f"(onnxruntime-gpu); onnxruntime {ort.__version__} here offers only "
                         f"{', '.join(ort.get_available_providers())}")
    return device, providers


def _require_cuda_library() -> None:
    """Refuses "cuda" when the ort-ops library has no CUDA kernels (ORT would place our ops on
    the CPU EP and copy every cache both ways each step)."""
    from ort_ops._lib import build_info, get_library_path

    if not build_info().get("cuda"):
        raise ValueError(f"ort_ops.runtime: device 'cuda' needs the ort-ops library built with CUDA "
                         f"(ORT_OPS_USE_CUDA=ON); {get_library_path()} was built without it")


def _check_device_errors() -> None:
    """Raises what a CUDA op found wrong on the device during the last Run (a bad table value),
    through ``ort_ops.check_device_errors`` where the library offers it."""
    import ort_ops

    check = getattr(ort_ops, "check_device_errors", None)
    if check is not None:
        check()


def _zeros_ortvalue(shape, dtype, device: str):
    """An OrtValue that ORT allocated on ``device`` (device 0), zero-filled from the host once."""
    import onnxruntime as ort

    value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, device, 0)
    value.update_inplace(np.zeros(shape, dtype))
    return value


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
    """Per-layer INT8 caches and scales and the block allocator of their blocks.

    ``device=None`` (the default): numpy buffers (``buffers``) that OrtValues wrap without copying.
    ``device="cuda"`` (or "cpu"): OrtValues that ORT allocated on that device (``values``), zeroed
    once; they never leave it. ``layer_arrays(i)`` reads either kind back as numpy.

    ``scratch_blocks`` more blocks follow the ``num_blocks`` the allocator hands out (ids
    num_blocks..): no sequence is given them; the padding rows of PagedRunner's decode buckets
    write there (``scratch``).
    """

    def __init__(self, num_layers: int, layer_dims: Sequence[Sequence[int]], block_size: int,
                 num_blocks: int, *, device: str | None = None, scratch_blocks: int = 0):
        if device is not None and device not in DEVICES:
            raise ValueError(f"ort_ops.runtime: cache device must be one of {', '.join(DEVICES)}, got {device!r}")
        if device == "cuda":
            resolve_device(device)  # the one-line refusal where onnxruntime has no CUDA EP
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        if scratch_blocks < 0:
            raise ValueError(f"ort_ops.runtime: scratch_blocks must be >= 0, got {scratch_blocks}")
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.scratch = list(range(num_blocks, num_blocks + scratch_blocks))
        self.buffers: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.values: list = []  # per layer [key, value, key_scale, value_scale] OrtValues (device set)
        self._nbytes = 0
        for i in range(num_layers):
            hkv, d = layer_dims[i]
            specs = cache_shapes(num_blocks + scratch_blocks, hkv, block_size, d)
            self._nbytes += sum(int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt in specs)
            if device is None:
                self.buffers.append(tuple(np.zeros(shape, dt) for shape, dt in specs))
            else:
                self.values.append([_zeros_ortvalue(shape, dt, device) for shape, dt in specs])

    @classmethod
    def for_model(cls, model, num_blocks: int = 256, *, device: str | None = None,
                  scratch_blocks: int | None = None) -> PagedKVCache:
        """A cache for a paged model; ``scratch_blocks`` None: the decode buckets' on "cuda"
        (``graph_scratch_blocks``), none elsewhere."""
        meta = paged_metadata(model)
        if meta is None:
            raise ValueError(f"ort_ops.runtime: the model is not paged (no '{PAGED_META_KEY}' metadata); "
                             "rewrite it with `ort-ops rewrite` first")
        if scratch_blocks is None:
            scratch_blocks = graph_scratch_blocks(meta["block_size"]) if device == "cuda" else 0
        return cls(meta["num_layers"], meta["layer_dims"], meta["block_size"], num_blocks, device=device,
                   scratch_blocks=scratch_blocks)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def layer_arrays(self, layer: int) -> list[np.ndarray]:
        """Layer ``layer``'s key, value, key_scale, value_scale as numpy (a copy from a GPU)."""
        if self.device is None:
            return list(self.buffers[layer])
        return [v.numpy() for v in self.values[layer]]


# --- runners -----------------------------------------------------------------------------------


def _session(model, providers: Sequence, with_library: bool, intra_op_threads: int | None):
    """An InferenceSession of a path (read by ORT itself, external weights included: a model past
    protobuf's 2 GB cannot be serialized), serialized bytes or a ModelProto."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if intra_op_threads is not None:
        so.intra_op_num_threads = intra_op_threads
    if with_library:
        from ort_ops._lib import session_options

        session_options(so)
    if isinstance(model, str):
        source = model
    elif isinstance(model, bytes):
        source = model
    else:
        source = model.SerializeToString()
    return ort.InferenceSession(source, so, providers=list(providers))


# Decode bucket sizes (sequences in a captured step) of PagedRunner's CUDA graphs.
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


# Block-table widths of decode buckets: powers of two up to this many tokens a sequence, then
# multiples of it. A bucket's kernels are sized from its width (the attention grid covers width x
# block size tokens, the splits past a sequence's length exit at once), so the rounding bounds the
# idle part of the grid (below 2x, then below 1024 tokens), and a growing context gets a new
# bucket (two ordinary Runs, then the capture) every 1024 tokens at most.
_WIDTH_STEP_TOKENS = 1024


def _bucket_width(width: int, block_size: int) -> int:
    """The block-table width of the bucket that takes tables ``width`` blocks wide."""
    tokens = width * block_size
    if tokens <= _WIDTH_STEP_TOKENS:
        rounded = 1 << max(tokens - 1, 0).bit_length()
    else:
        rounded = -(-tokens // _WIDTH_STEP_TOKENS) * _WIDTH_STEP_TOKENS
    return max(width, -(-rounded // block_size))


def graph_scratch_blocks(block_size: int, max_batch: int = GRAPH_BATCH_SIZES[-1]) -> int:
    """Cache blocks the padding rows of decode buckets up to ``max_batch`` sequences write to
    (one slot each, max_batch - 1 rows at most)."""
    return -(-(max_batch - 1) // block_size)


def _with_cuda_graph(providers: Sequence) -> list:
    """``providers`` with ORT's CUDA graph capture turned on in the CUDA EP's options."""
    out = []
    for p in providers:
        if _provider_name(p) == _CUDA_EP:
            opts = dict(p[1]) if not isinstance(p, str) and len(p) > 1 else {}
            opts["enable_cuda_graph"] = "1"
            out.append((_CUDA_EP, opts))
        else:
            out.append(p)
    return out


@dataclasses.dataclass
class _DecodeBucket:
    """A fixed-shape decode step: ``size`` sequences, block tables ``width`` wide; its binding
    (caches, tables, logits and greedy tokens: device OrtValues bound once) and the run options
    naming its graph. ``tokens`` is None for a model without the next_token output."""
    size: int
    width: int
    io: object
    tables: dict
    logits: object
    tokens: object
    run: object


class PagedRunner:
    """Runs a paged model step by step over a PagedKVCache, caches bound in place.

    Two binding paths, the same graph and the same results: a numpy cache (``device="cpu"``, the
    default) is wrapped per step and the tables are bound as numpy arrays; a device cache (the
    default on ``device="cuda"``, or ``cache_on_device=True``) stays bound in one IOBinding for
    the runner's life, and each step binds only the tables (one device OrtValue each) and the
    logits (returned to host memory). ``step_greedy`` runs the same step and returns the greedy
    token of each sequence: the model's ``next_token`` output (ArgMax over the vocabulary, on the
    device) is what comes back, the logits stay where ORT computed them.

    On "cuda", decode steps also run as CUDA graphs (``cuda_graph``): each bucket of sequence
    count and block-table width has its own binding of fixed-shape device tables and logits;
    a step writes its tables into them in place and ORT replays the bucket's captured graph,
    so the host launches one graph instead of every node of the model.
    """

    def __init__(self, model, cache: PagedKVCache | None = None, *, num_blocks: int = 256,
                 providers: Sequence | None = None, device: str | None = None,
                 cache_on_device: bool | None = None, intra_op_threads: int | None = None,
                 cuda_graph: bool | None = None, graph_batch_sizes: Sequence[int] = GRAPH_BATCH_SIZES):
        """
        Args:
            model: path (preferred for large models: ORT maps the weights itself), bytes or
                ModelProto of a paged model.
            cache: the cache to run on (default: a new one of ``num_blocks`` blocks on the device).
            providers / device: see ``resolve_device``; default the CPU EP.
            cache_on_device: keep the cache in OrtValues allocated by ORT on the device and bind
                it once (default: on "cuda" only; True on "cpu" runs the CUDA path's bindings on
                the CPU EP).
            cuda_graph: run decode steps (one new token per sequence, at most
                max(graph_batch_sizes) sequences) as fixed-shape buckets that ORT captures as CUDA
                graphs and replays (default: on "cuda"). Where ORT refuses to capture the model,
                the runner runs without graphs and says why in ``graph_note``. True with a device
                cache on "cpu" runs the same fixed-shape buckets on the CPU EP, uncaptured.
            graph_batch_sizes: the bucket sizes; a decode step of S sequences runs in the
                smallest bucket >= S, its other rows padding.
        """
        import onnxruntime as ort

        self.device, providers = resolve_device(device, providers)
        on_device = self.device == "cuda" if cache_on_device is None else bool(cache_on_device)
        if cache is not None and cache_on_device is None:
            on_device = cache.device is not None
        if self.device == "cuda" and not on_device:
            raise ValueError("ort_ops.runtime: device 'cuda' runs on a cache that lives on the GPU; "
                             "create it with PagedKVCache.for_model(model, device='cuda') (or pass none)")
        meta = paged_metadata(model)
        if meta is None:
            raise ValueError(f"ort_ops.runtime: the model is not paged (no '{PAGED_META_KEY}' metadata)")
        if self.device == "cuda":
            _require_cuda_library()
        self.meta = meta
        want_graphs = (self.device == "cuda") if cuda_graph is None else bool(cuda_graph)
        self._graph_sizes = sorted({int(b) for b in graph_batch_sizes})
        if want_graphs and (not self._graph_sizes or self._graph_sizes[0] < 1):
            raise ValueError(f"ort_ops.runtime: graph_batch_sizes must be positive, got {list(graph_batch_sizes)}")
        # A cache made here gets the decode buckets' scratch blocks beside its num_blocks; a given
        # cache must have them (PagedKVCache.for_model(..., device="cuda") does), or decode steps
        # run without graphs: taking them from its blocks would shrink what its owner sized.
        scratch_blocks = graph_scratch_blocks(meta["block_size"], self._graph_sizes[-1]) if want_graphs else 0
        self.cache = cache or PagedKVCache(meta["num_layers"], meta["layer_dims"], meta["block_size"],
                                           num_blocks, device=self.device if on_device else None,
                                           scratch_blocks=scratch_blocks)
        if self.cache.block_size != meta["block_size"]:
            raise ValueError(f"ort_ops.runtime: cache block size {self.cache.block_size} != the model's "
                             f"{meta['block_size']}")
        want = self.device if on_device else None
        if self.cache.device != want:
            raise ValueError(f"ort_ops.runtime: the cache lives on {self.cache.device or 'the host (numpy)'} but "
                             f"this runner needs it on {want or 'the host (numpy)'}")
        source = model if isinstance(model, (str, bytes)) else _load_proto(model)
        if want_graphs and not on_device:
            raise ValueError("ort_ops.runtime: cuda_graph runs on a cache that lives on the device "
                             "(cache_on_device=True)")
        self.graph_note = "" if want_graphs else "off"
        self.session = None
        if want_graphs and self.device == "cuda":
            try:
                self.session = _session(source, _with_cuda_graph(providers), True, intra_op_threads)
            except Exception as e:  # noqa: BLE001 - ORT refuses capture for some partitions: run without
                if "graph" not in str(e).lower():
                    raise
                want_graphs = False
                self.graph_note = f"ORT refused CUDA graphs for this model: {str(e).splitlines()[0][:300]}"
        if self.session is None:
            self.session = _session(source, providers, True, intra_op_threads)
        self._float = {i.name: i.type for i in self.session.get_inputs()}
        self.logits_name = meta["logits"] or self.session.get_outputs()[0].name
        # The greedy token output, where the model has it (paged models written before it have
        # not: step_greedy then takes the argmax of step's logits on the host).
        outputs = {o.name for o in self.session.get_outputs()}
        self.token_name = meta.get("next_token") if meta.get("next_token") in outputs else None
        self._cache_values = []
        self._io = None
        if self.cache.device is None:
            for layer in self.cache.buffers:
                self._cache_values.append([ort.OrtValue.ortvalue_from_numpy(a) for a in layer])
        else:
            # One binding for the runner's life: each cache is input and output at once (the op
            # writes only the new slots), so a step rebinds only the tables and the logits.
            self._io = self.session.io_binding()
            for layer, (ins, outs) in enumerate(zip(meta["cache_inputs"], meta["cache_outputs"])):
                for name_in, name_out, ov in zip(ins, outs, self.cache.values[layer]):
                    self._io.bind_ortvalue_input(name_in, ov)
                    self._io.bind_ortvalue_output(name_out, ov)
            # The logits, then the tokens: the last outputs of the binding, in this order for
            # its life (binding a name again replaces its value in place).
            self._io.bind_output(self.logits_name, self.cache.device)
            if self.token_name is not None:
                self._io.bind_output(self.token_name, self.cache.device)
            self._step_values: list = []  # the bound tables, alive until the next step rebinds them
        self._plain_run = None
        self._buckets: dict = {}  # (sequences, block-table width) -> _DecodeBucket
        self.graph_steps = 0  # steps that ran in a bucket (captured or replayed on "cuda")
        if want_graphs:
            pad_rows = self._graph_sizes[-1] - 1
            if len(self.cache.scratch) < scratch_blocks:
                want_graphs = False
                self.graph_note = (f"the cache has {len(self.cache.scratch)} scratch block(s), the decode buckets' "
                                   f"padding rows need {scratch_blocks} (PagedKVCache(..., scratch_blocks=N))")
            else:
                bs = self.cache.block_size
                self._pad_slots = np.asarray([b * bs + o for b in self.cache.scratch for o in range(bs)][:pad_rows],
                                             np.int64)
        self.cuda_graph = want_graphs
        if self.device == "cuda" and want_graphs:
            import onnxruntime as ort

            # Prefill and mixed steps: ordinary Runs of the same session (graph id -1: neither
            # captured nor replayed).
            self._plain_run = ort.RunOptions()
            self._plain_run.add_run_config_entry("gpu_graph_id", "-1")

    def _tables(self, batch: dict):
        """The step tables of ``batch`` (name -> host array, in binding order), the context
        lengths after the step and cu_seqlens_q.

        Only the block reservations loop over sequences; the tables are computed for all tokens
        at once, because at 32 decoding sequences numpy's per-call cost in a per-sequence loop
        was most of a GPU step's time.
        """
        alloc = self.cache.allocator
        bs = alloc.block_size
        toks_list, starts, counts = [], [], []
        for seq_id, toks in batch.items():
            toks = toks.reshape(-1) if isinstance(toks, np.ndarray) else toks
            if len(toks) == 0:
                raise ValueError(f"ort_ops.runtime: sequence {seq_id!r} has no new tokens")
            toks_list.append(toks)
            starts.append(alloc.lengths.get(seq_id, 0))
            counts.append(len(toks))
        # All or nothing: a step that does not fit leaves every sequence's blocks as they were.
        alloc.reserve_all({seq_id: start + n for seq_id, start, n in zip(batch, starts, counts)})
        tables = [alloc.tables[seq_id] for seq_id in batch]
        n_seq = len(counts)
        counts_S = np.asarray(counts, np.int64)
        starts_S = np.asarray(starts, np.int64)
        cu = np.zeros(n_seq + 1, np.int32)
        np.cumsum(counts_S, out=cu[1:])
        seq_T = np.repeat(np.arange(n_seq), counts_S)           # sequence of each packed token
        pos_T = np.arange(int(cu[-1])) - np.repeat(cu[:-1] - starts_S, counts_S)  # its position
        widths = np.asarray([len(t) for t in tables])
        # Unused table entries hold block 0: a valid block the op never reads (past seq_lens).
        bt = np.zeros((n_seq, int(widths.max())), np.int32)
        bt[np.arange(bt.shape[1])[None, :] < widths[:, None]] = np.fromiter(
            itertools.chain.from_iterable(tables), np.int32, count=int(widths.sum()))
        slots_T = bt[seq_T, pos_T // bs].astype(np.int64) * bs + pos_T % bs
        lens = starts_S + counts_S
        named = {
            self.meta["input_ids"]: np.fromiter(itertools.chain.from_iterable(toks_list), np.int64)[None, :],
            self.meta["position_ids"]: pos_T[None, :].astype(np.int64),
            SLOT_MAPPING: slots_T,
            BLOCK_TABLES: bt,
            SEQ_LENS: lens.astype(np.int32),
            CU_SEQLENS_Q: cu,
        }
        return named, lens.tolist(), cu.tolist()

    def step(self, batch: dict) -> np.ndarray:
        """Runs the new tokens of several sequences in one packed step.

        Args:
            batch: {seq_id: new token ids (list/array)}; a sequence seen for the first time is a
                prefill, later ones continue from its cached length (decode or chunked prefill).

        Returns:
            float32 [S, V]: the logits of each sequence's last new token, in ``batch`` order.
        """
        return self._step(batch, greedy=False)

    def step_greedy(self, batch: dict) -> np.ndarray:
        """``step``, returning the greedy next token of each sequence instead of its logits.

        With the model's ``next_token`` output the ArgMax runs in the graph, on the step's device,
        and only the S token ids come back (the logits stay on the device). A model without it
        (rewritten before the output existed) gives the argmax of ``step``'s logits, taken here.
        Either way a tie goes to the first maximal index, as np.argmax.

        Args:
            batch: as ``step``.

        Returns:
            int64 [S]: the token id with the largest logit after each sequence's last new token,
            in ``batch`` order.
        """
        if self.token_name is None:
            return np.argmax(self.step(batch), axis=-1).astype(np.int64)
        return self._step(batch, greedy=True)

    def _step(self, batch: dict, greedy: bool) -> np.ndarray:
        """One step of ``batch``: the rows of its last tokens, logits float32 [S, V] or
        (``greedy``) next tokens int64 [S]."""
        alloc = self.cache.allocator
        named, lens, cu = self._tables(batch)
        out = None
        if self.cuda_graph and len(lens) == cu[-1] and len(lens) <= self._graph_sizes[-1]:
            out = self._run_bucket(named, greedy)  # a decode step: one new token per sequence
        if out is None:
            out = self._run_host(named, greedy) if self._io is None else self._run_device(named, greedy)
        for seq_id, n in zip(batch, lens):
            alloc.lengths[seq_id] = n
        # One row per sequence ("last": lm_head already saw only the last tokens) or per packed
        # token ("all": the last token of sequence s is row cu[s+1] - 1).
        rows = out.reshape(-1) if greedy else out.reshape(-1, out.shape[-1])
        if self.meta.get("logits_rows") != "last":
            rows = rows[np.asarray(cu[1:]) - 1]
        return rows.astype(np.int64 if greedy else np.float32)

    def _run_host(self, named: dict, greedy: bool = False) -> np.ndarray:
        io = self.session.io_binding()
        for name, arr in named.items():
            io.bind_cpu_input(name, arr)
        for layer, (ins, outs) in enumerate(zip(self.meta["cache_inputs"], self.meta["cache_outputs"])):
            for name_in, name_out, ov in zip(ins, outs, self._cache_values[layer]):
                io.bind_ortvalue_input(name_in, ov)
                io.bind_ortvalue_output(name_out, ov)  # in place: the op writes only new slots
        # The numpy cache runs on the CPU EP: every output is in host memory already.
        io.bind_output(self.token_name if greedy else self.logits_name)
        self.session.run_with_iobinding(io)
        return io.get_outputs()[-1].numpy()  # the caches stay where they are: no copy

    def _run_device(self, named: dict, greedy: bool = False) -> np.ndarray:
        import onnxruntime as ort

        io = self._io
        # Each table reaches the device once per step, one OrtValue that every layer reads.
        self._step_values = [ort.OrtValue.ortvalue_from_numpy(arr, self.cache.device, 0) for arr in named.values()]
        for name, ov in zip(named, self._step_values):
            io.bind_ortvalue_input(name, ov)
        # Rebinding by name replaces last step's values (whose shapes differ) with empty ones that
        # ORT allocates: what the step returns in host memory, the other on the device, so only
        # the logits or only the tokens come back.
        io.bind_output(self.logits_name, self.cache.device if greedy else "cpu")
        if self.token_name is not None:
            io.bind_output(self.token_name, "cpu" if greedy else self.cache.device)
        self._run_checked(io, self._plain_run)
        outs = io.get_outputs()
        return (outs[-1] if greedy else outs[-2 if self.token_name is not None else -1]).numpy()

    def _run_checked(self, io, run_options) -> None:
        """One Run, then what a CUDA op found wrong on the device (a bad table value) as the op's
        one-line ValueError. An op that finds an earlier launch's report at its next Compute
        fails the Run itself; that failure is raised the same way."""
        try:
            self.session.run_with_iobinding(io, run_options)
        except RuntimeError as e:
            if self.device == "cuda":
                _check_device_errors()
                if "found on the device" in str(e):
                    raise ValueError(str(e).split("Status Message: ", 1)[-1].strip()) from None
            raise
        if self.device == "cuda":
            _check_device_errors()

    # --- decode buckets (CUDA graphs) ---

    def _logits_spec(self):
        """(rank, vocabulary, numpy dtype) of the logits output; vocabulary None when symbolic."""
        out = next(o for o in self.session.get_outputs() if o.name == self.logits_name)
        vocab = out.shape[-1] if isinstance(out.shape[-1], int) else None
        return len(out.shape), vocab, _ort_np_dtype(out.type)

    def _bucket(self, size: int, width: int):
        """The bucket of ``size`` sequences and block tables ``width`` wide, made on first use: an
        IOBinding of its own with the caches and fixed-shape device OrtValues for the tables and
        the logits (and the greedy tokens), bound once (replays read and write those addresses),
        and the run options that name its graph. None when the logits' vocabulary is symbolic
        (no fixed shape)."""
        import onnxruntime as ort

        key = (size, width)
        if key in self._buckets:
            return self._buckets[key]
        rank, vocab, dtype = self._logits_spec()
        if vocab is None:
            return None
        dev = self.cache.device
        io = self.session.io_binding()
        for layer, (ins, outs) in enumerate(zip(self.meta["cache_inputs"], self.meta["cache_outputs"])):
            for name_in, name_out, ov in zip(ins, outs, self.cache.values[layer]):
                io.bind_ortvalue_input(name_in, ov)
                io.bind_ortvalue_output(name_out, ov)
        specs = {self.meta["input_ids"]: ((1, size), np.int64), self.meta["position_ids"]: ((1, size), np.int64),
                 SLOT_MAPPING: ((size,), np.int64), BLOCK_TABLES: ((size, width), np.int32),
                 SEQ_LENS: ((size,), np.int32), CU_SEQLENS_Q: ((size + 1,), np.int32)}
        tables = {}
        for name, (shape, dt) in specs.items():
            tables[name] = _zeros_ortvalue(shape, dt, dev)
            io.bind_ortvalue_input(name, tables[name])
        # Every sequence of a bucket step has one new token: row s is sequence s.
        tables[CU_SEQLENS_Q].update_inplace(np.arange(size + 1, dtype=np.int32))
        logits = _zeros_ortvalue((1, size, vocab) if rank == 3 else (size, vocab), dtype, dev)
        io.bind_ortvalue_output(self.logits_name, logits)
        # The greedy tokens beside the logits: every replay writes both, a greedy step copies
        # back only these (S int64), a logits step only the logits.
        tokens = None
        if self.token_name is not None:
            tokens = _zeros_ortvalue((1, size) if rank == 3 else (size,), np.int64, dev)
            io.bind_ortvalue_output(self.token_name, tokens)
        run = ort.RunOptions()
        if self.device == "cuda":
            run.add_run_config_entry("gpu_graph_id", str(len(self._buckets) + 1))
        bucket = _DecodeBucket(size, width, io, tables, logits, tokens, run)
        self._buckets[key] = bucket
        return bucket

    def _run_bucket(self, named: dict, greedy: bool = False):
        """A decode step (one new token per sequence) in its fixed-shape bucket: the step's tables
        padded to the bucket's rows and width, written into the bound device values in place, and
        one Run, which ORT captures on the bucket's first Runs and replays after. Padding rows
        are one-token sequences at position 0, each writing its own slot of the scratch blocks
        that no sequence is given (repeated slots are refused) and reading only it. Returns the
        real rows' logits [S, V] (``greedy``: their tokens [S]), or None where no bucket applies."""
        n = named[SEQ_LENS].shape[0]
        width = named[BLOCK_TABLES].shape[1]
        size = next(b for b in self._graph_sizes if b >= n)
        bucket = self._bucket(size, _bucket_width(width, self.cache.allocator.block_size))
        if bucket is None:
            return None
        pad = self._pad_slots[:size - n]
        bs = self.cache.allocator.block_size
        ids = np.zeros((1, size), np.int64)
        ids[0, :n] = named[self.meta["input_ids"]][0]
        pos = np.zeros((1, size), np.int64)
        pos[0, :n] = named[self.meta["position_ids"]][0]
        slots = np.concatenate([named[SLOT_MAPPING], pad])
        bt = np.zeros((size, bucket.width), np.int32)
        bt[:n, :width] = named[BLOCK_TABLES]
        bt[n:, 0] = pad // bs
        lens = np.ones(size, np.int32)
        lens[:n] = named[SEQ_LENS]
        for name, arr in ((self.meta["input_ids"], ids), (self.meta["position_ids"], pos), (SLOT_MAPPING, slots),
                          (BLOCK_TABLES, bt), (SEQ_LENS, lens)):
            bucket.tables[name].update_inplace(arr)
        self._run_checked(bucket.io, bucket.run)
        self.graph_steps += 1
        if greedy:
            return bucket.tokens.numpy().reshape(size)[:n]
        return bucket.logits.numpy().reshape(size, -1)[:n]

    def release(self, seq_id) -> None:
        self.cache.allocator.release(seq_id)


class DenseRunner:
    """Runs an ordinary decoder (past/present, or no cache at all) on left-padded batches: the
    reference the paged model is compared with, and the runner of prefill-only rewrites.

    ``past_on_device`` (default: on "cuda") binds the present outputs where the session runs and
    feeds them back as the next past without a trip through host memory (IOBinding); only the
    logits come back. Otherwise ``session.run`` with numpy past and present, as on the CPU.
    """

    def __init__(self, model, *, providers: Sequence | None = None, with_library: bool = False,
                 intra_op_threads: int | None = None, past_on_device: bool | None = None):
        self.device, providers = resolve_device(None, providers)
        self.past_on_device = self.device == "cuda" if past_on_device is None else bool(past_on_device)
        self.session = _session(model if isinstance(model, str) else _load_proto(model), providers, with_library,
                                intra_op_threads)
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
            if self.past_on_device:
                return self._run_bound(feeds)
        outs = self.session.run(None, feeds)
        return outs[0], outs[1:] if self.past else None

    def _run_bound(self, feeds: dict):
        """One Run with the presents left on the device (OrtValues the next step binds as past)."""
        io = self.session.io_binding()
        for name, value in feeds.items():
            if isinstance(value, np.ndarray):
                io.bind_cpu_input(name, value)
            else:
                io.bind_ortvalue_input(name, value)
        io.bind_output(self.logits_name, "cpu")
        for name in self.present:
            io.bind_output(name, self.device)
        self.session.run_with_iobinding(io)
        outs = io.get_outputs()
        return outs[0].numpy(), list(outs[1:])


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


def _schedule(pending: dict, max_step_tokens: int | None) -> dict:
    """The next step's batch {seq id: tokens}: every pending token when unbounded; otherwise the
    decoding sequences first (one token each, so prefill never stalls them), then prompt chunks
    in arrival order until ``max_step_tokens`` is used (chunked prefill)."""
    if max_step_tokens is None:
        return {sid: toks for sid, (_, toks) in pending.items()}
    batch, room = {}, max_step_tokens
    for sid, (_, toks) in pending.items():
        if len(toks) == 1 and room > 0:
            batch[sid], room = toks, room - 1
    for sid, (_, toks) in pending.items():
        if len(toks) > 1 and room > 0:
            batch[sid] = toks[:room]
            room -= len(batch[sid])
    return batch


def _greedy_paged(runner: PagedRunner, prompts, max_new_tokens, eos, keep_logits, progress, forced=None,
                  max_step_tokens=None):
    # pending: seq id -> (prompt index, tokens not yet run): the prompt (or what of it a chunked
    # prefill has not run yet), then the one token each decode step feeds back.
    pending = {f"seq{i}": (i, list(p)) for i, p in enumerate(prompts)}
    results = [Generation([], False, [] if keep_logits else None) for _ in prompts]
    bar = _Progress(sum(_limit(forced, i, max_new_tokens) for i in range(len(prompts))), "generate", progress)
    try:
        while pending:
            batch = _schedule(pending, max_step_tokens)
            # Without logits to keep, the step brings back only each sequence's greedy token.
            out = runner.step(batch) if keep_logits else runner.step_greedy(batch)
            for row, (sid, toks) in enumerate(batch.items()):
                i, todo = pending[sid]
                if len(todo) > len(toks):  # a prompt chunk: its logits predict nothing yet
                    pending[sid] = (i, todo[len(toks):])
                    continue
                tok = int(np.argmax(out[row])) if keep_logits else int(out[row])
                r = results[i]
                r.tokens.append(tok)
                if keep_logits:
                    r.logits.append(out[row])
                step = len(r.tokens)
                bar.update()
                if forced is None and eos is not None and tok in eos:
                    r.stopped_by_eos = True
                elif step < _limit(forced, i, max_new_tokens):
                    pending[sid] = (i, [tok if forced is None else forced[i][step - 1]])
                    continue
                del pending[sid]
                runner.release(sid)
    finally:
        for sid in list(pending):
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
             return_logits: bool = False, providers: Sequence | None = None, device: str | None = None,
             with_library: bool | None = None, progress: bool | None = False,
             intra_op_threads: int | None = None, forced_tokens: Sequence[Sequence[int]] | None = None,
             max_step_tokens: int | None = None, cache_on_device: bool | None = None,
             cuda_graph: bool | None = None) -> list[Generation]:
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
        providers / device: where to run ("cpu" | "cuda"; see ``resolve_device``); default the
            CPU EP. On "cuda" a paged model's cache lives on the GPU (``PagedRunner``); any other
            model runs ``session.run`` on that EP.
        with_library: register the ort-ops library (default: when the model uses its domain).
        progress: a progress bar on stderr (None: when stderr is a terminal).
        forced_tokens: teacher forcing: per prompt, the tokens to feed after each step instead of
            the model's own choice (e.g. another model's output); the model's argmax is still
            what ``tokens`` records, no EOS stop, and it runs len(forced_tokens[i]) steps.
        max_step_tokens: paged models: at most this many tokens in one step; longer prompts are
            prefilled in chunks while finished prefills already decode (None: every prompt in
            the first step).
        cache_on_device: keep the KV cache on the device between steps (default: on "cuda"
            only): a paged model's as ``PagedRunner`` does, a past/present model's presents
            bound on the device and fed back as past (``DenseRunner``).
        cuda_graph: paged models on "cuda": decode steps as CUDA graphs (``PagedRunner``;
            default on).

    Returns:
        One Generation per prompt: new tokens (the EOS included when it stopped on it),
        stopped_by_eos, logits [steps, V] if asked.
    """
    proto = _load_proto(model, load_external_data=False)  # graph only: the session reads the weights
    source = model if isinstance(model, str) else _load_proto(model)
    device, providers = resolve_device(device, providers)
    if max_step_tokens is not None and max_step_tokens < 1:
        raise ValueError(f"ort_ops.generate: max_step_tokens must be >= 1, got {max_step_tokens}")
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
        runner = PagedRunner(source, num_blocks=num_blocks or need, providers=providers,
                             cache_on_device=cache_on_device, intra_op_threads=intra_op_threads,
                             cuda_graph=cuda_graph)
        results = _greedy_paged(runner, prompts, max_new_tokens, eos, return_logits, progress, forced_tokens,
                                max_step_tokens)
    else:
        from ort_ops._domain import DOMAIN

        uses_lib = any(o.domain == DOMAIN for o in proto.opset_import)
        with_library = uses_lib if with_library is None else with_library
        if with_library and device == "cuda":
            _require_cuda_library()
        runner = DenseRunner(source, providers=providers, intra_op_threads=intra_op_threads,
                             with_library=with_library, past_on_device=cache_on_device)
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
