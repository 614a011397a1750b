"""Converted models as run directories: what ``kvm-convert`` writes (docs/conversion.md)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import jax
import numpy as np
from flax import nnx

from kvm_jax.config.kvm import KVMConfig
from kvm_jax.nn.convert import (LayerSpec, convert_to_kvm, describe_kvm, exact_length,
                                new_parameter_paths)
from kvm_jax.hf.load import TOKENIZER_FILE, checkpoint_kind, read_model_directory, staged
from kvm_jax.runs.train_config import DistillSpec, TrainConfig
from kvm_jax.runs.directory import CONVERSION_RECORD, load_trained, save_starting_point


def write_converted(src, dest, *, layers: LayerSpec = "all",
                    kvm: Union[KVMConfig, Mapping[str, Any], None] = None,
                    step: Optional[int] = None, dtype: str = "float32",
                    numerics: str = "authors", overwrite: bool = False,
                    progress: bool = True) -> Path:
  """Converts the model in ``src`` (a kvm_jax run directory, or any checkpoint
  ``kj.load_pretrained`` reads, e.g. the authors' GPTAlpha-2) and writes run directory ``dest``:
  ``config.json`` (the source run's config with the converted model), ``checkpoints/0/`` (the
  parameters, no optimizer state), ``conversion.json`` (source, layers, KVM options, new
  parameters) and the source's tokenizer when it has one. ``dtype`` and ``numerics`` (as
  ``kvm-import``'s) apply to an authors' checkpoint; a run directory keeps its own. Returns
  ``dest``."""
  src, dest = Path(src), Path(dest)
  if checkpoint_kind(src) == "run":
    run_cfg, model, step = load_trained(src, step)
    tokenizer = Path(run_cfg.tokenizer_file) if run_cfg.tokenizer_file else None
  else:
    if step is not None:
      raise ValueError(f"step={step}: a checkpoint directory outside kvm_jax holds one set of "
                       "weights.")
    _, model_cfg, graphdef, params = read_model_directory(src, dtype=dtype, numerics=numerics,
                                                          progress=progress)
    model, step = nnx.merge(graphdef, params), 0
    run_cfg = TrainConfig(model=model_cfg, task="text")
    tokenizer = src / TOKENIZER_FILE
  converted = convert_to_kvm(model, layers, kvm)
  chosen = [i for i, (a, b) in enumerate(zip(model.cfg.layer_mixers, converted.cfg.layer_mixers))
            if a != b]
  tokenizer = tokenizer if tokenizer is not None and tokenizer.exists() else None
  tok_path = str(dest.resolve() / TOKENIZER_FILE) if tokenizer else ""
  params = nnx.state(converted)
  with staged(dest, overwrite, src) as stage:
    if tokenizer:
      shutil.copyfile(tokenizer, stage / TOKENIZER_FILE)
    # A starting point: nothing of the source's own start (init_from, a teacher) carries over.
    save_starting_point(stage, dataclasses.replace(
        run_cfg, model=converted.cfg, tokenizer_file=tok_path, init_from="", teacher="",
        distill=DistillSpec()), params, {"converted_from": str(src.resolve())})
    record = {
        "source": str(src.resolve()), "source_step": step, "layers": chosen,
        "source_mixers": list(model.cfg.layer_mixers),
        "mixers": list(converted.cfg.layer_mixers), "kvm": describe_kvm(converted.cfg.kvm),
        "share_value_anchor": converted.cfg.share_value_anchor,
        "new_parameters": ["/".join(map(str, p)) for p in new_parameter_paths(converted, model)],
        "parameters": int(sum(np.size(x) for x in jax.tree_util.tree_leaves(params))),
        "exact_up_to_tokens": exact_length(model.cfg, chosen, converted.cfg.kvm),
    }
    (stage / CONVERSION_RECORD).write_text(json.dumps(record, indent=2, default=str) + "\n")
  return dest
