"""The authors' ``RWKV7BackboneForCausalLM`` state dict to and from kvm_jax parameters: every
tensor checked by name and shape, read with a progress bar. The mapping itself (names, layouts)
is the GPTAlpha-2 family's, :mod:`kvm_jax.nn.authors_format` (docs/checkpoints.md has the table).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvm_jax.hf.authors_config import authors_kinds
from kvm_jax.hf.safetensors import CheckpointError
from kvm_jax.config.model import ModelConfig
from kvm_jax.nn.authors_format import Layout, layout_of, unused_zeros
from kvm_jax.nn.layers import path_names
from kvm_jax.nn.model import LM
from kvm_jax.nn.roles import parameter_role
from kvm_jax.util.progress import ProgressReport

def abstract_model(cfg: ModelConfig):
  """(graphdef, abstract parameter state) of ``LM(cfg)``, without allocating anything."""
  return nnx.split(nnx.eval_shape(lambda: LM(cfg, rngs=nnx.Rngs(0))))


def layouts(cfg: ModelConfig, state=None) -> dict[str, Layout]:
  """``{kvm_jax path "blocks/0/attn/c_q/kernel": Layout}`` of every parameter of ``LM(cfg)``
  (``state``: its abstract parameters, when already at hand)."""
  if state is None:
    _, state = abstract_model(cfg)
  out, rows = {}, authors_kinds()
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    names = path_names(path)
    layer = parameter_role(path).layer
    row = None if layer is None else rows.get(cfg.layer_mixers[layer])
    layout = layout_of(names, tuple(leaf.shape), row)
    if layout is None:
      raise CheckpointError(f"parameter {'/'.join(names)} has no counterpart in the authors' "
                            "model (cross-layer KV sharing weights, for example).")
    out["/".join(names)] = layout
  return out


def authors_shapes(cfg: ModelConfig, table: Optional[dict[str, Layout]] = None
                   ) -> dict[str, tuple[int, ...]]:
  """``{their tensor name: shape}`` of the state dict their model holds for ``cfg``."""
  shapes = {lay.name: lay.shape for lay in (table or layouts(cfg)).values()}
  shapes.update(unused_zeros(cfg, authors_kinds()))
  return shapes


def to_authors(params: Any, cfg: ModelConfig, dtype=None) -> dict[str, np.ndarray]:
  """Their state dict (numpy, in ``dtype`` or the parameters' own) from kvm_jax parameters
  (``nnx.state(model, nnx.Param)`` or the pure dict of it)."""
  table = layouts(cfg)
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    key = "/".join(path_names(path))
    if key not in table:
      raise CheckpointError(f"parameter {key} is not part of LM({cfg!r}).")
    arr = np.asarray(jax.device_get(leaf))
    out[table[key].name] = np.require(
        table[key].to_authors(arr.astype(dtype) if dtype is not None else arr))
  missing = sorted(set(lay.name for lay in table.values()) - set(out))
  if missing:
    raise CheckpointError(f"the parameters lack {missing[:8]} for this config.")
  some = next(iter(out.values()))
  for name, shape in unused_zeros(cfg, authors_kinds()).items():
    out[name] = np.zeros(shape, some.dtype)
  return out


def from_authors(tensors: Mapping[str, np.ndarray], cfg: ModelConfig,
                 source: str = "the checkpoint", progress: bool = False):
  """(graphdef, parameter state) of ``LM(cfg)`` holding their tensors, cast to
  ``cfg.param_dtype``. Every tensor their model would hold must be there with its exact shape, and
  nothing else: a missing, extra or misshapen tensor is a :class:`CheckpointError` naming it.
  With ``progress`` a bar counts the bytes read (memory-mapped tensors are read here)."""
  graphdef, state = abstract_model(cfg)
  table = layouts(cfg, state)
  expected = authors_shapes(cfg, table)
  missing = sorted(set(expected) - set(tensors))
  extra = sorted(set(tensors) - set(expected))
  if missing or extra:
    parts = []
    if missing:
      parts.append(f"missing {len(missing)} tensor(s) the config implies: {missing[:10]}"
                   + (" ..." if len(missing) > 10 else ""))
    if extra:
      parts.append(f"{len(extra)} tensor(s) the config does not explain: {extra[:10]}"
                   + (" ..." if len(extra) > 10 else ""))
    raise CheckpointError(f"{source} does not match its config.json: " + "; ".join(parts)
                          + ". Is config.json the one saved with these weights?")
  for name, shape in expected.items():
    got = tuple(tensors[name].shape)
    if got != shape:
      raise CheckpointError(f"{source}: tensor {name!r} has shape {list(got)} but the config "
                            f"implies {list(shape)}.")
  for name in expected:
    if not jnp.issubdtype(tensors[name].dtype, jnp.floating):
      raise CheckpointError(f"{source}: tensor {name!r} has dtype {tensors[name].dtype}; "
                            "parameters must be floating point.")
  dtype = cfg.jnp_param_dtype
  total = sum(tensors[name].nbytes for name in expected)
  report = ProgressReport(total, "load", min_interval=0.2) if progress else None
  done = 0

  def convert(path, leaf):
    nonlocal done
    lay = table["/".join(path_names(path))]
    arr = jnp.asarray(lay.from_authors(np.asarray(tensors[lay.name])).astype(dtype), dtype)
    done += tensors[lay.name].nbytes
    if report:
      report.update(done, lay.name)
    return arr

  params = jax.tree_util.tree_map_with_path(convert, state)
  if report:
    report.update(total, final=True)
  return graphdef, params
