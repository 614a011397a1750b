"""KVM decode attention as a flash-decoding Pallas kernel.

One query token per sequence attends to the readout state rows and to the exact-window ring, read
where they live:

* state keys/values ``[B, Hkv, R, D]`` (head-major), rows ``r < num_rows`` visible once
  ``t >= L``;
* the ring ``[B, L, Hkv, D]`` (time-major, slot = position mod L), viewed (a free reshape) as
  ``[B, L, Hkv·D]``: a block ``(slots, D)`` at column-block ``h`` is KV head h (on TPU D tiles the
  lane dimension; on Triton it is a strided load). Slot j is visible iff its position is at least
  ``window_begin = max(0, (t // C + 1)·C - L)``.

The grid is ``(B, Hkv, S)``: program ``(b, h, s)`` takes split s of the state rows and split s of
the ring slots, loads the G query heads of KV head h once (every K/V row is read once for the
whole group), and runs an online softmax over its key blocks with a ``fori_loop`` whose bounds
come from ``num_rows`` and ``t``: blocks of state rows past ``num_rows`` (all of them while
``t < L``) and ring blocks holding no written position are never visited; the block that straddles
a bound is masked. It writes a partial ``(max, sum, acc)``; a few XLA ops merge the S partials.

Backends: on TPU the bounds are scalar-prefetch operands (SMEM), and the index maps of skipped
splits repeat the previous block so the pipeline fetches nothing for them. Triton has no scalar
prefetch: the bounds are a small int32 input, and the loads are masked (rows past a bound or past
the array are neither read nor used). Elsewhere (TPU, interpret) the values of rows that are not
visible are zeroed after a plain load (a TPU edge block holds undefined data). Interpret mode
runs the body of the platform it is configured for (``KernelConfig.for_target("tpu"/"cuda",
interpret=True)``: scalar prefetch / masked loads), of the CPU a plain-load body. float32
matmuls use ``Precision.HIGHEST`` (IEEE float32 on Triton, not TF32); bfloat16 operands
accumulate in float32. The temperatures (times 1/sqrt(D)) scale the float32 scores, so one dot
serves the G heads of a group.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from kvm_jax.kernels import backend
from kvm_jax.kernels.sharding import per_shard
from kvm_jax.ops.common import MASKED

Array = jax.Array

# Per-program working-set budget on GPU (shared memory + registers the tiles occupy).
GPU_WORKING_SET = 100 * 1024
# Key rows one program aims at (state rows + ring slots of its split).
_ROWS_PER_SPLIT = {"gpu": 512, "tpu": 1024, "cpu": 512}
_MAX_SPLITS = 16
_NUM_BOUNDS = 8  # int32 scalars handed to the kernel (a power of two for Triton)


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _round_up(a: int, b: int) -> int:
  return _cdiv(a, b) * b


def _pow2_ceil(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _div(a, b: int):
  """``a // b`` for non-negative traced ``a``: a truncating division (Mosaic has no ``sign``,
  which ``jnp.floor_divide`` needs)."""
  return jax.lax.div(a, jnp.asarray(b, jnp.int32))


def _platform(p: str) -> str:
  return "gpu" if p in ("gpu", "cuda", "triton") else ("tpu" if p == "tpu" else "cpu")


def _stream_bytes(block: int, D: int, Dv: int, itemsize: int) -> int:
  """One K block and one V block."""
  return block * (D + Dv) * itemsize


def _loop_bytes(Gp: int, block: int, D: int, Dv: int, q_isz: int, kv_isz: int,
                stages: int) -> int:
  """One loop over key blocks (GPU / interpret): the query tile, ``stages`` copies of a K and a V
  block, the float32 score tile, the float32 accumulator, max, sum and two scales."""
  return (Gp * D * q_isz + stages * _stream_bytes(block, D, Dv, kv_isz) + Gp * block * 4
          + Gp * Dv * 4 + 4 * Gp * 4)


def working_set_bytes(blocks: dict, D: int, Dv: int, dtype, platform: str,
                      state_dtype=jnp.float32) -> int:
  """Bytes one program holds at once with ``blocks`` (:func:`decode_blocks`).

  GPU (Triton, ``num_stages=2``): the query tile, two stages of (K block, V block), the float32
  score tile, the float32 accumulator and the per-row max/sum/scales; the state and ring loops
  run one after the other, so the larger of the two counts. TPU: every BlockSpec block twice
  (the pipeline double-buffers them: query, scales, the split's state and ring K/V, the three
  outputs), padded to whole (sublane, lane) tiles, plus the in-loop temporaries (three float32
  score-sized tiles, the accumulator, a cast K block and a masked V block). CPU (interpret): the
  GPU count with one stage.
  """
  p = _platform(platform)
  Gp = blocks["g_pad"]
  q_isz, s_isz = jnp.dtype(dtype).itemsize, jnp.dtype(state_dtype).itemsize
  f32 = jnp.float32
  if p == "tpu":
    Rs, Ls = blocks["state_split"], blocks["window_split"]
    step = max(blocks["state_block"], blocks["window_block"])
    pipelined = [((Gp, D), dtype), ((Gp, 1), f32), ((Gp, 1), f32), ((Rs, D), state_dtype),
                 ((Rs, Dv), state_dtype), ((Ls, D), dtype), ((Ls, Dv), dtype), ((Gp, 1), f32),
                 ((Gp, 1), f32), ((Gp, Dv), f32)]
    temporaries = [((Gp, step), f32)] * 3 + [((Gp, Dv), f32), ((step, D), dtype),
                                             ((step, Dv), f32)]
    return backend.tpu_vmem(pipelined, temporaries)
  stages = 2 if p == "gpu" else 1
  return max(_loop_bytes(Gp, blocks["state_block"], D, Dv, q_isz, s_isz, stages),
             _loop_bytes(Gp, blocks["window_block"], D, Dv, q_isz, q_isz, stages))


def decode_blocks(R: int, L: int, G: int, D: int, Dv: int, dtype, platform: str,
                  state_dtype=jnp.float32) -> dict:
  """Static tiling of the decode kernel (a pure function of the sizes).

  Args:
    R: state rows (capacity); L: ring slots; G: query heads per KV head; D / Dv: key / value dims;
    dtype: the query and ring dtype; platform: "gpu"/"cuda", "tpu" or "cpu";
    state_dtype: the readout state's dtype (float32).
  Returns:
    ``splits`` (S, the third grid dimension), ``g_pad`` (query rows per program),
    ``state_split`` / ``window_split`` (rows and slots per split: the BlockSpec block),
    ``state_block`` / ``window_block`` (rows per loop step), and ``working_set_bytes``.
  """
  p = _platform(platform)
  q_isz, s_isz = jnp.dtype(dtype).itemsize, jnp.dtype(state_dtype).itemsize
  if p == "gpu":
    Gp = max(16, _pow2_ceil(G))  # Triton: power-of-two tiles, matmul operands of >= 16 rows

    def block_for(isz):  # the largest power-of-two block whose loop fits the budget
      return next((b for b in (128, 64, 32)
                   if _loop_bytes(Gp, b, D, Dv, q_isz, isz, stages=2) <= GPU_WORKING_SET), 16)

    state_block, window_block = block_for(s_isz), block_for(q_isz)
  else:
    # TPU: whole sublane tiles of query rows (Mosaic picks an (8, 128) layout for the q tile).
    Gp = _round_up(G, 8) if p == "tpu" else G
    state_block = window_block = 128  # a lane tile of the score tile on TPU
  S = max(1, min(_MAX_SPLITS, _cdiv(R + L, _ROWS_PER_SPLIT[p])))

  def split(n, block):
    rows = _round_up(_cdiv(n, S), block)
    if p == "gpu":
      return rows, block          # Triton: masked loads, a split may run past the array
    if rows >= n:                 # whole array: a legal block of any size
      return n, (block if n % block == 0 else n)
    return rows, block

  state_split, state_block = split(R, state_block)
  window_split, window_block = split(L, window_block)
  S = max(_cdiv(R, state_split), _cdiv(L, window_split))
  blocks = dict(splits=S, g_pad=Gp, state_split=state_split, state_block=state_block,
                window_split=window_split, window_block=window_block)
  blocks["working_set_bytes"] = working_set_bytes(blocks, D, Dv, dtype, p, state_dtype)
  return blocks


def decode_bytes(R_valid: int, L: int, B: int, Hkv: int, G: int, D: int, Dv: int, itemsize: int,
                 *, state_itemsize: int = 4, splits: int = 1, g_pad: Optional[int] = None) -> int:
  """HBM bytes the kernel reads and writes for one decode step.

  Reads the ``R_valid`` visible state rows (keys and values, ``state_itemsize``), all ``L`` ring
  slots (``itemsize``; at most C - 1 of them are masked once the ring is full), the queries and
  the temperatures; writes ``splits`` float32 partials (max, sum, accumulator) per query row.
  Rows are counted exactly (masked Triton loads); TPU DMAs whole split blocks, so there the state
  term is rounded up to the split size. The XLA merge of the partials is not counted.
  """
  Gp = G if g_pad is None else g_pad
  per_head = (R_valid * (D + Dv) * state_itemsize + L * (D + Dv) * itemsize + Gp * D * itemsize
              + splits * Gp * (Dv + 2) * 4)
  return B * Hkv * per_head + 2 * Hkv * Gp * 4


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------


def _decode_kernel(bounds_ref, q_ref, sscale_ref, wscale_ref, sk_ref, sv_ref, wk_ref, wv_ref,
                   m_ref, l_ref, acc_ref, *, blocks: dict, R: int, L: int,
                   kc: backend.KernelConfig):
  s = pl.program_id(2)
  visible_rows = bounds_ref[0]            # state rows visible to this token (0 while t < L)
  t_mod = bounds_ref[1]                   # t mod L: the slot of token t
  lo_this_lap, lo_last_lap = bounds_ref[2], bounds_ref[3]
  ring_lo, ring_hi = bounds_ref[4], bounds_ref[5]

  q = q_ref[...]                          # [Gp, D] the group's query heads
  dtype, value_dtype = q.dtype, wv_ref.dtype
  precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
  mm = kc.for_matmul
  Gp, Dv = q.shape[0], acc_ref.shape[-1]

  def stream(carry, k_ref, v_ref, scale, split, block, begin, end, visible):
    """Online softmax over the blocks of this split that intersect rows [begin, end)."""
    first = s * split
    lo = jnp.clip(begin - first, 0, split)
    hi = jnp.clip(end - first, 0, split)
    whole = block == split                # one block per split: static, unsliced reads

    def body(i, carry):
      m, l, acc = carry
      start = pl.multiple_of(i * block, block)
      rows = slice(None) if whole else pl.ds(start, block)
      idx_col = first + start + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)
      idx_row = first + start + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
      ok_col, ok_row = visible(idx_col), visible(idx_row)
      if kc.platform == "gpu":  # masked rows are not read (and never past the array)
        from jax.experimental.pallas import triton as pltriton
        k = pltriton.load(k_ref.at[rows, :], mask=ok_col, other=0)
        v = pltriton.load(v_ref.at[rows, :], mask=ok_col, other=0)
      else:          # TPU edge blocks hold undefined data: zero the values that are not ours
        k = k_ref[rows, :]
        v = jnp.where(ok_col, v_ref[rows, :], 0)
      sc = jax.lax.dot_general(mm(q), mm(k.astype(dtype)), (((1,), (1,)), ((), ())),
                               precision=precision, preferred_element_type=jnp.float32)
      sc = jnp.where(ok_row, sc * scale, MASKED)
      m_new = jnp.maximum(m, jnp.max(sc, axis=-1, keepdims=True))
      correction = jnp.exp(m - m_new)
      p = jnp.where(ok_row, jnp.exp(sc - m_new), 0.0)
      l = l * correction + jnp.sum(p, axis=-1, keepdims=True)
      pv = jax.lax.dot_general(mm(p.astype(value_dtype)), mm(v.astype(value_dtype)),
                               (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)
      return m_new, l, acc * correction + pv

    return jax.lax.fori_loop(_div(lo, block), _div(hi + block - 1, block), body, carry)

  def state_visible(row):
    return row < visible_rows

  def ring_visible(slot):
    # position(slot) = lap start + slot (slot <= t mod L) or one lap earlier; >= window_begin.
    return (slot < L) & (slot >= jnp.where(slot <= t_mod, lo_this_lap, lo_last_lap))

  carry = (jnp.full((Gp, 1), MASKED, jnp.float32), jnp.zeros((Gp, 1), jnp.float32),
           jnp.zeros((Gp, Dv), jnp.float32))
  carry = stream(carry, sk_ref, sv_ref, sscale_ref[...], blocks["state_split"],
                 blocks["state_block"], 0, visible_rows, state_visible)
  carry = stream(carry, wk_ref, wv_ref, wscale_ref[...], blocks["window_split"],
                 blocks["window_block"], ring_lo, ring_hi, ring_visible)
  m, l, acc = carry
  m_ref[...] = m
  l_ref[...] = l
  acc_ref[...] = acc


def _bounds(num_rows, t, R: int, L: int, C: int) -> Array:
  """The int32 scalars of :func:`_decode_kernel`, computed once in XLA: ``[visible state rows
  (num_rows clipped to R, 0 while t < L), t mod L, lowest visible slot at or before t mod L
  (window_begin - lap start), lowest visible slot after it (one lap earlier: + L), first and end
  ring slot that may be visible (while t < L: [window_begin, t + 1)), 0, 0]``."""
  t = jnp.asarray(t, jnp.int32).reshape(())
  num_rows = jnp.asarray(num_rows, jnp.int32).reshape(())
  window_begin = jnp.maximum(0, (t // C + 1) * C - L)
  t_mod = t % L
  lo_this_lap = window_begin - (t - t_mod)
  full = t >= L
  values = [jnp.where(full, jnp.clip(num_rows, 0, R), 0), t_mod, lo_this_lap, lo_this_lap + L,
            jnp.where(full, 0, jnp.minimum(window_begin, L)), jnp.where(full, L, t + 1)]
  values += [jnp.zeros((), jnp.int32)] * (_NUM_BOUNDS - len(values))
  return jnp.stack(values).astype(jnp.int32)


def ring_view(ring: Array, kc: backend.KernelConfig) -> Array:
  """The ring ``[B, L, Hkv, D]`` as the kernel reads it: ``[B, L, Hkv·D]`` (a free reshape; a
  ``(slots, D)`` block at column block h is KV head h), or, on TPU when D is not a multiple of
  128 lanes, head-major ``[B, Hkv, L, D]`` (a copy of the ring: a TPU block's last dim must be a
  multiple of 128 or the whole array dim, so a 64-wide head cannot be a column block)."""
  b, l, h, d = ring.shape
  if kc.platform == "tpu" and d % 128:
    return jnp.swapaxes(ring, 1, 2)
  return ring.reshape(b, l, h * d)


def _decode_partials(bounds, q, state_scale, window_scale, state_keys, state_values, ring_keys,
                     ring_values, *, blocks: dict, kc: backend.KernelConfig):
  """``(max, sum, acc)`` per split: ``[B, Hkv, S, Gp, 1]`` twice and ``[B, Hkv, S, Gp, Dv]``.

  ``q [B, Hkv, Gp, D]``, scales ``[Hkv, Gp, 1]``, state ``[B, Hkv, R, D|Dv]``, ring
  ``[B, L, Hkv·D]`` / ``[B, L, Hkv·Dv]`` or head-major ``[B, Hkv, L, D|Dv]`` (:func:`ring_view`),
  ``bounds`` int32 ``[8]`` (:func:`_bounds`).
  """
  B, Hkv, Gp, D = q.shape
  R, Dv = state_keys.shape[2], state_values.shape[3]
  head_major_ring = ring_keys.ndim == 4
  L = ring_keys.shape[2 if head_major_ring else 1]
  S = blocks["splits"]
  Rs, Ls = blocks["state_split"], blocks["window_split"]
  n_state, n_ring = _cdiv(R, Rs), _cdiv(L, Ls)
  prefetch = kc.platform == "tpu"

  if prefetch:
    # Splits with nothing to read repeat a neighbour's block index: the pipeline skips the copy.
    def state_split(s, bnd):
      last = jnp.maximum(_div(bnd[0] + Rs - 1, Rs) - 1, 0)
      return jnp.minimum(s, jnp.minimum(last, n_state - 1))

    def ring_split(s, bnd):
      first, last = _div(bnd[4], Ls), jnp.maximum(_div(bnd[5] + Ls - 1, Ls) - 1, 0)
      return jnp.clip(s, first, jnp.minimum(last, n_ring - 1))
  else:
    state_split = lambda s, *_: jnp.minimum(s, n_state - 1)
    ring_split = lambda s, *_: jnp.minimum(s, n_ring - 1)

  def spec(shape, index):
    return pl.BlockSpec(shape, index)

  in_specs = [
      spec((None, None, Gp, D), lambda b, h, s, *_: (b, h, 0, 0)),
      spec((None, Gp, 1), lambda b, h, s, *_: (h, 0, 0)),
      spec((None, Gp, 1), lambda b, h, s, *_: (h, 0, 0)),
      spec((None, None, Rs, D), lambda b, h, s, *a: (b, h, state_split(s, *a), 0)),
      spec((None, None, Rs, Dv), lambda b, h, s, *a: (b, h, state_split(s, *a), 0)),
  ]
  if head_major_ring:
    in_specs += [spec((None, None, Ls, D), lambda b, h, s, *a: (b, h, ring_split(s, *a), 0)),
                 spec((None, None, Ls, Dv), lambda b, h, s, *a: (b, h, ring_split(s, *a), 0))]
  else:
    in_specs += [spec((None, Ls, D), lambda b, h, s, *a: (b, ring_split(s, *a), h)),
                 spec((None, Ls, Dv), lambda b, h, s, *a: (b, ring_split(s, *a), h))]
  part = lambda *tail: spec((None, None, None, Gp, *tail), lambda b, h, s, *_: (b, h, s, 0, 0))
  out_specs = [part(1), part(1), part(Dv)]
  out_shape = [jax.ShapeDtypeStruct((B, Hkv, S, Gp, 1), jnp.float32),
               jax.ShapeDtypeStruct((B, Hkv, S, Gp, 1), jnp.float32),
               jax.ShapeDtypeStruct((B, Hkv, S, Gp, Dv), jnp.float32)]
  kernel = functools.partial(_decode_kernel, blocks=blocks, R=R, L=L, kc=kc)
  vmem = working_set_bytes(blocks, D, Dv, q.dtype, kc.platform, state_keys.dtype)
  operands = (q, state_scale, window_scale, state_keys, state_values, ring_keys, ring_values)
  if prefetch:
    from jax.experimental.pallas import tpu as pltpu
    grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(B, Hkv, S),
                                             in_specs=in_specs, out_specs=out_specs)
  else:
    bounds_spec = spec((_NUM_BOUNDS,), lambda b, h, s: (0,))
    grid_spec = pl.GridSpec(grid=(B, Hkv, S), in_specs=[bounds_spec] + in_specs,
                            out_specs=out_specs)
  return pl.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=out_shape, interpret=kc.interpret,
      compiler_params=kc.compiler_params(3, working_set=backend.WorkingSet("decode", vmem=vmem)),
      name="kvm_decode_attention",
  )(bounds, *operands)


def _merge(m, l, acc):
  """Flash-decoding merge of the split partials (axis 2): ``[B, Hkv, Gp, Dv]`` float32."""
  top = jnp.max(m, axis=2, keepdims=True)
  w = jnp.exp(m - top)                    # splits that saw nothing have l = acc = 0
  return jnp.sum(w * acc, axis=2) / jnp.sum(w * l, axis=2)


def decode_attention_pallas(q_t: Array, state_keys: Array, state_values: Array, num_rows: Array,
                            window_keys: Array, window_values: Array, t: Array, state_temp: Array,
                            window_temp: Array, cfg, *, kc: backend.KernelConfig,
                            blocks: Optional[dict] = None) -> Array:
  """Drop-in for ``kvm_jax.ops.kvm.decode.decode_attention(..., attend=joint_attention)``.

  Args:
    q_t: ``[B, 1, H, D]`` the token's queries (query head ``h·G + g`` of KV head h).
    state_keys / state_values: ``[B, Hkv, R, D]`` / ``[B, Hkv, R, Dv]`` readout state.
    num_rows: int32 scalar, valid state rows (visible once ``t >= L``).
    window_keys / window_values: ``[B, L, Hkv, D]`` / ``[B, L, Hkv, Dv]`` ring (slot = pos mod L)
      with token t already written.
    t: int32 scalar, the token's position.
    state_temp / window_temp: float32 ``[Hkv, G]`` key temperatures.
    cfg: anything with ``chunk_size`` and ``window_len`` (a ``KVMConfig``); static.
    kc: the :class:`backend.KernelConfig` (static).
    blocks: tiling override (:func:`decode_blocks`'s dict); default ``decode_blocks(...)``.
  Returns:
    ``[B, 1, Hkv, G, Dv]`` float32.
  """
  B, _, H, D = q_t.shape
  _, L, Hkv, _ = window_keys.shape
  R, Dv = state_keys.shape[2], window_values.shape[3]
  G = H // Hkv
  if state_values.ndim != 4:
    raise ValueError("the Pallas decode needs shared state values [B, Hkv, R, Dv] "
                     "(readout_value_dtype=None).")
  if L != cfg.window_len or R < 1:
    raise ValueError(f"decode_attention_pallas: ring of {L} slots for window_len="
                     f"{cfg.window_len}, {R} state rows.")
  kc.check_sizes(head_dim=D, value_dim=Dv)
  if blocks is None:
    blocks = decode_blocks(R, L, G, D, Dv, q_t.dtype, kc.platform, state_keys.dtype)
  Gp = blocks["g_pad"]
  if kc.triton:
    bad = {k: blocks[k] for k in ("g_pad", "state_block", "window_block")
           if blocks[k] & (blocks[k] - 1) or blocks[k] < 16}
    if bad:
      raise ValueError(f"Triton needs power-of-two blocks of >= 16 rows, got {bad}.")
  pad = backend.pad_axis
  q = pad(q_t.reshape(B, Hkv, G, D), 2, Gp)                     # free reshape, tiny pad
  scale = 1.0 / np.sqrt(D)
  scales = [pad(x.astype(jnp.float32) * scale, 1, Gp)[..., None]
            for x in (state_temp, window_temp)]               # [Hkv, Gp, 1]
  bounds = _bounds(num_rows, t, R, L, cfg.chunk_size)

  def run(bounds, q, sscale, wscale, sk, sv, wk, wv):
    ring = lambda x: ring_view(x, kc)  # noqa: E731
    m, lsum, acc = _decode_partials(bounds, q, sscale, wscale, sk, sv, ring(wk), ring(wv),
                                    blocks=blocks, kc=kc)
    return _merge(m, lsum, acc)

  # the ring is passed unreshaped ("bth": split on batch and heads) and viewed as [B, L, Hkv·D]
  # inside each shard
  y = per_shard(run, (bounds, q, *scales, state_keys, state_values, window_keys, window_values),
                ("r", "bh", "h", "h", "bh", "bh", "bth", "bth"), "bh", B, Hkv, kc.shard_axes)
  return y[:, None, :, :G]
