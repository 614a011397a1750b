"""Batched generation: one jitted prefill, then a jitted one-token decode step per new token.

Works for every mixer and hybrid pattern (each layer carries its own cache: the KVM cache from the
core, ring buffers for SWA/BSWA, a preallocated KV buffer for full attention, the dictionary and
current chunk for OVQ, the fixed-size state for RWKV-7). Sampling is greedy,
temperature, top-k and/or top-p with explicit PRNG keys.

On a pod (parameters that span processes, e.g. from ``load_trained``), every process calls
:func:`generate` with the same prompt and key, like any SPMD program: the prompt, caches and keys
are replicated onto the parameters' mesh, and every process gets the same tokens back.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Array = jax.Array
# float32's smallest normal and largest finite numbers: the range of a sampling setting that the
# float32 logits can be divided or cut by.
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
FLOAT32_MAX = float(np.finfo(np.float32).max)
# The smallest sampling temperature: logits divided by less could overflow float32 to infinity
# (their softmax then NaN); 0 asks for greedy decoding instead.
MIN_TEMPERATURE = 1e-6


def pod_mesh(state) -> Optional[Mesh]:
  """The mesh of a model's parameters when they span several processes, else ``None``."""
  for leaf in jax.tree_util.tree_leaves(state):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and not leaf.is_fully_addressable:
      return sharding.mesh
  return None


