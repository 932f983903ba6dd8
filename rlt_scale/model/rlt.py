"""The Recurrent Looped Transformer (DESIGN.md section 1).

Data flow for a sample of T tokens::

    tokens --embed--> encoder (causal, all positions at once) --> e_1..e_T
    e --memory projections (G groups, one parallel pass)--> M = (K, V)
    for each segment of positions sharing one feedback vector:
        u = merge(e, s)                       # s: feedback from the state
        z = decoder layers(u; window cache, M_<=t)
        s <- z at a block end                 # carried in DecoderState
    logits = readout(RMSNorm(z))

A *segment* is what can run in parallel: one token for K=1, a block of K
tokens for K>1 (shorter where documents of the batch start mid-block), the
whole chunk for K=0. Running a block's positions together or one at a time
gives the same numbers, because they all read the same feedback.
"""

from __future__ import annotations

import zlib
from functools import partial
from typing import Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlt_scale.config import ModelConfig
from rlt_scale.model.attention import plan_attention
from rlt_scale.model.blocks import DecoderLayer, EncoderBlock, FeedbackMerge, MemoryProjection
from rlt_scale.model.deferred import WeightTape, defers, weight_blocks
from rlt_scale.model.layers import RMSNorm, Rotary, attend, document_positions, visibility
from rlt_scale.model.state import KV, DecoderState
from rlt_scale.model.tp import TensorParallel
from rlt_scale.model.walk import ChunkWalk
from rlt_scale.model.window import MemoryKeys, WindowKeys


