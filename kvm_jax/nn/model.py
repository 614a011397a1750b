"""The language model in Flax NNX (docs/kvm-spec.md §4): embedding, blocks of (mixer, MLP), head.
The parts that differ between backbone families (norms, MLP, embedding, head, the attention's
projections and RoPE) come from the config's family (:mod:`kvm_jax.nn.families.family`: GPTAlpha-2 by
default, Llama and its relatives); each block's mixer is the class registered for its kind
(:mod:`kvm_jax.nn.registry`); every computation on arrays goes through the pure functions of
:mod:`kvm_jax.ops`. Decode keeps, per layer, the mixer cache and the token-shift history
(:class:`LayerCache`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvm_jax.config.model import ModelConfig
from kvm_jax.nn.mixers.attention import LayerCache
from kvm_jax.nn.cache import (Resume, Step, cache_lengths, keep_inactive, last_tokens,
                              piece_counts, step_active)
from kvm_jax.nn.families.family import family_of
from kvm_jax.nn.families.gptalpha2 import MLP  # noqa: F401  (its home before families; still importable)
from kvm_jax.nn.mixers.kv_sharing import SharedKV
from kvm_jax.nn.mixers.mixer import MixerOutput
from kvm_jax.nn.registry import mixer_class, registered_mixers
from kvm_jax.ops.common import is_concrete, tree_nbytes
from kvm_jax.ops.documents import Documents, check_segment_ids, documents
from kvm_jax.ops.loss import head_logits

Array = jax.Array

#: Rematerialization of the blocks in a whole-sequence forward (training): what each block keeps
#: for the backward pass. "none": everything XLA keeps; "block": only the block's inputs (the
#: block's forward is recomputed during its backward: least memory, ~1/3 more compute);
#: "block_dots": the block's inputs and the results of its weight matmuls (less recompute, more
#: memory).
REMAT_POLICIES = {"none": None, "block": jax.checkpoint_policies.nothing_saveable,
                  "block_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class BlockOutput(NamedTuple):
  """What a block returns: its output ``x [B, T, C]``, its new cache (None without one), what it
  exports to the layers that read its keys and values (cross-layer KV sharing), and its mixer
  branch's output ``mixer_output [B, T, C]`` before the residual (what attention transfer
  matches layer by layer)."""

  x: Array
  cache: Optional[LayerCache]
  exports: dict
  mixer_output: Array


def _check_softcap(cfg: ModelConfig, layer: int, family) -> None:
  """Refuses a layer whose kind cannot soft-cap scores in a family that asks for it, naming the
  kinds that can (each class says so with ``SOFTCAP``; a kind without it is refused, so one added
  from outside that never reads the cap does not silently compute another model)."""
  kind = cfg.layer_mixers[layer]
  cap = family.attention_softcap(cfg)
  if cap is not None and not getattr(mixer_class(kind), "SOFTCAP", False):
    capping = [k for k in registered_mixers() if getattr(mixer_class(k), "SOFTCAP", False)]
    raise ValueError(f"layer {layer}: {kind!r} layers do not soft-cap attention scores, which "
                     f"the {cfg.family!r} family's options ask for (cap {cap}); use "
                     f"{', '.join(capping)} layers there.")


class Block(nnx.Module):
  """Pre-norm residual block: ``x + s·mixer(N(x))``, then ``x + s·MLP(N(x))`` (s the residual
  scale; N and the MLP the family's)."""

  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    self.cfg = cfg
    family = family_of(cfg)
    self.ln_attn = family.norm(cfg, cfg.hidden_size, rngs)
    _check_softcap(cfg, layer, family)
    self.attn = mixer_class(cfg.layer_mixers[layer])(cfg, layer, rngs=rngs)
    if (norm := family.post_norm(cfg, cfg.hidden_size, rngs)) is not None:
      self.post_attn_norm = norm
    self.ln_mlp = family.norm(cfg, cfg.hidden_size, rngs)
    self.mlp = family.mlp(cfg, layer, rngs)
    if (norm := family.post_norm(cfg, cfg.hidden_size, rngs)) is not None:
      self.post_mlp_norm = norm

  def mix(self, x, v_first, positions, cache: Optional[LayerCache] = None, decode=False,
          shared: Optional[SharedKV] = None, documents: Optional[Documents] = None):
    """The mixer branch on the block input ``x [B, T, C]``: a :class:`MixerOutput` whose
    ``output`` is ``h = mixer(LN(x))`` before the residual scale (what attention
    transfer matches layer by layer). ``documents``: packed documents (:meth:`LM.__call__`'s
    ``segment_ids``), passed only to kinds that take them (``DOCUMENTS``)."""
    x_in = self.ln_attn(x).astype(x.dtype)
    if documents is None:
      return MixerOutput(*self.attn(x_in, v_first, positions, cache, decode, shared))
    if not getattr(type(self.attn), "DOCUMENTS", False):
      raise ValueError(f"segment_ids: '{self.attn.kind}' layers do not take packed documents "
                       f"yet (the kinds that do: {', '.join(documents_kinds())}); run such "
                       "models on one document per row (packing 'pad').")
    return MixerOutput(*self.attn(x_in, v_first, positions, cache, decode, shared,
                                  documents=documents))

  def __call__(self, x, v_first, positions, cache: Optional[LayerCache] = None, decode=False,
               shared: Optional[SharedKV] = None, documents: Optional[Documents] = None
               ) -> BlockOutput:
    """The block on ``x [B, T, C]`` (a whole sequence, a prefill, a piece or, with ``decode``,
    one token per row), continuing ``cache`` when given."""
    dtype = x.dtype
    h, mixer_cache, tails, exports = self.mix(x, v_first, positions, cache, decode, shared,
                                              documents)
    x = x + self.cfg.scale * _post(self, "post_attn_norm", h)
    m_in = self.ln_mlp(x).astype(dtype)
    starts = None if documents is None else documents.position == 0
    m = self.mlp(m_in, cache.last_mlp if (decode and cache) else None, starts)
    x = x + self.cfg.scale * _post(self, "post_mlp_norm", m)
    new_cache = None
    if cache is not None:
      # The token-shift history of a row a step does not feed stays its last token's.
      active = step_active(decode)
      tails = tuple(keep_inactive(active, new, old) for new, old in
                    zip(tails, (cache.last_q, cache.last_k, cache.last_v)))
      new_cache = LayerCache(mixer=mixer_cache, last_q=tails[0], last_k=tails[1], last_v=tails[2],
                             last_mlp=keep_inactive(active, last_tokens(m_in, piece_counts(decode)),
                                                    cache.last_mlp))
    return BlockOutput(x, new_cache, exports, h)


class LM(nnx.Module):
  """The LM: embedding (and, for GPTAlpha-2, its norm), blocks, final norm, LM head (or the
  embedding, tied); logits in float32."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    family = family_of(cfg)
    self.wte = family.embedding(cfg, rngs)
    norm = family.embedding_norm(cfg, rngs)
    if norm is not None:
      self.ln_emb = norm
    self.blocks = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
    self.ln_head = family.norm(cfg, cfg.hidden_size, rngs)
    if not family.tied_head(cfg):
      self.lm_head = family.head(cfg, rngs)
    # The head's logits squashed to (-cap, cap) (Gemma 2), or None: every head below and the
    # training losses read it.
    self.logit_softcap = family.logit_softcap(cfg)

  def check_tokens(self, tokens):
    """A clear ValueError for ids that are not ``[batch, time]``, hold no token, or lie outside
    the vocabulary (the range check is skipped when the tokens are traced)."""
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [batch, time] int, got shape {tokens.shape}.")
    if 0 in tokens.shape:
      raise ValueError(f"tokens of shape {tokens.shape}: a forward pass needs at least one row "
                       "and one token in it.")
    try:  # one device reduction and one transfer; skipped when traced
      low, top = (int(x) for x in jnp.stack([jnp.min(tokens), jnp.max(tokens)]))
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
      return
    if low < 0 or top >= self.cfg.vocab_size:
      bad = low if low < 0 else top
      raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.cfg.vocab_size}).")

  def _run(self, tokens, positions, caches, decode, remat: str = "none",
           documents: Optional[Documents] = None, taps: Optional[tuple[list, list]] = None):
    """Final hidden states ``[B, T, C]`` (after the final norm, compute dtype) and caches: the
    one loop over the blocks of forward, prefill, decode and the distillation taps.
    ``documents``: packed documents (then ``positions`` are their positions). ``taps``: two
    lists that receive each block's input and its mixer's output (:meth:`mixer_io`)."""
    cfg = self.cfg
    if remat not in REMAT_POLICIES:
      raise ValueError(f"remat={remat!r} is unknown; choose from {tuple(REMAT_POLICIES)}.")
    if taps is not None and remat != "none":
      raise ValueError(f"taps record each block's input and mixer output, which remat={remat!r} "
                       "discards; take them with remat='none'.")
    x0 = self.embed(tokens)
    anchors = self.value_anchors(x0, caches if decode else None, documents)
    sharing = cfg.kv_sharing != "none"
    plan = scan_plan(cfg)
    if remat != "none" and caches is None and plan is not None:
      period, count = plan
      policy = REMAT_POLICIES[remat]
      x = self._scanned_blocks(x0, anchors, positions, period, count, policy, documents)
      for i in range(count, cfg.num_layers):  # the layers after the last whole period
        x, _ = _checkpointed_block(self.blocks[i], policy, x, anchors[cfg.value_anchor(i)],
                                   positions, {}, False, documents)
      return self.ln_head(x).astype(x.dtype), None
    x, new_caches, exports = x0, [], {}
    old_caches = None if caches is None else [c.mixer for c in caches]
    for i, block in enumerate(self.blocks):
      anchor = anchors[cfg.value_anchor(i)]
      if remat != "none" and caches is None:  # unrolled: cross-layer KV sharing
        x, exports[i] = _checkpointed_block(block, REMAT_POLICIES[remat], x, anchor, positions,
                                            exports, sharing, documents)
        c = None
      else:
        shared = SharedKV(exports=exports, old_caches=old_caches) if sharing else None
        x_in = x
        x, c, exports[i], h = block(x, anchor, positions, None if caches is None else caches[i],
                                    decode, shared, documents)
        if taps is not None:
          taps[0].append(x_in)
          taps[1].append(h)
      new_caches.append(c)
    features = self.ln_head(x).astype(x.dtype)
    return features, (None if caches is None else new_caches)

  def embed(self, tokens: Array) -> Array:
    """The blocks' first input ``x0 [B, T, C]`` (the embedding and the family's norm of it, if it
    has one; compute dtype)."""
    x = self.wte(tokens)
    if hasattr(self, "ln_emb"):
      x = self.ln_emb(x)
    return x.astype(self.cfg.jnp_compute_dtype)

  def value_anchors(self, x0: Array, caches=None,
                    documents: Optional[Documents] = None) -> dict[int, Array]:
    """``{anchor layer: v_first}``, the value-residual anchors computed from ``x0`` (``caches``:
    a decode step's, which a mixer's anchor may read; ``documents``: packed documents, for the
    kinds that take them: an anchor may shift tokens)."""
    cfg = self.cfg
    anchors = {}
    for layer in sorted({cfg.value_anchor(i) for i in range(cfg.num_layers)}):
      block = self.blocks[layer]
      kw = ({"documents": documents}
            if documents is not None and getattr(type(block.attn), "DOCUMENTS", False) else {})
      anchors[layer] = block.attn.anchor_value(block.ln_attn(x0).astype(x0.dtype),
                                               None if caches is None else caches[layer], **kw)
    return anchors

  def mixer_io(self, tokens: Array) -> tuple[list[Array], list[Array], Array]:
    """Per block ``i`` of a whole sequence: its input ``x_i [B, T, C]`` (the residual stream) and
    its mixer's output ``h_i [B, T, C]`` (before the residual scale), and the final hidden states
    (:meth:`features`). What layer-wise attention transfer matches: a student layer run on the
    teacher's ``x_i`` against the teacher's ``h_i``."""
    self.check_tokens(tokens)
    inputs, outputs = [], []
    positions = jnp.arange(tokens.shape[1])[None]
    features, _ = self._run(tokens, positions, None, False, taps=(inputs, outputs))
    return inputs, outputs, features

  def _scanned_blocks(self, x, anchors, positions, period: int, count: int, policy,
                      documents=None):
    """The first ``count`` blocks as a ``lax.scan`` over groups of ``period`` layers whose states
    are stacked (maxtext's scanned layers), each group rematerialized under ``policy``.

    Recomputation happens inside the backward loop, one group per iteration, so only the group
    inputs ``[B, T, C]`` of every layer group outlive the forward pass. (Unrolled
    ``jax.checkpoint`` only says *what* to save; a compiler that schedules or CSEs the
    recomputation early, as XLA:CPU does, keeps every layer's activations anyway.) The parameter
    tree is unchanged: the stacking happens inside the traced step."""
    cfg = self.cfg
    blocks = list(self.blocks)
    graphdefs = [nnx.graphdef(blocks[j]) for j in range(period)]
    stacked = tuple(
        jax.tree_util.tree_map(lambda *xs: jnp.stack(xs),
                               *[nnx.state(blocks[i]) for i in range(j, count, period)])
        for j in range(period))
    group_anchors = [anchors[cfg.value_anchor(j)] for j in range(period)]

    def layer(graphdef, state, x, anchor):
      return nnx.merge(graphdef, state)(x, anchor, positions, None, False, None, documents).x

    if period > 2:
      # A long period (Gemma 3's six layers) would otherwise keep all its layers' activations
      # live while the group's backward runs: each layer saves only its input there.
      layer = jax.checkpoint(layer, policy=policy, prevent_cse=True, static_argnums=(0,))

    def group(x, states):
      for graphdef, state, anchor in zip(graphdefs, states, group_anchors):
        x = layer(graphdef, state, x, anchor)
      return x, None

    group = jax.checkpoint(group, policy=policy, prevent_cse=True)
    return jax.lax.scan(group, x, stacked)[0]

  def head_kernel(self) -> Array:
    """The LM head's ``[C, V]`` matrix: its own, or the embedding's transpose when tied."""
    if hasattr(self, "lm_head"):
      return self.lm_head.kernel[...]
    return self.wte.embedding[...].T

  def logits(self, features: Array) -> Array:
    """The LM head: ``[..., C]`` hidden states -> float32 logits ``[..., V]``."""
    return head_logits(features, self.head_kernel(), self.cfg.compute_dtype,
                       self.logit_softcap)

  def features(self, tokens: Array, remat: str = "none", *,
               segment_ids: Optional[Array] = None) -> Array:
    """Final hidden states ``[B, T, C]`` of a whole sequence (head LayerNorm applied; the LM head
    not): what a loss over slices of the sequence (:func:`kvm_jax.ops.loss.sliced_loss_sums`)
    consumes. ``remat`` is one of :data:`REMAT_POLICIES`; ``segment_ids`` as in
    :meth:`__call__`."""
    self.check_tokens(tokens)
    if segment_ids is None:
      positions = jnp.arange(tokens.shape[1])[None]
      return self._run(tokens, positions, None, False, remat)[0]
    check_segment_ids(segment_ids, tokens.shape, "LM")
    docs = documents(segment_ids)
    return self._run(tokens, docs.position, None, False, remat, docs)[0]

  def __call__(self, tokens: Array, remat: str = "none", *,
               segment_ids: Optional[Array] = None) -> Array:
    """Logits ``[B, T, V]`` (float32) of a whole sequence.

    ``segment_ids [B, T]`` (int, 0 = padding; each maximal run of one nonzero id is a document):
    rows of packed documents. Every document's logits are those of the document run alone
    (positions, token shift, windows and states restart at its first token); padding positions
    give finite logits that no document sees (leave them out of the loss). Without it the rows
    are single sequences, exactly as before."""
    return self.logits(self.features(tokens, remat, segment_ids=segment_ids))

  def init_cache(self, batch: int, max_len: int) -> list[LayerCache]:
    cfg = self.cfg
    caches = []
    for block in self.blocks:
      last_q, last_k, last_v = block.attn.init_tails(batch)
      caches.append(LayerCache(mixer=block.attn.init_cache(batch, max_len), last_q=last_q,
                               last_k=last_k, last_v=last_v,
                               last_mlp=jnp.zeros((batch, 1, cfg.hidden_size),
                                                  cfg.jnp_compute_dtype)))
    return caches

  @staticmethod
  def cache_bytes(caches: list[LayerCache]) -> list[int]:
    """Bytes of each layer's K/V cache (mixer cache: window, state, KV buffer), measured from the
    arrays; 0 for a reconstruction layer that reads its sources' caches."""
    return [tree_nbytes(c.mixer) for c in caches]

  def prefill(self, tokens: Array, caches: list[LayerCache]) -> tuple[Array, list[LayerCache]]:
    """Logits of a prompt and the caches filled for decoding from position T."""
    self.check_tokens(tokens)
    max_len = caches[0].mixer.max_len
    if tokens.shape[1] > max_len:
      raise ValueError(f"prompt of {tokens.shape[1]} tokens exceeds the cache max_len={max_len}.")
    positions = jnp.arange(tokens.shape[1])[None]
    features, caches = self._run(tokens, positions, caches, False)
    return self.logits(features), caches

  def decode_step(self, token: Array, caches: list[LayerCache],
                  active: Optional[Array] = None) -> tuple[Array, list[LayerCache]]:
    """Logits ``[B, 1, V]`` of one token per row, each at its own position (the row's
    ``cache_lengths(caches)``). ``active [B]`` (bool; None: every row): the rows fed; the others
    keep their caches exactly (written nowhere, so the caches update in place) and their logits
    mean nothing."""
    if token.ndim != 2 or token.shape[1] != 1:
      raise ValueError(f"decode_step takes tokens of shape [batch, 1], got {token.shape}.")
    if active is not None and tuple(active.shape) != (token.shape[0],):
      raise ValueError(f"decode_step: active must hold one flag per row, shape "
                       f"({token.shape[0]},), got {tuple(active.shape)}.")
    position = cache_lengths(caches, token.shape[0])
    features, caches = self._run(token, position[:, None], caches,
                                 True if active is None else Step(active))
    return self.logits(features), caches

  def resume_alignment(self) -> Optional[int]:
    """The position multiple :meth:`resume` pieces start at and span (the least common multiple
    of the layers' ``resume_alignment``), or None when some layer cannot continue in parallel
    (then :meth:`extend` is the way)."""
    cfg, alignment = self.cfg, 1
    for layer, kind in enumerate(cfg.layer_mixers):
      method = getattr(mixer_class(kind), "resume_alignment", None)
      step = None if method is None else method(cfg, layer)
      if step is None:
        return None
      alignment = math.lcm(alignment, int(step))
    return alignment

  def resume(self, tokens: Array, caches: list[LayerCache],
             counts: Optional[Array] = None) -> tuple[Array, list[LayerCache]]:
    """Continues every row by the ``T`` tokens ``tokens [B, T]`` in parallel, each row from its
    own length: logits ``[B, T, V]`` and the caches, equal to ``T`` decode steps (and to
    :meth:`prefill` of the whole sequence) to float32 rounding.

    ``T`` and every row's length must be multiples of :meth:`resume_alignment`; a row at length
    0 starts its sequence (equal to :meth:`prefill` of the piece), so rows starting a prompt and
    rows continuing one go in one call (the engine's chunked prefill). ``counts [B]`` (1 ≤
    ``counts[b]`` ≤ ``T``; None: ``T``): row ``b`` takes only its first ``counts[b]`` tokens,
    the rest of its piece being padding: its cache ends as after ``counts[b]`` decode steps (its
    length then need not be a multiple; it goes on by decode steps) and its logits past them
    mean nothing. So a prompt's last, partial chunk runs in the program of whole chunks. Lengths
    and counts are checked when concrete."""
    self.check_tokens(tokens)
    B, T = tokens.shape
    alignment = self.resume_alignment()
    if alignment is None:
      raise ValueError("resume: some layer of this model cannot continue a piece in parallel "
                       "(cross-layer KV sharing, or a kind without resume_alignment); use "
                       "extend.")
    if T % alignment:
      raise ValueError(f"resume: a piece of {T} tokens is not a multiple of the model's "
                       f"alignment {alignment}; feed the rest with extend.")
    lengths = cache_lengths(caches, B)
    if is_concrete(lengths) and bool(jnp.any(lengths % alignment != 0)):
      raise ValueError(f"resume: row lengths {np.asarray(lengths).tolist()} must be multiples of "
                       f"{alignment}; feed a row's rest with extend.")
    if counts is not None:
      counts = jnp.asarray(counts, jnp.int32)
      if counts.shape != (B,):
        raise ValueError(f"resume: counts must hold one count per row, shape ({B},), got "
                         f"{counts.shape}.")
      if is_concrete(counts) and bool(jnp.any((counts < 1) | (counts > T))):
        raise ValueError(f"resume: counts {np.asarray(counts).tolist()} must lie in [1, {T}] "
                         "(the real tokens at the front of each row's piece); leave a row out "
                         "of the call rather than give it none.")
    positions = lengths[:, None] + jnp.arange(T)[None, :]
    features, caches = self._run(tokens, positions, caches, Resume(counts))
    return self.logits(features), caches

  def extend(self, tokens: Array, caches: list[LayerCache],
             counts: Optional[Array] = None) -> tuple[Array, list[LayerCache]]:
    """Continues every row from where its cache stands: row ``b`` takes its next ``counts[b]``
    tokens ``tokens[b, :counts[b]]`` (all ``T`` when ``counts`` is None); a row with count 0
    keeps its cache as it was. Returns the logits of each row's last token fed here ``[B, V]``
    (zeros for a row fed nothing) and the caches.

    A prompt fed in pieces equals the prompt fed at once (:meth:`prefill`), every row at a
    length of its own (what the engine's slots need). The tokens go through the decode step one
    position at a time inside one ``lax.scan``: exact for every mixer kind (a kind gets it by
    implementing the decode step of its cache), at the cost of a decode step per token."""
    self.check_tokens(tokens)
    B, T = tokens.shape
    counts = jnp.full((B,), T, jnp.int32) if counts is None else jnp.asarray(counts, jnp.int32)
    if counts.shape != (B,):
      raise ValueError(f"counts must hold one count per row, shape ({B},), got {counts.shape}.")
    graphdef, state = nnx.split(self)

    def feed(carry, column):
      caches, last = carry
      token, index = column
      fed = index < counts
      logits, caches = nnx.merge(graphdef, state).decode_step(token[:, None], caches, fed)
      last = jnp.where((index == counts - 1)[:, None], logits[:, 0], last)
      return (caches, last), None

    last = jnp.zeros((B, self.cfg.vocab_size), jnp.float32)
    columns = (jnp.swapaxes(tokens, 0, 1).astype(jnp.int32), jnp.arange(T, dtype=jnp.int32))
    (caches, last), _ = jax.lax.scan(feed, (caches, last), columns)
    return last, caches


def scan_plan(cfg: ModelConfig) -> Optional[tuple[int, int]]:
  """``(period, count)``: the first ``count`` layers repeat a pattern of ``period`` layers at
  least twice (mixer kinds and the family's per-layer differences), the most layers any period
  covers (the smallest period among equals), so a remat forward scans them; None when no
  pattern repeats or the layers read each other's K/V. Gemma-3-1B: 6 (five local layers, one
  global) over 24 of its 26 layers."""
  if cfg.kv_sharing != "none":
    return None
  family, L = family_of(cfg), cfg.num_layers
  kinds = [(kind, family.layer_key(cfg, i)) for i, kind in enumerate(cfg.layer_mixers)]
  best = None
  for p in range(1, L // 2 + 1):
    n = p
    while n < L and kinds[n] == kinds[n - p]:
      n += 1
    count = n // p * p
    if count >= 2 * p and (best is None or count > best[1]):
      best = (p, count)
  return best


def _post(block: Block, name: str, h: Array) -> Array:
  """A branch's output through the block's post-norm ``name`` when its family has one."""
  norm = getattr(block, name, None)
  return h if norm is None else norm(h).astype(h.dtype)


def layer_period(cfg: ModelConfig) -> Optional[int]:
  """The period of :func:`scan_plan` when it covers every layer (1 for a uniform model, 2 for
  the paper's alternating hybrids), else None."""
  plan = scan_plan(cfg)
  return plan[0] if plan is not None and plan[1] == cfg.num_layers else None


def _checkpointed_block(block: Block, policy, x, v_first, positions, exports, sharing: bool,
                        documents: Optional[Documents] = None):
  """``block`` on a whole sequence under ``jax.checkpoint(policy)``: (x, exports). The block runs
  as a pure function of its split state."""
  graphdef, state = nnx.split(block)

  def run(state, x, v_first, positions, exports, documents):
    shared = SharedKV(exports=exports) if sharing else None
    out = nnx.merge(graphdef, state)(x, v_first, positions, None, False, shared, documents)
    return out.x, (out.exports if sharing else {})  # exports are read only by KV sharing

  return jax.checkpoint(run, policy=policy, prevent_cse=True)(state, x, v_first, positions,
                                                              exports if sharing else {},
                                                              documents)


def documents_kinds() -> list[str]:
  """The registered mixer kinds that take packed documents (``DOCUMENTS = True``)."""
  return [kind for kind, cls in registered_mixers().items() if getattr(cls, "DOCUMENTS", False)]


def count_params(cfg: ModelConfig) -> dict[str, int]:
  """Parameter counts without allocating weights (``nnx.eval_shape``).

  ``total`` counts everything; ``non_embedding`` excludes the token embedding and the LM head (the
  convention of the paper's "120M"/"350M" names); ``without_lm_head`` = total - LM head.
  """
  total = _total_params(cfg)
  embed = cfg.vocab_size * cfg.hidden_size
  head = 0 if family_of(cfg).tied_head(cfg) else embed
  return {"total": total, "non_embedding": total - embed - head, "without_lm_head": total - head,
          "embedding": embed, "lm_head": head}


def abstract_param_count(make) -> int:
  """Parameters of the module ``make()`` builds, traced abstractly (nothing allocated)."""
  leaves = jax.tree_util.tree_leaves(nnx.state(nnx.eval_shape(make), nnx.Param))
  return sum(int(np.prod(p.shape)) for p in leaves)


@functools.lru_cache(maxsize=64)
def _total_params(cfg: ModelConfig) -> int:
  # One abstract trace per block rather than one for the whole model: each parameter's RNG
  # counter update asks a tracer for its sharding, and the error message JAX builds for that
  # walks the whole trace, so one trace costs the square of the parameters made in it (4.5 s for
  # a 350M model, against well under a second block by block). The parts outside the blocks
  # (embedding, its norm, the final norm, an untied head) are counted the same way, as the
  # family makes them. A config is hashable and its count never changes.
  blocks = sum(abstract_param_count(lambda i=i: Block(cfg, i, rngs=nnx.Rngs(0)))
               for i in range(cfg.num_layers))
  family, rngs = family_of(cfg), lambda: nnx.Rngs(0)
  parts = [lambda: family.embedding(cfg, rngs()), lambda: family.norm(cfg, cfg.hidden_size, rngs())]
  if nnx.eval_shape(lambda: family.embedding_norm(cfg, rngs())) is not None:
    parts.append(lambda: family.embedding_norm(cfg, rngs()))
  if not family.tied_head(cfg):
    parts.append(lambda: family.head(cfg, rngs()))
  return blocks + sum(abstract_param_count(make) for make in parts)