def replicate_on(mesh: Optional[Mesh], tree):
  """``tree`` (host or process-local arrays, PRNG keys included) replicated over ``mesh``, so it
  can meet parameters that span processes; unchanged when ``mesh`` is ``None``. Every process
  must pass the same values."""
  if mesh is None:
    return tree
  replicated = NamedSharding(mesh, PartitionSpec())

  def put(x):
    x = jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic, int, float)) else x
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # typed keys travel as their raw data
      return jax.random.wrap_key_data(jax.device_put(jax.random.key_data(x), replicated),
                                      impl=jax.random.key_impl(x))
    return jax.device_put(x, replicated)

  return jax.tree_util.tree_map(put, tree)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How the next token is drawn from the logits.

  Attributes:
    temperature: softmax temperature; 0 means greedy (argmax).
    top_k: keep only the k most likely tokens (None = all).
    top_p: keep the smallest set of tokens whose probability mass reaches p (None = all).
  """

  temperature: float = 1.0
  top_k: Optional[int] = None
  top_p: Optional[float] = None

  def __post_init__(self):
    # The logits are float32: a temperature that overflows them, or a nucleus that float32
    # rounds to 0, would draw from NaN rather than fail.
    if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= FLOAT32_MAX):
      raise ValueError(f"temperature must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, "
                       f"{FLOAT32_MAX:.3g}], got {self.temperature}.")
    if self.top_k is not None and self.top_k < 1:
      raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}.")
    if self.top_p is not None and not FLOAT32_TINY <= self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1] (at least {FLOAT32_TINY:.3g}, float32's "
                       f"smallest normal number) or None, got {self.top_p}.")


def sample_logits(logits: Array, key: Array, sampling: SamplingConfig) -> Array:
  """Draws token ids ``[B]`` from ``logits [B, V]`` (float32)."""
  logits = logits.astype(jnp.float32)
  if sampling.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / sampling.temperature
  if sampling.top_k is not None:
    kth = jax.lax.top_k(logits, min(sampling.top_k, logits.shape[-1]))[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if sampling.top_p is not None:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < sampling.top_p  # the top token is always kept
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(
        keep_sorted)
    logits = jnp.where(keep, logits, -jnp.inf)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def prefill_logits(graphdef, state, tokens: Array, caches):
  """The jitted prefill of :func:`generate`: ``(logits of the last prompt token [B, V], caches)``
  for ``tokens [B, P]`` of the model ``nnx.merge(graphdef, state)``."""
  model = nnx.merge(graphdef, state)
  logits, caches = model.prefill(tokens, caches)
  return logits[:, -1], caches


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling"), donate_argnums=(3,))
def sample_step(graphdef, state, token: Array, caches, key: Array, sampling: SamplingConfig):
  """The jitted decode step of :func:`generate`: feeds ``token [B]`` and draws the next one,
  ``(next token [B], caches)``; ``caches`` are donated."""
  model = nnx.merge(graphdef, state)
  logits, caches = model.decode_step(token[:, None], caches)
  return sample_logits(logits[:, 0], key, sampling), caches


@jax.jit
def _emit(token, done, lengths, stops, pad_token):
  """Bookkeeping of one generated token: pad finished rows, count, mark newly stopped rows."""
  emitted = jnp.where(done, pad_token, token)
  return emitted, done | jnp.isin(token, stops), lengths + (~done).astype(jnp.int32)


def generate(model, prompt: Array, *, max_new_tokens: int, key: Array,
             sampling: SamplingConfig = SamplingConfig(), stop_tokens: Sequence[int] = (),
             pad_token: int = 0, max_len: Optional[int] = None,
             prefill_bucket: Optional[int] = None) -> tuple[Array, Array]:
  """Continues ``prompt [B, P]`` by up to ``max_new_tokens`` tokens.

  ``prefill_bucket``: prefill only the first ``P - P % prefill_bucket`` prompt tokens (at least 1)
  and feed the rest through the decode step. Greedy results are the same (decode == prefill); the
  prefill then compiles once per bucket instead of once per prompt length, which matters when
  many prompts of slightly different lengths are evaluated one by one (NIAH, lm-eval).

  Returns ``(tokens [B, P + max_new_tokens], lengths [B])``: after a sequence emits one of
  ``stop_tokens`` its later positions hold ``pad_token``; ``lengths`` counts generated tokens
  including the stop token. Generation ends early once every sequence has stopped.
  """
  if prompt.ndim != 2 or prompt.shape[1] < 1:
    raise ValueError(f"prompt must be [batch, length >= 1] token ids, got shape {prompt.shape}.")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
  model.check_tokens(prompt)
  B, P = prompt.shape
  needed = P + max_new_tokens
  max_len = needed if max_len is None else max_len
  if needed > max_len:
    raise ValueError(f"prompt ({P}) + max_new_tokens ({max_new_tokens}) = {needed} exceeds "
                     f"max_len={max_len}; raise max_len.")
  if prefill_bucket is not None and prefill_bucket < 1:
    raise ValueError(f"prefill_bucket must be >= 1 or None, got {prefill_bucket}.")
  graphdef, state = nnx.split(model)
  mesh = pod_mesh(state)
  caches, prompt, key = replicate_on(mesh, (model.init_cache(B, max_len), prompt, key))
  prefilled = P if prefill_bucket is None else max(P - P % prefill_bucket, 1)
  last_logits, caches = prefill_logits(graphdef, state, prompt[:, :prefilled], caches)
  stops = replicate_on(mesh, jnp.asarray(list(stop_tokens) or [-1], jnp.int32))
  key, sub = jax.random.split(key)
  token = sample_logits(last_logits, sub, sampling)
  for i in range(prefilled, P):  # the prompt's tail, token by token (its samples are discarded)
    key, sub = jax.random.split(key)
    token, caches = sample_step(graphdef, state, prompt[:, i].astype(jnp.int32), caches, sub,
                                sampling)
  out, done, lengths = [], *replicate_on(mesh, (jnp.zeros((B,), bool),
                                                jnp.zeros((B,), jnp.int32)))
  pad_id = replicate_on(mesh, jnp.int32(pad_token))
  for step in range(max_new_tokens):
    emitted, done, lengths = _emit(token, done, lengths, stops, pad_id)
    out.append(emitted)
    # Early exit needs the host to see `done`; only checked when stop tokens exist.
    if step == max_new_tokens - 1 or (stop_tokens and bool(jnp.all(done))):
      break
    key, sub = jax.random.split(key)
    token, caches = sample_step(graphdef, state, emitted, caches, sub, sampling)
  generated = jnp.stack(out, axis=1)
  pad = replicate_on(mesh, jnp.full((B, max_new_tokens - generated.shape[1]), pad_token,
                                    jnp.int32))
  tokens = jnp.concatenate([prompt.astype(jnp.int32), generated, pad], axis=1)
  # Replicated results: every process can read them (np.asarray) whatever the parameters' split.
  return replicate_on(mesh, (tokens, lengths))


def generate_text(model, tokenizer, ids: Sequence[int], *, max_new_tokens: int, key: Array,
                  sampling: SamplingConfig = SamplingConfig(temperature=0.0),
                  max_len: Optional[int] = None, prefill_bucket: Optional[int] = None) -> str:
  """The decoded continuation of one prompt ``ids``, stopped at (and without) the tokenizer's
  EOS. ``tokenizer`` has ``decode(ids)`` and ``eos_id``; other arguments as :func:`generate`."""
  tokens, lengths = generate(model, jnp.asarray([list(ids)], jnp.int32),
                             max_new_tokens=max_new_tokens, key=key, sampling=sampling,
                             stop_tokens=(tokenizer.eos_id,), pad_token=tokenizer.eos_id,
                             max_len=max_len, prefill_bucket=prefill_bucket)
  new = np.asarray(tokens[0, len(ids):len(ids) + int(lengths[0])]).tolist()
  return tokenizer.decode([t for t in new if t != tokenizer.eos_id])