class RLT(nn.Module):
    """The model; ``parts`` (optional) names the parts to build, e.g. one pipeline stage's.

    Parts are ``embed``, ``encoder.<i>``, ``memory.<g>``, ``merge``,
    ``decoder.<i>``, ``norm_out`` and ``readout``; a part not built is an
    ``nn.Identity`` in its list, or ``None``. Each part draws its initial
    weights from its own seed (one draw from torch's generator, plus the
    part's name), so a part's weights are the same whichever other parts
    are built: a pipeline stage holds exactly the single-process weights
    without ever materialising the rest of the model.
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, parts: Optional[Callable[[str], bool]] = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.n_local_heads = tp.local(cfg.n_heads, "model.n_heads")
        base_seed = int(torch.randint(0, 2**31 - 1, ()))
        wanted = parts or (lambda name: True)

        def part(name: str, make: Callable[[], nn.Module], absent=None):
            if not wanted(name):
                return absent
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(base_seed + zlib.crc32(name.encode()))
                return make()

        self.embed = part("embed", lambda: tp.vocab_embedding(cfg.vocab_size, cfg.d_model))
        self.encoder = nn.ModuleList(part(f"encoder.{i}", lambda: EncoderBlock(cfg, tp), nn.Identity())
                                     for i in range(cfg.n_enc_layers))
        self.memory = nn.ModuleList(part(f"memory.{g}", lambda: MemoryProjection(cfg, tp), nn.Identity())
                                    for g in range(cfg.memory_groups))
        self.merge = part("merge", lambda: FeedbackMerge(cfg, tp.dtype)) if cfg.feedback_block else None
        self.decoder = nn.ModuleList(
            part(f"decoder.{i}", lambda: DecoderLayer(cfg, tp, self.encoder[i] if cfg.tie_layers else None),
                 nn.Identity())
            for i in range(cfg.n_dec_layers)
        )
        self.norm_out = part("norm_out", lambda: RMSNorm(cfg.d_model, cfg.norm_eps, tp.dtype))
        self.readout = part("readout", lambda: tp.vocab_readout(cfg.d_model, cfg.vocab_size))

    # ------------------------------------------------------------------ parts
    def rotary(self, pos: torch.Tensor) -> Rotary:
        return Rotary.at(pos, self.cfg.head_dim, self.cfg.rope_theta, self.tp.dtype)

    def empty_kv(self, batch: int, device) -> KV:
        return KV.empty(batch, self.n_local_heads, self.cfg.head_dim, self.tp.dtype, device)

    def encode(self, tokens, pos, doc, past: Optional[list[KV]] = None,
               recompute: bool = False) -> tuple[torch.Tensor, list[KV]]:
        """Encoder output ``e`` ``[B, S, d]`` (no final norm) and each layer's keys.

        ``past`` (generation) holds earlier positions' encoder keys; training
        encodes the whole sample at once with ``past=None``.
        """
        return self.encoder_layers(self.embed(tokens), pos, doc, range(len(self.encoder)), past, recompute)

    def encoder_layers(self, x, pos, doc, layers, past: Optional[list[KV]] = None,
                       recompute: bool = False) -> tuple[torch.Tensor, list[KV]]:
        """Encoder layers ``layers`` (indices, in order) over ``x``; a pipeline stage runs its own.

        ``recompute``: keep only each layer's input and rebuild the layer in
        backward (``activation_checkpointing: full``).
        """
        rope = self.rotary(pos)
        # Without a past every layer attends over the same positions: one tiling (one host read) for all.
        plan = None if past else plan_attention(pos, doc, pos, doc, self.cfg.encoder_window or None)
        keys = []
        for i in layers:
            args = (x, rope, pos, doc, past[i] if past else self.empty_kv(x.shape[0], x.device), plan)
            if recompute and torch.is_grad_enabled():
                x, kv = checkpoint(self.encoder[i], *args, use_reentrant=False)
            else:
                x, kv = self.encoder[i](*args)
            keys.append(kv)
        return x, keys

    def build_memory(self, e, pos, doc) -> list[KV]:
        """Memory keys/values of every group for the given positions, in one pass."""
        rope = self.rotary(pos)
        return [group(e, rope, pos, doc) for group in self.memory]

    def initial_feedback(self, batch: int, device) -> torch.Tensor:
        """``s`` before the first position: the learned ``s*`` (zeros without feedback)."""
        if self.merge is not None:
            return self.merge.initial_state.expand(batch, self.cfg.d_model)
        return torch.zeros(batch, self.cfg.d_model, dtype=self.tp.dtype, device=device)

    def initial_state(self, batch: int, device) -> DecoderState:
        return DecoderState(self.initial_feedback(batch, device), [self.empty_kv(batch, device) for _ in self.decoder])

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """Vocabulary(-parallel) logits; position t predicts token t+1."""
        return self.readout(self.norm_out(z))

    def segment_loss(self, z: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of the readout of ``z`` ``[B, S, d]`` over the ``valid`` targets.

        Computed in at least float32 (bf16 logits are widened first).
        """
        logits = self.logits(z)
        loss = self.tp.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets)
        return torch.where(valid, loss, torch.zeros_like(loss)).sum()

    def answer_correct(self, z: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
                       answer_tokens) -> torch.Tensor:
        """How many valid targets are the most likely of ``answer_tokens`` (a task's answers) at ``z``.

        Only the valid rows are read out, and with tensor parallelism their
        vocabulary shards are gathered first.
        """
        logits = self.logits(z[valid])
        if self.tp.size > 1:
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            logits = gather_from_tensor_model_parallel_region(logits)
        return (answer_predictions(logits, answer_tokens) == targets[valid]).sum()

    # ------------------------------------------------------------ the decoder
    def feedback_in(self, e: torch.Tensor, pos: torch.Tensor, carried: torch.Tensor):
        """``(u, feedback)`` of a segment: its input ``u = merge(e, feedback)`` and the feedback it read.

        The carried ``s`` resets to ``s*`` where a row's segment starts a
        document. Without feedback (K=0) ``u`` is ``e`` itself.
        """
        if self.cfg.feedback_block == 0:
            return e, carried
        s_star = self.merge.initial_state.expand_as(carried)
        feedback = torch.where(pos[:, :1] == 0, s_star, carried)
        return self.merge(e, feedback), feedback

    def carry(self, z: torch.Tensor, pos: torch.Tensor, feedback: torch.Tensor) -> torch.Tensor:
        """The ``s`` a segment leaves: its last output where a row's feedback block ends, else unchanged."""
        if self.cfg.feedback_block == 0:
            return feedback
        block_end = ((pos[:, -1:] + 1) % self.cfg.feedback_block) == 0
        return torch.where(block_end, z[:, -1], feedback)

    def decoder_layers(self, z, pos, doc, caches: dict[int, KV], memory: list[KV], layers,
                       rope: Optional[Rotary] = None) -> tuple[torch.Tensor, dict[int, KV]]:
        """Decoder layers ``layers`` over one segment whose keys arrive as separate tensors.

        A pipeline stage's step in the ring, where every segment's caches
        and memory are leaves of their own small graph: each layer's window
        is its cache concatenated with the segment's keys, and its new cache
        the newest ``W-1`` of those. ``memory`` is indexed by group and holds
        the entries up to the segment's end. One process walks whole chunks
        with :meth:`decode` instead, which writes keys in place.
        """
        rope = rope if rope is not None else self.rotary(pos)
        first, cached = memory[self.cfg.memory_group_of(layers[0])], caches[layers[0]]
        cross_mask = visibility(pos, doc, first.pos, first.doc)
        # every layer's cache holds the same positions: one mask serves all
        window_mask = visibility(pos, doc, torch.cat([cached.pos, pos], 1), torch.cat([cached.doc, doc], 1),
                                 self.cfg.window)
        out = {}
        for i in layers:
            keys = []

            def self_attend(q, k, v, cache=caches[i]):
                keys.append(cache.cat(KV(k, v, pos, doc)))
                return attend(q, keys[0].k, keys[0].v, window_mask)

            mem = memory[self.cfg.memory_group_of(i)]
            z = self.decoder[i](z, rope, self_attend, lambda q, mem=mem: attend(q, mem.k, mem.v, cross_mask))
            out[i] = keys[0].last(self.cfg.window - 1)
        return z, out

    def decode(self, e, pos, doc, memory: list[KV], state: DecoderState, offset: int = 0,
               segments: Optional[list[tuple[int, int]]] = None):
        """Walk the decoder over a chunk ``e`` ``[B, S, d]`` carrying ``state``.

        ``segments`` are the chunk's ``[a, b)`` cuts (relative to it, from the
        batch's segment plan); by default :func:`feedback_segments` of ``pos``.
        ``memory`` holds entries for absolute positions ``0..``; the segment
        ``[a, b)`` of this chunk reads entries ``< offset + b`` (the mask hides
        the rest of the future and other documents).

        Every layer writes its keys in place into one store for the chunk
        (:mod:`rlt_scale.model.window`), so what backward keeps grows with
        the chunk, not with the window, and no per-position slice of ``e`` or
        of the memory costs a full-length gradient. With ``model.decoder_step=fused``
        the chunk runs instead as one :class:`~rlt_scale.model.walk.ChunkWalk`,
        the same function written out by hand (float64 tests hold the two equal).
        """
        segments = segments if segments is not None else feedback_segments(pos, self.cfg.feedback_block)
        rope = self.rotary(pos)
        if self._walks(segments):
            blocks = weight_blocks(segments, self.cfg.decoder_wgrad_block)
            return ChunkWalk(self, pos, doc, state.caches, memory, offset, segments, blocks,
                             rope.cos, rope.sin).run(e, state.s)
        carried = state.caches[0]  # every layer's cache holds the same positions
        key_pos, key_doc = torch.cat([carried.pos, pos], 1), torch.cat([carried.doc, doc], 1)
        windows = [WindowKeys(cache, key_pos, key_doc, self.cfg.window) for cache in state.caches]
        reads = [MemoryKeys(m, offset, e.shape[1]) for m in memory]
        groups = [reads[self.cfg.memory_group_of(i)] for i in range(len(self.decoder))]
        tapes = self._weight_tapes(segments)
        s, outputs = state.s, []
        for (a, b), e_seg in zip(segments, e.split([b - a for a, b in segments], dim=1)):
            seg_pos, seg_doc, seg_rope = pos[:, a:b], doc[:, a:b], rope.rows(a, b)
            z, feedback = self.feedback_in(e_seg, seg_pos, s)
            for layer, window, read, tape in zip(self.decoder, windows, groups, tapes):
                z = layer(z, seg_rope, partial(window.attend, a=a, b=b),
                          partial(read.attend, q_pos=seg_pos, q_doc=seg_doc, a=a, b=b),
                          ops=tape.seek(a, b) if tape is not None else None)
            s = self.carry(z, seg_pos, feedback)
            outputs.append(z)
        for closing in reads + [t for t in tapes if t is not None]:
            closing.close()
        return torch.cat(outputs, dim=1), DecoderState(s, [w.close() for w in windows])

    def _weight_tapes(self, segments: list[tuple[int, int]]) -> list[Optional[WeightTape]]:
        """Per decoder layer, the tape that defers its weight gradients over this chunk, or None."""
        size = self.cfg.decoder_wgrad_block
        if not defers(size, len(segments)) or not torch.is_grad_enabled():
            return [None] * len(self.decoder)
        blocks = weight_blocks(segments, size)
        return [WeightTape(layer, blocks) for layer in self.decoder]

    def _walks(self, segments: list[tuple[int, int]]) -> bool:
        """Whether this chunk's decoder runs as one :class:`~rlt_scale.model.walk.ChunkWalk`
        (``model.decoder_step=fused``): a walk over more than one segment (where a training step
        defers weight gradients, :func:`~rlt_scale.model.deferred.defers`), with or without gradients."""
        return self.cfg.decoder_step == "fused" and defers(self.cfg.decoder_wgrad_block, len(segments))

    # ------------------------------------------------------- teacher forcing
    def forward(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Teacher-forced logits ``[B, T, V]`` in one pass (no chunking)."""
        doc = torch.zeros_like(tokens) if doc_ids is None else doc_ids
        pos = document_positions(doc)
        e, _ = self.encode(tokens, pos, doc)
        memory = self.build_memory(e, pos, doc)
        z, _ = self.decode(e, pos, doc, memory, self.initial_state(tokens.shape[0], tokens.device))
        return self.logits(z)

    # ------------------------------------------------------------- counting
    def parameter_counts(self) -> dict[str, int]:
        """Unique parameters, and parameters as applied (tied layers counted per use)."""
        unique = sum(p.numel() for p in self.parameters())
        applied = sum(p.numel() for _, p in self.named_parameters(remove_duplicate=False))
        return {"unique": unique, "applied": applied}


def feedback_segments(pos: torch.Tensor, feedback_block: int) -> list[tuple[int, int]]:
    """Cut ``[0, S)`` into segments of positions that read one feedback vector (DESIGN.md section 1).

    A cut falls wherever any row starts a feedback block of K positions (a
    document start included): one position per segment for K=1, blocks for
    K>1, the whole span for K=0. The one place segments are cut; the
    segment plan of a batch applies it chunk by chunk.
    """
    k, length = feedback_block, pos.shape[1]
    if k == 0:
        return [(0, length)]
    if k == 1:
        return [(i, i + 1) for i in range(length)]
    starts = ((pos % k) == 0).any(dim=0)
    starts[0] = True
    bounds = starts.nonzero().flatten().tolist() + [length]
    return list(zip(bounds[:-1], bounds[1:]))


def answer_predictions(logits: torch.Tensor, answer_tokens) -> torch.Tensor:
    """The most likely of ``answer_tokens`` (token ids) for each row of ``logits [N, V]``."""
    allowed = torch.as_tensor(list(answer_tokens), device=logits.device)
    return allowed[logits.index_select(-1, allowed).argmax(dim=-1)]
