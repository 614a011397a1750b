"""Small Flax NNX building blocks with the authors' initializations (docs/kvm-spec.md §4), shared by
the attention layers and the MLP, and the naming of parameter paths."""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from kvm_jax.config.model import ModelConfig

Array = jax.Array


def torch_linear_init(fan_in: int):
  """``nn.Linear``'s default U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
  bound = 1.0 / math.sqrt(fan_in)
  return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


def zeros_init(key, shape, dtype):
  del key
  return jnp.zeros(shape, dtype)


def float32_init(init):
  """``init`` evaluated in float32, then cast to the parameter dtype: orthogonal initializers run a
  QR decomposition, which CPU LAPACK does not offer in bfloat16 (and float32 is what the authors'
  ``nn.init.orthogonal_`` computes before their cast)."""
  return lambda key, shape, dtype: init(key, shape, jnp.float32).astype(dtype)


def linear(cfg: ModelConfig, n_in: int, n_out: int, rngs: nnx.Rngs, init=None) -> nnx.Linear:
  """A bias-free projection in the model's parameter and compute dtypes."""
  return nnx.Linear(n_in, n_out, use_bias=False, param_dtype=cfg.jnp_param_dtype,
                    dtype=cfg.jnp_compute_dtype, kernel_init=init or torch_linear_init(n_in),
                    rngs=rngs)


def layer_norm(cfg: ModelConfig, n: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
  """A LayerNorm with weight and bias, eps 1e-5, computed in float32."""
  return nnx.LayerNorm(n, epsilon=1e-5, param_dtype=cfg.jnp_param_dtype, dtype=jnp.float32,
                       rngs=rngs)


def shift_delta(z: Array, prev: Optional[Array], fallback: str,
                starts: Optional[Array] = None) -> Array:
  """``z_{t-1} - z_t`` along axis 1; z_{-1} is ``prev`` (decode), else z_0 ("first") or 0
  ("zero"). ``starts [B, T]`` (packed documents): True at a document's first token, whose
  z_{t-1} is the fallback too, as if the document were run alone."""
  if prev is None:
    prev = z[:, :1] if fallback == "first" else jnp.zeros_like(z[:, :1])
  delta = jnp.concatenate([prev.astype(z.dtype), z[:, :-1]], axis=1) - z
  if starts is None:
    return delta
  restart = jnp.zeros_like(z) if fallback == "first" else -z
  return jnp.where(starts[..., None], restart, delta)


def token_shift(z: Array, mix: Array, prev: Optional[Array], fallback: str,
                starts: Optional[Array] = None) -> Array:
  """``z + mix * (z_{t-1} - z_t)`` (:func:`shift_delta`)."""
  return z + mix.astype(z.dtype) * shift_delta(z, prev, fallback, starts)


def depth_ratio(cfg: ModelConfig, layer: int) -> float:
  """1 at the first layer, falling toward 0 at the last ("ratio_1_to_almost0" of the authors'
  inits)."""
  return 1.0 - layer / cfg.num_layers


def path_names(path) -> list[str]:
  """Names along a parameter's pytree path (``blocks/0/attn/c_q/kernel``), without the trailing
  ``value`` of an NNX variable's state: what optimizer groups and sharding rules match on."""
  names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
  return names[:-1] if names and names[-1] == "value" else names


class GroupNorm(nnx.Module):
  """torch's ``nn.GroupNorm(groups, n)`` over the last axis of ``[..., n]`` (each token's
  channels split into ``groups`` contiguous groups, each normalized on its own), with a weight and
  bias per channel, computed in float32; returns float32."""

  def __init__(self, n: int, groups: int, epsilon: float, param_dtype, *, scale_init=1.0):
    if n % groups:
      raise ValueError(f"GroupNorm: {n} channels do not split into {groups} groups.")
    self.groups, self.epsilon = groups, epsilon
    self.scale = nnx.Param(jnp.full((n,), scale_init, param_dtype))
    self.bias = nnx.Param(jnp.zeros((n,), param_dtype))

  def __call__(self, x: Array) -> Array:
    shape = x.shape
    x = x.astype(jnp.float32).reshape(*shape[:-1], self.groups, shape[-1] // self.groups)
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    x = ((x - mean) * jax.lax.rsqrt(var + self.epsilon)).reshape(shape)
    return x * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)


class RMSNorm(nnx.Module):
  """Root-mean-square norm over the last axis, as Llama's: ``w · (x / rms(x))`` with the
  normalization in float32, cast back to ``x``'s dtype before the weight (transformers'
  ``LlamaRMSNorm``); returns ``x``'s dtype."""

  def __init__(self, n: int, epsilon: float, param_dtype):
    self.epsilon = epsilon
    self.scale = nnx.Param(jnp.ones((n,), param_dtype))

  def __call__(self, x: Array) -> Array:
    return self.scale[...].astype(x.dtype) * rms_normalized(x, self.epsilon).astype(x.dtype)


def rms_normalized(x: Array, epsilon: float) -> Array:
  """``x / sqrt(mean(x²) + ε)`` over the last axis, in float32 (every RMSNorm's core)."""
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + epsilon)
