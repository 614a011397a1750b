"""``kvm-check --kinds``: the checks every registered mixer kind gets from its class alone.

A kind registered with :func:`kvm_jax.nn.register_mixer` (inside the package or by a
``--plugin``) runs, in a tiny float32 model of its layers with perturbed weights (the output
projections start at zero, which would hide every path):

* **forward vs prefill+decode**: the whole sequence's logits against a prefill of the first
  part and one-token decode steps for the rest (every kind decodes);
* **forward vs prefill+resume**: the same against pieces continued in parallel
  (``LM.resume``), for kinds whose class says a cache can continue (``resume_alignment``);
* **packed vs alone**: two documents packed in one row (``segment_ids``) against each run alone,
  for kinds that take packed documents (``DOCUMENTS``).

Nothing here names a kind: the cases follow from the protocol (:class:`kvm_jax.nn.MixerKind`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvm_jax as kj
from kvm_jax.ops.kvm.cases import rel_rms

#: Relative RMS bound of two float32 paths of one model: their sums run in different orders
#: (chunked scans vs one step at a time), a few ulps per layer, far below any real mismatch
#: (a dropped token or a wrong position moves logits by 1e-2 and more).
KIND_TOLERANCE = 2e-4
#: Tokens of the checked rows, the prefill length, the decoded and resumed pieces and the two
#: packed documents: past the tiny presets' windows and first state updates (16 tokens).
SEQ_LEN, PREFILL, PIECE, DOCUMENTS = 40, 21, 4, (23, 17)


def perturbed_model(kind: str, seed: int = 0, **overrides) -> kj.LM:
  """A tiny model of ``kind`` layers (``overrides``: other ``presets.tiny`` arguments) whose
  parameters are all moved by noise of scale 0.05, so that zero-initialized projections hide no
  path."""
  model = kj.LM(kj.presets.tiny(mixers=kind, **overrides), rngs=nnx.Rngs(seed))
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree_util.tree_flatten(state)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  noisy = [x + 0.05 * jax.random.normal(key, x.shape, x.dtype) for x, key in zip(leaves, keys)]
  nnx.update(model, jax.tree_util.tree_unflatten(treedef, noisy))
  return model


def _row(kind: str, pair: str, error: float) -> dict:
  ok = bool(np.isfinite(error)) and error <= KIND_TOLERANCE
  return {"case": f"kind {kind}", "pair": pair, "output": error, "state": None, "routing": "-",
          "tolerance": KIND_TOLERANCE, "ok": ok,
          "why": None if ok else f"relative error {error:.2e} > {KIND_TOLERANCE:.0e}"}


def _decoded(model: kj.LM, tokens, prefill: int, step: int):
  """Logits of ``tokens`` by a prefill of ``prefill`` tokens, then pieces of ``step`` tokens
  (``decode_step`` for 1, ``resume`` otherwise; the length past ``prefill`` a multiple of it)."""
  logits, caches = model.prefill(tokens[:, :prefill], model.init_cache(*tokens.shape))
  outs = [logits]
  for t in range(prefill, tokens.shape[1], step):
    piece = tokens[:, t:t + step]
    logits, caches = (model.decode_step(piece, caches) if step == 1
                      else model.resume(piece, caches))
    outs.append(logits)
  return jnp.concatenate(outs, axis=1)


def _packed_error(model: kj.LM, tokens) -> float:
  first, second = DOCUMENTS
  row = tokens[:1, :first + second]
  segment_ids = jnp.asarray([[1] * first + [2] * second])
  packed = model(row, segment_ids=segment_ids)
  alone = jnp.concatenate([model(row[:, :first]), model(row[:, first:])], axis=1)
  return rel_rms(packed, alone)


def check_kind(kind: str) -> list[dict]:
  """The rows of one kind's checks (module docstring), in ``kvm-check``'s table format."""
  model = perturbed_model(kind)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.cfg.vocab_size,
                                                         (2, SEQ_LEN)))
  whole = model(tokens)
  rows = [_row(kind, "forward vs prefill+decode",
               rel_rms(_decoded(model, tokens, PREFILL, 1), whole))]
  alignment = model.resume_alignment()
  if alignment is not None:  # pieces start and span multiples of the alignment
    step = PIECE if alignment == 1 else alignment
    start = -(-PREFILL // alignment) * alignment
    end = start + step * ((SEQ_LEN - start) // step)
    rows.append(_row(kind, "forward vs prefill+resume",
                     rel_rms(_decoded(model, tokens[:, :end], start, step), whole[:, :end])))
  if getattr(kj.nn.mixer_class(kind), "DOCUMENTS", False):
    rows.append(_row(kind, "packed vs alone", _packed_error(model, tokens)))
  return rows
