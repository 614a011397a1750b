"""The RWKV-7 oracle: the generalized delta rule one token at a time, exactly as written.

Per (batch, head), with the state ``S [Dv, Dk]``::

    S_t = S_{t-1} (diag(exp w_t) + a_t b_tᵀ) + v_t k_tᵀ,      o_t = S_t r_t

``w`` is the log decay (≤ 0), the scale is 1 (flash-linear-attention's ``chunk_rwkv7`` contract;
the RWKV-7 time mix passes ``a = -kk``, ``b = kk·a``). The state is held transposed, ``h = Sᵀ``
``[B, H, Dk, Dv]`` (flash-linear-attention's layout), in float32. One ``lax.scan`` step per token:
the yardstick of the chunked form and the decode step, sharing none of their arithmetic.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array
_HI = jax.lax.Precision.HIGHEST


def rwkv7_recurrence_reference(r: Array, w: Array, k: Array, v: Array, a: Array, b: Array,
                               initial_state: Optional[Array] = None) -> tuple[Array, Array]:
  """Outputs ``[B, T, H, Dv]`` (``v``'s dtype) and the final state ``h [B, H, Dk, Dv]`` float32.

  ``r, w, k, a, b``: ``[B, T, H, Dk]``; ``v``: ``[B, T, H, Dv]``; ``initial_state``: ``h`` before
  the first token (zeros when None)."""
  B, T, H, K = r.shape
  V = v.shape[-1]
  h = (jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None
       else initial_state.astype(jnp.float32))
  per_token = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)          # [T, B, H, ·]

  def step(h, inputs):
    r_t, w_t, k_t, v_t, a_t, b_t = inputs
    h_a = jnp.einsum("bhkv,bhk->bhv", h, a_t, precision=_HI)               # Sa
    h = (jnp.exp(w_t)[..., None] * h + b_t[..., None] * h_a[:, :, None, :]
         + k_t[..., None] * v_t[:, :, None, :])
    return h, jnp.einsum("bhkv,bhk->bhv", h, r_t, precision=_HI)

  h, o = jax.lax.scan(step, h, tuple(map(per_token, (r, w, k, v, a, b))))
  return jnp.moveaxis(o, 0, 1).astype(v.dtype), h
