"""The RWKV-7 recurrence chunk-parallel: matrices within a chunk, one ``lax.scan`` step per chunk.

Within a chunk of L tokens (positions t = 1…L, state ``h_0 = Sᵀ`` at its start, ``g_t`` the
cumulative log decay up to and including t, ``Γ_t = diag(exp g_t)``) the recurrence
``h_t = diag(exp w_t) h_{t-1} + b_t (a_tᵀ h_{t-1}) + k_t v_tᵀ`` unrolls to

    h_t = Γ_t h_0 + Σ_{s≤t} Γ_t Γ_s⁻¹ (b_s u_sᵀ + k_s v_sᵀ),      u_t = h_{t-1}ᵀ a_t,

so the "pseudo-values" u solve one unit lower-triangular system (the WY form of the product of
the chunk's transitions; :func:`solve_unit_lower`, by substitution)::

    (I - A_ab) U = Ã h_0 + A_ak V,   A_ab[t, s] = ã_t·b̂_s,  A_ak[t, s] = ã_t·k̂_s   (s < t)

with ``ã_t = Γ_{t-1} a_t``, ``b̂_s = Γ_s⁻¹ b_s``, ``k̂_s = Γ_s⁻¹ k_s``; then

    O   = R̃ h_0 + M_rb U + M_rk V,       M_rb[t, s] = r̃_t·b̂_s,  M_rk[t, s] = r̃_t·k̂_s  (s ≤ t)
    h_L = Γ_L h_0 + (Γ_L B̂)ᵀ U + (Γ_L K̂)ᵀ V,   r̃_t = Γ_t r_t.

Everything that does not involve ``h_0`` (the four matrices, the solve, ``M_rk V``) is computed
for all chunks at once; the scan carries only ``h`` (float32) through four products per chunk.
The factors ``Γ_{t-1}`` and ``Γ_s⁻¹`` of the pairwise products are taken relative to the middle of
the chunk, so their exponents stay within ``L/2 · max|w|`` (RWKV-7's decay keeps ``|w| < e^-½``:
at most 19.4 for L = 64, far inside float32's range; :data:`MAX_CHUNK`).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from kvm_jax.ops.documents import documents

Array = jax.Array
_HI = jax.lax.Precision.HIGHEST
#: The longest chunk whose decay factors float32 holds for RWKV-7's decays (``|w| < e^-½``):
#: within a chunk they reach e^±(L/2 · e^-½), 77.6 at L = 256, and exp overflows past 88.7.
MAX_CHUNK = 256


def _chunked(x: Array, L: int) -> Array:
  """``[B, T, H, d]`` (T a multiple of L) -> ``[N, B, H, L, d]`` float32."""
  B, T, H, d = x.shape
  x = x.astype(jnp.float32).reshape(B, T // L, L, H, d)
  return jnp.transpose(x, (1, 0, 3, 2, 4))


def _forward_substitution(A: Array, rhs: Array) -> Array:
  """``U`` with ``(I - A) U = rhs``, row by row: ``U_t = rhs_t + Σ_{s<t} A[t, s] U_s``
  (``A [..., L, L]`` strictly lower, ``rhs [..., L, d]``)."""
  def row(t, U):
    u_t = rhs[..., t, :] + jnp.einsum("...s,...sd->...d", A[..., t, :], U, precision=_HI)
    return U.at[..., t, :].set(u_t)
  return jax.lax.fori_loop(0, A.shape[-1], row, jnp.zeros_like(rhs))


def _backward_substitution(A: Array, G: Array) -> Array:
  """``X`` with ``(I - A)ᵀ X = G``, from the last row up: ``X_t = G_t + Σ_{s>t} A[s, t] X_s``."""
  L = A.shape[-1]

  def row(i, X):
    t = L - 1 - i
    x_t = G[..., t, :] + jnp.einsum("...s,...sd->...d", A[..., :, t], X, precision=_HI)
    return X.at[..., t, :].set(x_t)
  return jax.lax.fori_loop(0, L, row, jnp.zeros_like(G))


@jax.custom_vjp
def solve_unit_lower(A: Array, rhs: Array) -> Array:
  """``(I - A)⁻¹ rhs`` for strictly lower triangular ``A [..., L, L]``, by forward substitution.

  Substitution is the stable way: the inverse's power series ``I + A + A² + …`` (or its product
  form) cancels terms as large as binomial coefficients when A's entries approach ±1, which the
  time mix produces for runs of similar keys. XLA's own triangular solve is avoided: on CPU its
  LAPACK call hung the backward pass of a 32-sequence batch. The VJP is one more substitution,
  transposed: ``d rhs = (I - A)⁻ᵀ dU``, ``dA = tril(d rhs · Uᵀ, -1)``; nothing per row is kept."""
  return _forward_substitution(A, rhs)


def _solve_fwd(A, rhs):
  U = _forward_substitution(A, rhs)
  return U, (A, U)


def _solve_bwd(residuals, dU):
  A, U = residuals
  d_rhs = _backward_substitution(A, dU)
  L = A.shape[-1]
  d_A = jnp.where(jnp.tril(jnp.ones((L, L), bool), -1),
                  jnp.einsum("...td,...sd->...ts", d_rhs, U, precision=_HI), 0.0)
  return d_A, d_rhs


solve_unit_lower.defvjp(_solve_fwd, _solve_bwd)


def _intra_chunk(r, w, k, v, a, b, docs=None):
  """The parts of every chunk that do not depend on the state entering it (all ``[..., L, ·]``,
  float32; leading axes are chunks, batch, heads).

  ``docs``: packed documents, ``(same [..., L, L], carries [..., L, 1], last [..., L, 1])``
  (float 0/1): token pairs of one document, tokens whose document began before the chunk (they
  read the entering state) and tokens of the chunk's last document (they make the leaving one).
  Masking the pair matrices by document splits the chunk's triangular system into one per
  document, which is each document's recurrence started from zero."""
  L = w.shape[-2]
  g = jnp.cumsum(w, axis=-2)                     # log decay from the chunk's start through t
  g_before = g - w                               # ... through t - 1
  g_last = g[..., -1:, :]
  mid = g[..., L // 2 - 1:L // 2, :]
  a_rel = a * jnp.exp(g_before - mid)            # ã relative to the middle
  r_rel = r * jnp.exp(g - mid)
  b_rel, k_rel = b * jnp.exp(mid - g), k * jnp.exp(mid - g)
  dot = lambda x, y: jnp.einsum("...td,...sd->...ts", x, y, precision=_HI)
  strict = jnp.tril(jnp.ones((L, L), bool), -1)
  causal = jnp.tril(jnp.ones((L, L), bool))
  A_ab = jnp.where(strict, dot(a_rel, b_rel), 0.0)
  A_ak = jnp.where(strict, dot(a_rel, k_rel), 0.0)
  M_rb = jnp.where(causal, dot(r_rel, b_rel), 0.0)
  M_rk = jnp.where(causal, dot(r_rel, k_rel), 0.0)
  reads_state = a * jnp.exp(g_before)
  r_decayed = r * jnp.exp(g)
  K = w.shape[-1]
  to_end = jnp.exp(g_last - g)                   # decay from t to the chunk's end (<= 1)
  b_to_end, k_to_end, decay = b * to_end, k * to_end, jnp.exp(g_last)[..., 0, :]
  if docs is not None:
    same, carries, last = docs
    A_ab, A_ak, M_rb, M_rk = (x * same for x in (A_ab, A_ak, M_rb, M_rk))
    reads_state, r_decayed = reads_state * carries, r_decayed * carries
    b_to_end, k_to_end = b_to_end * last, k_to_end * last
    decay = decay * carries[..., -1, :]          # the entering state survives only if one
                                                 # document spans the whole chunk
  rhs = jnp.concatenate([reads_state,
                         jnp.einsum("...ts,...sv->...tv", A_ak, v, precision=_HI)], axis=-1)
  solved = solve_unit_lower(A_ab, rhs)
  return dict(
      u_from_state=solved[..., :K],              # U = u_from_state @ h_0 + u_own
      u_own=solved[..., K:],
      r_decayed=r_decayed,
      M_rb=M_rb,
      o_own=jnp.einsum("...ts,...sv->...tv", M_rk, v, precision=_HI),
      decay=decay,                               # [..., K]
      b_to_end=b_to_end,
      k_to_end=k_to_end, v=v)


def _chunk_step(h, chunk):
  U = jnp.einsum("bhtk,bhkv->bhtv", chunk["u_from_state"], h, precision=_HI) + chunk["u_own"]
  o = (jnp.einsum("bhtk,bhkv->bhtv", chunk["r_decayed"], h, precision=_HI)
       + jnp.einsum("bhts,bhsv->bhtv", chunk["M_rb"], U, precision=_HI) + chunk["o_own"])
  h = (chunk["decay"][..., None] * h
       + jnp.einsum("bhtk,bhtv->bhkv", chunk["b_to_end"], U, precision=_HI)
       + jnp.einsum("bhsk,bhsv->bhkv", chunk["k_to_end"], chunk["v"], precision=_HI))
  return h, o


def _document_masks(segment_ids: Array, T: int, L: int):
  """The ``docs`` of :func:`_intra_chunk` for ``segment_ids [B, T]``, chunked like the inputs
  (``[N, B, 1, L, ·]``). Tokens padded after T continue the last token's document (they change
  no state)."""
  d = documents(segment_ids)
  pad = -T % L
  edge = lambda x: jnp.pad(x, [(0, 0), (0, pad)], mode="edge")  # noqa: E731
  index, start = edge(d.index), edge(d.start)
  B, Tp = index.shape
  N = Tp // L
  index = jnp.transpose(index.reshape(B, N, L), (1, 0, 2))[:, :, None]          # [N, B, 1, L]
  start = jnp.transpose(start.reshape(B, N, L), (1, 0, 2))[:, :, None]
  chunk_start = (jnp.arange(N) * L)[:, None, None, None]
  same = (index[..., :, None] == index[..., None, :]).astype(jnp.float32)
  # The row's first document reads the initial state; every other document starts from zero.
  carries = ((start < chunk_start) | (start == 0)).astype(jnp.float32)[..., None]
  last = (index == index[..., -1:]).astype(jnp.float32)[..., None]
  return same, carries, last


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def rwkv7_recurrence(r: Array, w: Array, k: Array, v: Array, a: Array, b: Array,
                     initial_state: Optional[Array] = None, chunk_size: int = 64,
                     segment_ids: Optional[Array] = None) -> tuple[Array, Array]:
  """The RWKV-7 recurrence of
  :func:`~kvm_jax.ops.rwkv7.reference.rwkv7_recurrence_reference`, chunk-parallel.

  Args:
    r, w, k, a, b: ``[B, T, H, Dk]`` (``w`` the log decay, ≤ 0); v: ``[B, T, H, Dv]``.
    initial_state: ``h = Sᵀ`` ``[B, H, Dk, Dv]`` before the first token (zeros when None).
    chunk_size: L, tokens per chunk (even, 2 to :data:`MAX_CHUNK`; 64 by default). The
      sequential depth falls with larger chunks, the work within a chunk grows as L². The decay
      factors reach e^±(L/2 · max|w|): with decays stronger than RWKV-7's (``|w| < e^-½``) keep
      L·max|w| below about 170.
    segment_ids: ``[B, T]`` int, packed documents (0 = padding, each maximal run of one nonzero
      id a document): the state restarts from zero at every document's first token, so each
      document's outputs are its own alone (``initial_state`` then reaches only a document that
      begins the row). The final state is the one after the row's last token.

  Returns:
    ``o [B, T, H, Dv]`` in ``v``'s dtype and the final state ``[B, H, Dk, Dv]`` float32.
  """
  if not 2 <= chunk_size <= MAX_CHUNK or chunk_size % 2:
    raise ValueError(f"chunk_size must be an even int in [2, {MAX_CHUNK}], got {chunk_size} "
                     "(larger chunks overflow float32 in the decay factors).")
  validate_inputs(r, w, k, v, a, b, initial_state)
  B, T, H, K = r.shape
  V = v.shape[-1]
  L = chunk_size
  if segment_ids is not None:
    # Padding tokens become no-ops (no decay, no key, no removal), so that what they hold
    # cannot reach the decay factors their chunk shares with its documents, even by rounding.
    real = (segment_ids != 0)[:, :, None, None]
    w, k, a, b = (jnp.where(real, x, 0.0) for x in (w, k, a, b))
  pad = -T % L
  if pad:  # w = 0 (no decay) and a = b = k = 0 leave the state unchanged through the padding
    widen = lambda x: jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)])
    r, w, k, v, a, b = map(widen, (r, w, k, v, a, b))
  docs = None if segment_ids is None else _document_masks(segment_ids, T, L)
  parts = _intra_chunk(*map(lambda x: _chunked(x, L), (r, w, k, v, a, b)), docs)
  h = (jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None
       else initial_state.astype(jnp.float32))
  # The step is rematerialized in the backward pass: only the state entering each chunk is kept.
  h, o = jax.lax.scan(jax.checkpoint(_chunk_step), h, parts)               # o: [N, B, H, L, V]
  o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(B, T + pad, H, V)[:, :T]
  return o.astype(v.dtype), h


