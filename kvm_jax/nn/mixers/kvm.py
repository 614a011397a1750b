"""The KVM mixer (docs/kvm-spec.md §6): the attention front end plus LN_s, the merge-gate projection
W_g and the two key temperatures, over the KVM op of :mod:`kvm_jax.ops.kvm`; its decode cache is a
:class:`kvm_jax.KVMCache`."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from kvm_jax.config.budget import (CallableBudget, FixedBudget, PowerLawBudget, SaturatingBudget,
                                   average_visible_keys, state_rows_after)
from kvm_jax.config.kvm import KVMConfig
from kvm_jax.config.model import ModelConfig
from kvm_jax.nn.authors_format import (AuthorsMixer, AuthorsReading, AuthorsWriting,
                                       ConfigError, ExportError, read_flag, read_float,
                                       read_int, shared_window)
from kvm_jax.nn.mixers import kv_sharing
from kvm_jax.nn.mixers.attention import AttentionFrontEnd
from kvm_jax.nn.cache import is_resume, piece_counts, step_active
from kvm_jax.nn.layers import layer_norm, linear
from kvm_jax.nn.mixers.mixer import Mixed
from kvm_jax.ops.kvm.api import (KVMBackend, kvm_attention, kvm_decode_step, kvm_prefill,
                                 kvm_resume, resolve_kvm_backend)
from kvm_jax.ops.kvm.decode import KVMCache, kvm_init_cache
from kvm_jax.ops.kvm.state import KVMParams

Array = jax.Array


# The authors' format (docs/checkpoints.md): their KVM fields <-> KVMConfig.

# A state cap that cannot bind: their cap is chunk_len x n_max_d_chunks rows, and no budget exceeds
# the tokens seen, which int32 positions keep below 2^31. (Their own configs say "no cap" with
# n_max_d_chunks = 10000, which does bind past 10000 chunks' worth of rows.)
NO_CAP_ROWS = 2**31


def _read_authors_options(reading: AuthorsReading) -> KVMConfig:
  """The options of their KVM fields (rotating the role's ``rope_partial_dim`` channels of heads
  ``qk_head_dim`` wide; the window geometry, which their KVM and block-SWA layers share)."""
  cfg, dims, d_qk = reading.fields, reading.rope_dims, reading.qk_head_dim
  chunk, window_chunks, sink = shared_window(cfg)
  zeroed = read_int(cfg, "rope_partial_dim", 0) or d_qk
  if dims <= 0 or zeroed != dims:
    raise ConfigError(
        f"the KVM layers rotate {dims} channels (rope_partial_dim / alt_rope_partial_dim) but "
        f"their state keys zero {zeroed} (rope_partial_dim={cfg['rope_partial_dim']}, where 0 "
        "means every channel); kvm_jax zeroes exactly the rotary channels, so the two must be "
        "equal and positive.")
  if not read_flag(cfg, "kvm_use_vlens"):
    raise ConfigError("kvm_use_vlens=0: their state-value readout without radii divides by a "
                      "count that is never kept (docs/kvm-spec.md §6.9); kvm_jax does not "
                      "reproduce it (its value_norm='none' reads raw sums instead).")
  fields = dict(
      chunk_size=chunk, window_chunks=window_chunks, sink_rows=sink, rope_dims=dims,
      budget=_read_authors_budget(cfg), max_state_rows=chunk * read_int(cfg, "n_max_d_chunks", 1),
      gate_keys=read_flag(cfg, "kvm_use_merge_gate_keys"),
      gate_values=read_flag(cfg, "kvm_use_merge_gate_values"),
      gate_appends=read_flag(cfg, "kvm_apply_merge_gate_to_appends"),
      gate_initial_state=read_flag(cfg, "kvm_apply_merge_gate_to_initial_state"),
      head_temperatures=read_flag(cfg, "kvm_use_head_temps"), value_norm="radius")
  try:
    return KVMConfig(**fields)
  except ValueError as e:  # KVMConfig's own validation
    raise ConfigError(f"the KVM fields (chunk_len, n_bswa_chunks, sink_len, state_*) give no "
                      f"valid KVM layer: {e}") from None


def _read_authors_budget(cfg):
  """The KVM budget of their config (docs/kvm-spec.md §6.3)."""
  mode = cfg["state_budget_mode"]
  min_len = max(read_int(cfg, "state_min_len"), 0)  # their default -1 never binds: targets >= 0
  if mode == "fixed":
    # The state starts as the first chunk's rows and never shrinks, so any fixed target up to
    # chunk_len (their default -1 included) keeps exactly that chunk: FixedBudget(chunk_len).
    return FixedBudget(rows=max(min_len, read_int(cfg, "chunk_len", 1)))
  round_down = read_int(cfg, "state_round_down", 1)
  if mode == "power_law":
    return PowerLawBudget(read_float(cfg, "state_growth_factor"),
                          read_float(cfg, "state_growth_exponent"), min_rows=min_len,
                          round_down=round_down)
  if mode == "kvm_saturation":
    if cfg["state_saturation_n"] is None:
      raise ConfigError("state_budget_mode='kvm_saturation' needs state_saturation_n (the limit "
                        "the state saturates toward), got None.")
    return SaturatingBudget(read_int(cfg, "state_saturation_n", 1), min_rows=min_len,
                            round_down=round_down)
  raise ConfigError(f"state_budget_mode={mode!r}: choose 'fixed', 'power_law' or "
                    "'kvm_saturation'.")


def _write_authors_options(writing: AuthorsWriting, kind: str) -> None:
  """Their KVM fields for the options of ``kind`` (the window geometry first: their block-SWA
  layers share it), or :class:`ExportError` naming what their KVM layer computes otherwise."""
  model, k = writing.model, writing.model.options_of(kind)
  writing.put(kind, chunk_len=k.chunk_size, n_bswa_chunks=k.window_chunks, sink_len=k.sink_rows)
  rope_main = writing.rope_partial_dim
  zeroed = rope_main or model.qk_head_dim  # their KVM layer zeroes rope_partial_dim, 0 = all
  if model.rope_dims == 0 or model.rope_dims != zeroed:
    raise ExportError(
        f"the KVM layers rotate rope_dims={model.rope_dims} channels, but their KVM layer "
        f"zeroes rope_partial_dim={rope_main} ({zeroed}) channels of the state keys "
        "(rope_partial_dim belongs to the main mixer; 0 means every channel).")
  if k.value_norm != "radius":
    raise ExportError(f"kvm.value_norm={k.value_norm!r}: their code reads the state values "
                      "normalized times the radius (kvm_use_vlens=1); its kvm_use_vlens=0 path "
                      "computes something else (docs/kvm-spec.md §6.9).")
  if k.ln_eps != 1e-5:
    raise ExportError(f"kvm.ln_eps={k.ln_eps}: their LN_s uses 1e-5.")
  if k.state_zeroed_dims != k.rope_dims:
    raise ExportError(f"kvm.state_rope_dims={k.state_rope_dims}: their state zeroes every "
                      f"rotary channel ({k.rope_dims}).")
  if k.logit_softcap is not None:
    raise ExportError(f"kvm.logit_softcap={k.logit_softcap}: their readout does not soft-cap "
                      "scores.")
  writing.put(kind, **_write_authors_budget(k), kvm_use_merge_gate_keys=int(k.gate_keys),
              kvm_use_merge_gate_values=int(k.gate_values),
              kvm_apply_merge_gate_to_appends=int(k.gate_appends),
              kvm_apply_merge_gate_to_initial_state=int(k.gate_initial_state),
              kvm_use_head_temps=int(k.head_temperatures), kvm_use_vlens=1)


def _write_authors_budget(k: KVMConfig) -> dict:
  """Their state_* and n_max_d_chunks fields for the budget and cap of ``k``."""
  budget, chunk = k.budget, k.chunk_size
  cap = k.max_state_rows
  if isinstance(budget, CallableBudget):
    raise ExportError("a callable KVM budget: their code knows the fixed, power_law and "
                      "kvm_saturation budgets only.")
  if isinstance(budget, FixedBudget):
    rows = budget.rows if cap is None else min(budget.rows, cap)
    return dict(state_budget_mode="fixed", state_min_len=rows,
                n_max_d_chunks=math.ceil(rows / chunk))
  if cap is not None and cap % chunk:
    raise ExportError(f"kvm.max_state_rows={cap}: their cap is chunk_len x n_max_d_chunks, so it "
                      f"must be a multiple of chunk_size={chunk}.")
  n_max = -(-NO_CAP_ROWS // chunk) if cap is None else cap // chunk
  if isinstance(budget, PowerLawBudget):
    return dict(state_budget_mode="power_law", state_growth_factor=float(budget.factor),
                state_growth_exponent=float(budget.exponent), state_min_len=budget.min_rows,
                state_round_down=budget.round_down, n_max_d_chunks=n_max)
  if isinstance(budget, SaturatingBudget):
    return dict(state_budget_mode="kvm_saturation", state_saturation_n=budget.limit,
                state_min_len=budget.min_rows, state_round_down=budget.round_down,
                n_max_d_chunks=n_max)
  raise ExportError(f"kvm.budget={budget!r} has no equivalent in their code.")


class KVMAttention(AttentionFrontEnd):
  """Exact window + compressed state, one softmax over both.

  With cross-layer KV sharing a KVM layer may also be a source whose routing decisions another
  layer follows or replays (``ModelConfig.routing_leader``, ``shares_state``), or a reconstruction
  layer: window-only fusion (its own state) or a fused state (no LN_s, no W_g, nothing stored).
  """

  Options = KVMConfig
  AUTHORS = AuthorsMixer(("kvm", "kvm_triton"),
                         ("model.kvm_mixer.SequenceMixer", "model.kvm_triton_mixer.SequenceMixer",
                          "model.kvm_fp32_routing_reference.SequenceMixer"), "kvm",
                         title="KVM", grouped_kv=True, read_options=_read_authors_options,
                         write_options=_write_authors_options)
  LOGICAL_AXES = {**AttentionFrontEnd.LOGICAL_AXES, "key_weighting": ("embed", "kv_heads")}
  # What a KVM layer adds to the attention front end (the "KVM-only" parameters of conversion and
  # distillation), and the values that leave a converted layer's in-window logits unchanged:
  # LN_s the identity, W_g = 0 (merge gate 1), both temperatures 1.
  CONVERSION_VALUES = {("ln_s", "scale"): 1.0, ("ln_s", "bias"): 0.0,
                       ("key_weighting", "kernel"): 0.0, ("window_temperature",): 1.0,
                       ("state_temperature",): 1.0}
  OWN_PARAMETERS = tuple(dict.fromkeys(path[0] for path in CONVERSION_VALUES))
  DOCUMENTS = True
  SOFTCAP = True  # the readout caps its scores over state and window alike

  @classmethod
  def exact_window(cls, cfg: ModelConfig, layer: int) -> Optional[int]:
    """Keys at distance below this are attended exactly: the window ``L = window_chunks ·
    chunk_size`` (beyond it, a key lives on only as part of a state row)."""
    return cfg.options_of(cfg.layer_mixers[layer]).window_len

  @classmethod
  def beyond_window(cls, cfg: ModelConfig, layer: int, seq_len: int) -> Optional[str]:
    """The state's rows after ``seq_len`` tokens (the budget's schedule)."""
    return f"{state_rows_after(cfg.options_of(cfg.layer_mixers[layer]), seq_len)} state rows"

  @classmethod
  def resume_alignment(cls, cfg: ModelConfig, layer: int) -> Optional[int]:
    """Pieces of whole chunks from a chunk boundary (``C``); not with cross-layer KV sharing
    (shared routing and fused windows are replayed one token at a time)."""
    return None if cfg.kv_sharing != "none" else cfg.options_of(cfg.layer_mixers[layer]).chunk_size

  @classmethod
  def keys_per_query(cls, cfg: ModelConfig, layer: int, seq_len: int) -> float:
    """The exact window plus the state rows of the schedule at each chunk."""
    return average_visible_keys(cfg.options_of(cfg.layer_mixers[layer]), seq_len)

  @classmethod
  def flops_per_token(cls, cfg: ModelConfig, layer: int, seq_len: int
                      ) -> tuple[float, float, float]:
    """Matmul FLOPs per token of the layer's core (beyond its parameter matmuls) in training:
    ``(model, forward, backward)``, see :func:`kvm_jax.nn.registry.mixer_flops`.

    ``model`` (what MFU counts) is the algorithm's work: QKᵀ and PV over the visible keys,
    forward and backward (12·keys·D·H), plus the routing scores of every fold, forward only
    (decisions carry no gradient): each overflow token against the valid non-sink rows after
    the appends (merge target), and, where the fold appends, against the valid rows before it
    (novelty). Adding merged tokens into their rows is a scatter of O(C·D) per fold, not counted.

    ``forward`` and ``backward`` are what the XLA scan (``kvm_jax.ops.kvm.scan``) runs, which
    is more: a static shape reads every chunk against the state's whole capacity (the rows of
    the schedule's end; a growing budget masks the rows not yet filled) and its full ``nb·C``
    window (the causal half of the newest chunk is masked); scores are taken against the whole
    capacity too; on platforms whose row update is a one-hot matmul
    (:func:`kvm_jax.ops.kvm.state.row_update_for`: all but CPU) each fold's accumulation costs
    2·C·R·(D + Dv) FLOPs per KV head, and appends as much again. The backward pass reruns each block of chunks
    from its stored state with the stored decisions (attention and accumulation again, no
    routing), then takes the gradients (twice the attention's forward; the accumulation's
    linearization and transpose, three times its forward)."""
    from kvm_jax.config.budget import kvm_schedule
    from kvm_jax.ops.common import current_platform
    from kvm_jax.ops.kvm.scan import schedule_runs
    from kvm_jax.ops.kvm.state import row_update_for

    kc = cfg.options_of(cfg.layer_mixers[layer])
    sched = kvm_schedule(kc, seq_len)
    C, nb, S, R = kc.chunk_size, kc.window_chunks, kc.sink_rows, sched.final_rows
    H, Hkv, D, Dv = cfg.num_heads, cfg.kv_heads, cfg.qk_head_dim, cfg.v_head_dim
    onehot = cfg.kvm_implementation == "xla" and row_update_for(current_platform()) == "onehot"
    attention = routing = routing_model = accumulation = 0.0
    for run in schedule_runs(sched):
      full = all(sched.rows_before[c] == R and sched.n_append[c] == 0
                 for c in range(run.start, run.stop))
      for c in range(run.start, run.stop):
        # the front sees its chunk and the earlier ones plus one empty state row
        keys = R + nb * C if run.visible else min(c + 1, nb) * C + 1
        attention += 2.0 * C * H * keys * (D + Dv)
        if not sched.update_after[c]:
          continue
        rows_after = sched.rows_before[c] + sched.n_append[c]
        routing_model += 2.0 * C * Hkv * D * ((rows_after - S) + (
            sched.rows_before[c] if sched.n_append[c] else 0))
        routing += 2.0 * C * Hkv * D * ((R - S if full else R) + (R if run.may_append else 0))
        if onehot:
          accumulation += 2.0 * C * Hkv * R * ((D + Dv) + ((D + Dv + 1) if run.may_append else 0))
    keys = average_visible_keys(kc, seq_len)
    model = 12.0 * keys * D * H + routing_model / seq_len
    forward = (attention + routing + accumulation) / seq_len
    backward = (3.0 * attention + 4.0 * accumulation) / seq_len
    return model, forward, backward

  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    super().__init__(cfg, layer, rngs=rngs)
    self.shares_state = cfg.shares_state(layer)        # state fused from the sources' states
    self.routing_leader = cfg.routing_leader(layer)    # applies this layer's routing
    # a source of a fused-state layer, which replays this layer's state with its routing
    self.exports_routing = any(cfg.shares_state(i) and layer in sum(cfg.kv_sources(i), ())
                               for i in range(cfg.num_layers))
    if self.softcap is not None:  # the family's cap, so that the window equals its attention
      if self.options.logit_softcap not in (None, self.softcap):
        raise ValueError(f"layer {layer}: kvm.logit_softcap={self.options.logit_softcap} "
                         f"differs from the {cfg.family!r} family's attention soft-cap "
                         f"{self.softcap}; leave it None (the layer takes the family's).")
      self.options = dataclasses.replace(self.options, logit_softcap=self.softcap)
    kc = self.options
    # The op zeroes the leading state_zeroed_dims channels of state keys, counting rotary pairs
    # fastest first: a family whose RoPE pairs channels otherwise shows q and k to the op in that
    # order (scores do not depend on the order of channels, so nothing else changes). Zeroing all
    # rotary channels or none needs no order.
    self.channel_order = None
    if kc.state_zeroed_dims not in (0, kc.rope_dims):
      order = self.family.state_channel_order(cfg, layer)
      if order is not None and cfg.kv_sharing != "none":
        raise ValueError(f"kvm.state_rope_dims={kc.state_rope_dims} in the {cfg.family!r} "
                         "family reorders the KVM layers' q/k channels, which cross-layer KV "
                         f"sharing (kv_sharing={cfg.kv_sharing!r}) would mix with other layers' "
                         "order; use kv_sharing='none' or state_rope_dims=None.")
      self.channel_order = None if order is None else tuple(int(i) for i in order)
    if not self.shares_state:  # a fused state is built by the sources' LN_s and gates
      self.ln_s = layer_norm(cfg, cfg.qk_head_dim, rngs)
      if kc.uses_gate:
        self.key_weighting = linear(cfg, cfg.hidden_size, cfg.kv_heads, rngs)
    if kc.head_temperatures:
      self.window_temperature = nnx.Param(jnp.ones((cfg.num_heads,), cfg.jnp_param_dtype))
      self.state_temperature = nnx.Param(jnp.ones((cfg.num_heads,), cfg.jnp_param_dtype))

  def kvm_params(self) -> KVMParams:
    """The layer's KVM parameters; temperatures are ones when the config disables them (a layer
    with a fused state has no LN_s of its own: identity placeholders)."""
    if self.options.head_temperatures:
      window_temp, state_temp = self.window_temperature[...], self.state_temperature[...]
    else:
      window_temp = state_temp = jnp.ones((self.cfg.num_heads,), jnp.float32)
    if self.shares_state:
      D = self.cfg.qk_head_dim
      ln_scale, ln_bias = jnp.ones((D,), jnp.float32), jnp.zeros((D,), jnp.float32)
    else:
      ln_scale, ln_bias = self.ln_s.scale[...], self.ln_s.bias[...]
    return KVMParams(ln_scale=ln_scale, ln_bias=ln_bias, window_temperature=window_temp,
                     state_temperature=state_temp)

  def merge_gate(self, x: Array) -> Array:
    """g = 1 + ELU(x W_g) ``[B, T, Hkv]`` float32 (ones when both gate flags are off)."""
    if not self.options.uses_gate:
      return jnp.ones((*x.shape[:2], self.cfg.kv_heads), jnp.float32)
    return 1.0 + jax.nn.elu(self.key_weighting(x).astype(jnp.float32))

  def init_cache(self, batch: int, max_len: int) -> Optional[KVMCache]:
    if self.shares_state:
      return None  # reads the sources' states and windows
    cache = kvm_init_cache(self.options, **self._cache_sizes(batch, max_len))
    return cache if self.sources is None else kv_sharing.without_window_kv(cache)

  def backend(self, readout: str = "auto") -> KVMBackend:
    """The op's backend for this layer, decided where it runs (the kernels' mesh axes are those
    of the enclosing ``kernel_sharding``): the model's ``kvm_implementation`` for its options."""
    return resolve_kvm_backend(self.options, implementation=self.cfg.kvm_implementation,
                               readout=readout)

  def kvm_core(self, q, k, v, g, params, mixer_cache, decode, routing=None,
               return_routing=False):
    """The KVM op over this layer's (or fused) keys and values with merge gates ``g`` and
    ``params``: whole sequence, prefill into ``mixer_cache``, or one decode step. Returns
    ``(y, cache, decisions or None)``."""
    if is_resume(decode):  # the XLA chunk scan, whatever the model's implementation
      y, cache = kvm_resume(q, k, v, g, params, self.options, mixer_cache,
                            counts=piece_counts(decode))
      return y, cache, None
    kw = dict(routing=routing, return_routing=return_routing, backend=self.backend())
    if decode:
      out = kvm_decode_step(q, k, v, g, params, self.options, mixer_cache,
                            active=step_active(decode), **kw)
    elif mixer_cache is not None:
      out = kvm_prefill(q, k, v, g, params, self.options, mixer_cache, **kw)
    else:  # a whole sequence keeps no cache
      out = kvm_attention(q, k, v, g, params, self.options, **kw)._replace(state=None)
    return out[0], out[1], getattr(out, "routing", None)  # (y, state or cache, routing)

  def kvm_documents(self, q, k, v, g, params, documents, routing=None):
    """The KVM op over packed documents (each as if alone): ``y [B, T, H, Dv]``."""
    # Each document's own id (its number in the row): the op rebuilds the same documents.
    segment_ids = documents.segment_ids()
    return kvm_attention(q, k, v, g, params, self.options, segment_ids=segment_ids,
                         backend=self.backend(readout="own"), routing=routing,
                         return_routing=self.exports_routing).y

  def mix_own(self, x, q, k, v, mixer_cache, decode, shared, documents=None):
    """A storage layer: its own K/V and state, possibly following a leader's routing."""
    routing = None
    if self.routing_leader is not None:
      routing = shared.exports[self.routing_leader]["routing"]
    g, params = self.merge_gate(x), self.kvm_params()
    if self.channel_order is not None:
      order = jnp.asarray(self.channel_order, jnp.int32)
      q, k = jnp.take(q, order, axis=-1), jnp.take(k, order, axis=-1)
    if documents is not None:
      return Mixed(self.kvm_documents(q, k, v, g, params, documents, routing), None, {
          "k": k, "v": v, "g": g, "params": params, "cache": None})
    y, mixer_cache, decisions = self.kvm_core(q, k, v, g, params, mixer_cache, decode, routing,
                                              self.exports_routing)
    exports = {"k": k, "v": v, "g": g, "params": params, "cache": mixer_cache}
    if self.exports_routing:
      exports["routing"] = decisions
    return Mixed(y, mixer_cache, exports)

  def mix_reconstructed(self, x, q, mixer_cache, decode, shared, documents=None):
    if self.shares_state:
      if documents is not None:
        raise ValueError("segment_ids: kvm_kv_sharing='shared_routing' replays one routing over "
                         "whole rows and cannot keep packed documents apart; use "
                         "kvm_kv_sharing='window' (or packing 'pad'/'cram').")
      return Mixed(kv_sharing.mix_kvm_shared_state(self, q, shared, decode), None, {})
    y, mixer_cache = kv_sharing.mix_kvm_window_fusion(self, x, q, shared, mixer_cache, decode,
                                                      documents)
    return Mixed(y, mixer_cache, {})
