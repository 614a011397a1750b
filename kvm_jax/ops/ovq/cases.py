"""The case matrix of the OVQ checks and its input builder, shared by the tests
(``tests/ops/ovq/test_ovq.py``) and ``kvm-check``.

Each case is tagged with the checks that use it: ``oracle`` (scan against the oracle: outputs and
final dictionary), ``grad`` (gradients too), ``check-small`` / ``check-paper`` (``kvm-check``).
Error metric and tolerances are the KVM checks' (:mod:`kvm_jax.ops.kvm.cases`): the paths sum the
same terms in different orders, a few float32 ulps per operation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvm_jax.ops.ovq.config import OVQConfig

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Case:
  """One configuration and input shape of the OVQ op."""

  name: str
  cfg: OVQConfig
  seq_len: int = 45
  batch: int = 2
  heads: int = 2
  head_dim: int = 8
  value_dim: int = 6
  row_update: str = "auto"          # the platform's (scatter on CPU, one-hot elsewhere)
  tags: frozenset = frozenset({"oracle"})

  def inputs(self, seed: int = 0) -> tuple[Array, Array, Array, Array]:
    """L2-normalized q, k ``[B, T, H, D]``, v ``[B, T, H, Dv]`` float32 and beta ``[H]`` in
    (0.5, 1.5)."""
    rng = np.random.default_rng(seed)
    B, T, H = self.batch, self.seq_len, self.heads
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.normal(size=(B, T, H, self.head_dim)))
    k = unit(rng.normal(size=(B, T, H, self.head_dim)))
    v = rng.normal(size=(B, T, H, self.value_dim))
    beta = rng.uniform(0.5, 1.5, H)
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, beta))


def _tags(*names: str) -> frozenset:
  return frozenset(names)


_PAPER_FLAGS = OVQConfig(chunk_size=8, max_centroids=12)
CASES = (
    # the paper's flags; 45 tokens: the dictionary grows 0, 4, 6, 8, 8, 9, a ragged last chunk
    Case("paper_flags", _PAPER_FLAGS, tags=_tags("oracle", "grad", "check-small")),
    # every switch of the authors' config at once
    Case("all_switches", OVQConfig(chunk_size=8, max_centroids=12, min_state_size=True,
                                   count_bias=False, normalize_centroids=True, delta_rule=True),
         tags=_tags("oracle", "grad")),
    Case("delta_rule_with_counts", dataclasses.replace(_PAPER_FLAGS, delta_rule=True),
         tags=_tags("oracle", "grad")),
    Case("normalized", dataclasses.replace(_PAPER_FLAGS, normalize_centroids=True),
         tags=_tags("oracle", "grad")),
    Case("counts_for_rates_only", dataclasses.replace(_PAPER_FLAGS, count_bias=False),
         tags=_tags("oracle", "grad")),
    # the dictionary reaches max_centroids and stays there; whole chunks only
    Case("full_dictionary", OVQConfig(chunk_size=4, max_centroids=6, min_state_size=True),
         seq_len=32, tags=_tags("oracle", "grad")),
    Case("shorter_than_a_chunk", _PAPER_FLAGS, seq_len=5),
    Case("onehot_rows", _PAPER_FLAGS, row_update="onehot", tags=_tags("oracle", "grad")),
    Case("scatter_rows", _PAPER_FLAGS, row_update="scatter", tags=_tags("oracle", "grad")),
    # the paper's layer: chunks of 256, up to 1024 centroids, head dim 128
    Case("paper", OVQConfig(), seq_len=2048, batch=1, heads=2, head_dim=128, value_dim=128,
         tags=_tags("check-paper")),
)


def select(tag: str) -> list[Case]:
  """The cases carrying ``tag``."""
  return [c for c in CASES if tag in c.tags]


def get(name: str) -> Case:
  return next(c for c in CASES if c.name == name)