def validate_inputs(r: Array, w: Array, k: Array, v: Array, a: Array, b: Array,
                    state: Optional[Array] = None, token: bool = False) -> None:
  """Shape checks of the public functions: r, w, k, a, b ``[B, T, H, Dk]`` (``token``: one token,
  ``[B, H, Dk]``), v with the same leading axes and its own last one, the state
  ``[B, H, Dk, Dv]``."""
  lead = r.shape[:-1]
  what = "[B, H, Dk]" if token else "[B, T, H, Dk]"
  if r.ndim != (3 if token else 4) or any(x.shape != r.shape for x in (w, k, a, b)):
    raise ValueError(f"r, w, k, a, b must share one shape {what}; got "
                     f"{[tuple(x.shape) for x in (r, w, k, a, b)]}.")
  if v.shape[:-1] != lead:
    raise ValueError(f"v must be {what[:-3]}Dv] with the leading axes of r {tuple(lead)}, got "
                     f"{tuple(v.shape)}.")
  B, H, K = r.shape[0], r.shape[-2], r.shape[-1]
  if state is not None and state.shape != (B, H, K, v.shape[-1]):
    raise ValueError(f"the state must be [B, H, Dk, Dv] = {[B, H, K, v.shape[-1]]}, got "
                     f"{list(state.shape)}.")


def rwkv7_step(r: Array, w: Array, k: Array, v: Array, a: Array, b: Array, state: Array
               ) -> tuple[Array, Array]:
  """One token: inputs ``[B, H, Dk]`` (``v`` ``[B, H, Dv]``) and ``h [B, H, Dk, Dv]`` -> the
  output ``[B, H, Dv]`` (``v``'s dtype) and the next state (float32)."""
  validate_inputs(r, w, k, v, a, b, state, token=True)
  f32 = lambda x: x.astype(jnp.float32)
  r, w, k, v32, a, b = map(f32, (r, w, k, v, a, b))
  h = state.astype(jnp.float32)
  h_a = jnp.einsum("bhkv,bhk->bhv", h, a, precision=_HI)
  h = (jnp.exp(w)[..., None] * h + b[..., None] * h_a[:, :, None, :]
       + k[..., None] * v32[:, :, None, :])
  return jnp.einsum("bhkv,bhk->bhv", h, r, precision=_HI).astype(v.dtype), h
