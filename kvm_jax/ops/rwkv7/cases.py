"""The case matrix of the RWKV-7 recurrence checks and its input builder, shared by the tests
(``tests/ops/rwkv7/test_rwkv7.py``) and ``kvm-check``.

Inputs are drawn as the time mix makes them: ``w`` in (-e^-½, 0), ``a = -kk`` and ``b = kk·α`` with
``kk`` unit per head and α in (0, 1). Tags: ``oracle`` (chunked form against the per-token oracle),
``grad`` (gradients too), ``check-small`` / ``check-paper`` (``kvm-check``). Error metric and
tolerances are the KVM checks' (:mod:`kvm_jax.ops.kvm.cases`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def time_mix_inputs(B: int = 2, T: int = 150, H: int = 2, K: int = 16, V: int = 12,
                    seed: int = 0, decay_scale: float = 1.0, key_spread: Optional[float] = None,
                    alpha_bias: float = 0.0) -> tuple[Array, ...]:
  """(r, w, k, v, a, b) ``[B, T, H, ·]`` float32 shaped like the time mix's. A larger
  ``decay_scale`` pushes ``w`` toward its bound -e^-½ (a negative one toward 0: no decay);
  ``key_spread`` draws every ``kk`` near one shared direction (None: independent keys) and
  ``alpha_bias`` pushes α toward 1, which together make the transitions ``I - kk kkᵀ α``
  nearly the same projection at every step (the hardest case for the chunk solve)."""
  rng = np.random.default_rng(seed)
  n = lambda *shape: rng.normal(size=shape)
  sigmoid = lambda x: 1 / (1 + np.exp(-x))
  w = -np.exp(-0.5) * sigmoid(2 * n(B, T, H, K) + 2 * decay_scale - 2)
  kk = n(B, T, H, K) if key_spread is None else n(1, 1, H, K) + key_spread * n(B, T, H, K)
  kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
  alpha = sigmoid(n(B, T, H, K) + alpha_bias)
  out = (n(B, T, H, K), w, n(B, T, H, K), n(B, T, H, V), -kk, kk * alpha)
  return tuple(jnp.asarray(x, jnp.float32) for x in out)


@dataclasses.dataclass(frozen=True)
class Case:
  """One shape of the recurrence: ``seq_len`` tokens in chunks of ``chunk_size``, optionally
  from a random initial state."""

  name: str
  seq_len: int
  chunk_size: int
  initial_state: bool = False
  batch: int = 2
  heads: int = 2
  key_dim: int = 16
  value_dim: int = 12
  inputs_kw: tuple = ()              # extra arguments of time_mix_inputs, as (name, value) pairs
  tags: frozenset = frozenset({"oracle"})

  def inputs(self, seed: int = 0) -> tuple[tuple[Array, ...], Optional[Array]]:
    """((r, w, k, v, a, b), initial state ``[B, H, Dk, Dv]`` or None)."""
    x = time_mix_inputs(self.batch, self.seq_len, self.heads, self.key_dim, self.value_dim, seed,
                        **dict(self.inputs_kw))
    h0 = None
    if self.initial_state:
      shape = (self.batch, self.heads, self.key_dim, self.value_dim)
      h0 = jnp.asarray(np.random.default_rng(seed + 100).normal(size=shape), jnp.float32)
    return x, h0


CASES = (
    Case("ragged_tail", 150, 64),
    Case("carried_state", 150, 16, initial_state=True,
         tags=frozenset({"oracle", "grad", "check-small"})),
    Case("one_partial_chunk", 20, 64),
    Case("whole_chunks", 128, 32, tags=frozenset({"oracle", "grad"})),
    Case("chunks_of_two", 9, 2, initial_state=True, tags=frozenset({"oracle", "grad"})),
    # a training batch: the backward pass of 256 chunk systems at once (XLA:CPU's LAPACK
    # triangular solve hung here)
    Case("batch_of_32", 64, 16, batch=32, key_dim=32, value_dim=32,
         tags=frozenset({"oracle", "grad"})),
    # runs of nearly equal keys, α near 1 and no decay: every transition is almost the same
    # projection, the chunk system's entries approach -1 and its inverse's power series would
    # cancel terms up to C(63, 31)
    Case("repeated_keys", 128, 64, inputs_kw=(("decay_scale", -3.0), ("key_spread", 0.05),
                                               ("alpha_bias", 6.0)),
         tags=frozenset({"oracle", "grad"})),
    # the paper's heads: 128 x 128 states
    Case("paper", 2048, 64, batch=1, heads=2, key_dim=128, value_dim=128,
         tags=frozenset({"check-paper"})),
)


def select(tag: str) -> list[Case]:
  """The cases carrying ``tag``."""
  return [c for c in CASES if tag in c.tags]
