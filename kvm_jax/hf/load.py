"""Checkpoints in the authors' Hugging Face format: load one as a kvm_jax ``LM``, import one into a
run directory, export a run directory back (docs/checkpoints.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import warnings
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from kvm_jax.config import io as config_io
from kvm_jax.hf import families
from kvm_jax.hf import safetensors as st
from kvm_jax.hf.special_tokens import (GENERATION_CONFIG_FILE, TOKENIZER_COMPANIONS, Generation,
                                       export_generation, source_dtype)
from kvm_jax.hf.authors_config import (DTYPES, ConfigError, authors_config_from_model, authors_fields,
                                       model_config_from_authors, with_numerics)
from kvm_jax.hf.params import from_authors, to_authors
from kvm_jax.config.model import ModelConfig
from kvm_jax.nn.families.family import family_of
from kvm_jax.runs import checkpoint
from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.runs.directory import (CONFIG_FILE, IMPORT_RECORD, load_config, load_trained,
                                    save_starting_point)
from kvm_jax.tasks.tokenizers import tokenizer

TOKENIZER_FILE = "tokenizer.json"


def _read_json(path) -> dict:
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:
    raise st.CheckpointError(f"{path.parent} has no {path.name}.") from None
  except json.JSONDecodeError as e:
    raise st.CheckpointError(f"{path} is not valid JSON ({e}).") from None


# The ``model_type`` of the authors' config.json (their ``MixerConfig``); a directory without one
# is theirs too (their older exports).
AUTHORS_MODEL_TYPES = (None, "rwkv7backbone", "rwkv7_backbone")


def checkpoint_kind(path) -> str:
  """"run" for a kvm_jax run directory (local or ``gs://``), "authors" for a local Hugging Face
  directory in the authors' format, "transformers" for one that transformers' ``save_pretrained``
  wrote (any other ``model_type``: :mod:`kvm_jax.hf.families` reads the Llama and Gemma
  families and refuses the rest by name); anything else is a
  :class:`~kvm_jax.hf.safetensors.CheckpointError` saying what the directory lacks."""
  path = epath.Path(path)
  if not path.is_dir():
    raise st.CheckpointError(f"{path} is not a directory (give a model directory: config.json and "
                             "model.safetensors, or a kvm_jax run directory).")
  config = path / CONFIG_FILE
  if not config.exists():
    if not checkpoint.is_remote(path):
      st.checkpoint_files(Path(path))  # a pickled checkpoint is refused with the conversion hint
    raise st.CheckpointError(f"{path} has no {CONFIG_FILE}: a model directory needs the config "
                             "saved with its weights.")
  data = _read_json(config)
  if isinstance(data, dict) and config_io.CLASS_KEY in data:
    return "run"
  if isinstance(data, dict) and data.get("model_type") not in AUTHORS_MODEL_TYPES:
    return "transformers"
  return "authors"


def read_transformers(path, *, dtype: str = "float32", progress: bool = True
                      ) -> tuple[dict, ModelConfig, nnx.GraphDef, nnx.State]:
  """(its config.json, the ModelConfig, graphdef, parameters) of a transformers-format directory
  of the Llama or Gemma family (:mod:`kvm_jax.hf.families`)."""
  path = Path(path)
  config = _read_json(path / CONFIG_FILE)
  try:
    cfg = families.model_config_from_transformers(config, dtype=dtype)
  except ConfigError as e:
    raise ConfigError(f"{path / CONFIG_FILE}: {e}") from None
  tensors = st.read_checkpoint(path)
  graphdef, params = families.from_transformers(tensors, cfg, source=str(path), progress=progress)
  return config, cfg, graphdef, params


def read_model_directory(path, *, dtype: str = "float32", numerics: str = "authors",
                         progress: bool = True
                         ) -> tuple[dict, ModelConfig, nnx.GraphDef, nnx.State]:
  """:func:`read_authors` or :func:`read_transformers`, as the directory's kind says
  (``numerics`` applies to the authors' format only)."""
  if checkpoint_kind(path) == "transformers":
    return read_transformers(path, dtype=dtype, progress=progress)
  return read_authors(path, dtype=dtype, numerics=numerics, progress=progress)


def read_authors(path, *, dtype: str = "float32", numerics: str = "authors",
                 progress: bool = True) -> tuple[dict, ModelConfig, nnx.GraphDef, nnx.State]:
  """(their config.json, the ModelConfig, graphdef, parameters) of an authors'-format directory."""
  path = Path(path)
  config = _read_json(path / CONFIG_FILE)
  _, unknown = authors_fields(config)
  if unknown:
    warnings.warn(f"{path / CONFIG_FILE}: ignoring keys that are neither the authors' MixerConfig "
                  f"fields nor Hugging Face's: {unknown}", stacklevel=3)
  try:
    cfg = model_config_from_authors(config, numerics=numerics, dtype=dtype)
  except ConfigError as e:
    raise ConfigError(f"{path / CONFIG_FILE}: {e}") from None
  tensors = st.read_checkpoint(path)
  graphdef, params = from_authors(tensors, cfg, source=str(path), progress=progress)
  return config, cfg, graphdef, params


def load_pretrained(path, dtype: str = "float32", *, numerics: Optional[str] = None,
                    step: Optional[int] = None, progress: bool = True):
  """A model from a checkpoint directory, as a ``kvm_jax.LM`` (its ``cfg`` the ModelConfig).

  ``path`` is a directory in the authors' Hugging Face format (``config.json`` of their
  ``MixerConfig`` and ``model.safetensors``, or shards with ``model.safetensors.index.json``), such
  as the paper's released models; a transformers-format directory of the Llama or Gemma family
  (Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3's text model: what ``save_pretrained`` writes, its logits transformers' own); or a
  kvm_jax run directory (``kvm-train``, ``kvm-import``, ``kvm-convert``).

  Args:
    path: the directory.
    dtype: parameter and activation dtype, "float32" (default) or "bfloat16"; tensors stored in
      another dtype are cast.
    numerics: "authors" computes the RoPE tables and the KVM state-value readout in bfloat16, as
      their code does; "float32" computes both in float32. The default (None) is "authors" for
      their checkpoints and the run's own setting for a run directory; a transformers-format
      model computes in float32 (its tables and activations in ``dtype``).
    step: a run directory's checkpoint step (default: the newest).
    progress: show a progress bar while reading large files.

  Raises:
    kvm_jax.hf.CheckpointError: missing files, a truncated or pickled checkpoint, a tensor that
      is missing, unexpected or misshapen (named in the message).
    kvm_jax.hf.ConfigError: a config field selects something kvm_jax does not implement (named).
  """
  if checkpoint_kind(path) == "run":
    run_cfg = load_config(path)
    model_cfg = with_numerics(run_cfg.model, dtype, numerics)
    return load_trained(path, step, dataclasses.replace(run_cfg, model=model_cfg))[1]
  if step is not None:
    raise ValueError(f"step={step}: a checkpoint directory outside kvm_jax holds one set of "
                     "weights.")
  _, _, graphdef, params = read_model_directory(path, dtype=dtype,
                                                numerics=numerics or "authors", progress=progress)
  return nnx.merge(graphdef, params)


@contextlib.contextmanager
def staged(dest: Path, overwrite: bool, source: Path):
  """Yields a fresh sibling directory to write into; on success it replaces ``dest``, on failure
  it is removed, so ``dest`` is never left half written. ``dest`` may not be ``source`` or hold
  it (``overwrite`` would delete what is being read)."""
  dest, source = dest.resolve(), source.resolve()
  if dest == source or dest in source.parents:
    what = "the source" if dest == source else "a folder holding the source"
    raise ValueError(f"the destination {dest} is {what} {source}; write to a new directory.")
  if dest.exists() and (not dest.is_dir() or any(dest.iterdir())) and not overwrite:
    raise FileExistsError(f"{dest} exists and is not empty; choose a new directory (or pass "
                          "overwrite=True / --overwrite to replace it).")
  stage = dest.with_name(dest.name + ".partial")
  shutil.rmtree(stage, ignore_errors=True)
  stage.mkdir(parents=True)
  try:
    yield stage
  except BaseException:
    shutil.rmtree(stage, ignore_errors=True)
    raise
  if dest.is_dir():
    shutil.rmtree(dest)
  elif dest.exists():
    dest.unlink()
  stage.rename(dest)


def import_checkpoint(src, dest, *, dtype: str = "float32", numerics: str = "authors",
                      tokenizer_file: Optional[str] = None, overwrite: bool = False,
                      progress: bool = True) -> Path:
  """Writes a kvm_jax run directory at ``dest`` from the checkpoint ``src`` (the authors' format
  or a transformers-format Llama- or Gemma-family directory; ``numerics`` applies to the former).

  ``dest`` then holds ``config.json`` (a :class:`TrainConfig`: the model, ``task="text"``),
  ``checkpoints/0/`` (the parameters only, no optimizer state), ``import.json`` (where it came
  from: its ``config.json`` with the special token ids, its ``generation_config.json`` or None,
  the dtype its weights were stored in, all of which kvm-export writes back) and, when ``src``
  has one or ``tokenizer_file`` is given, ``tokenizer.json`` with the ``tokenizer_config.json``
  and ``special_tokens_map.json`` beside it (which name its special tokens). kvm-eval,
  ``kvm_jax.runs.load_trained``, the lm-eval adapter and ``generate`` read it as they read any run;
  ``kvm-train --config.init_from=DEST`` fine-tunes from it.
  """
  src, dest = Path(src), Path(dest)
  kind = checkpoint_kind(src)
  if kind == "run":
    raise ValueError(f"{src} is already a kvm_jax run directory; use it as it is.")
  config, cfg, _, params = read_model_directory(src, dtype=dtype, numerics=numerics,
                                                progress=progress)
  tokenizer = Path(tokenizer_file) if tokenizer_file else src / TOKENIZER_FILE
  if tokenizer_file and not tokenizer.exists():
    raise FileNotFoundError(f"tokenizer file {tokenizer} does not exist.")
  # The run records where its tokenizer will be once the staged directory becomes dest.
  tok_path = str(dest.resolve() / TOKENIZER_FILE) if tokenizer.exists() else ""
  generation = src / GENERATION_CONFIG_FILE
  with staged(dest, overwrite, src) as stage:
    if tok_path:
      _copy_tokenizer(tokenizer, stage)
    save_starting_point(stage, TrainConfig(model=cfg, task="text", tokenizer_file=tok_path),
                        params, {"imported_from": str(src.resolve())})
    leaves = [np.size(x) for x in jax.tree_util.tree_leaves(params)]
    authors = kind == "authors"
    record = {"source": str(src.resolve()), "source_config": config, "dtype": dtype,
              "source_dtype": st.stored_dtype(src),
              "generation_config": _read_json(generation) if generation.exists() else None,
              "numerics": numerics if authors else None, "parameters": int(sum(leaves)),
              "tensors": len(leaves), "tokenizer": tok_path or None}
    (stage / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
  return dest


def _copy_tokenizer(tokenizer: Path, folder: Path) -> list[str]:
  """Copies ``tokenizer`` into ``folder`` as tokenizer.json, with the files beside it that name
  its special tokens; returns the names written."""
  shutil.copyfile(tokenizer, folder / TOKENIZER_FILE)
  companions = [name for name in TOKENIZER_COMPANIONS if (tokenizer.parent / name).exists()]
  for name in companions:
    shutil.copyfile(tokenizer.parent / name, folder / name)
  return [TOKENIZER_FILE, *companions]


def _import_record(run_dir: Path) -> Optional[dict]:
  """The run's ``import.json`` (what kvm-import kept of its source), None for a run trained
  here."""
  record = run_dir / IMPORT_RECORD
  return json.loads(record.read_text()) if record.exists() else None


@dataclasses.dataclass(frozen=True)
class ExportSettings:
  """What kvm-export writes besides the parameters' values.

  Attributes:
    dtype: the tensors' dtype in the file, one of ``DTYPES``.
    dtype_from: why that dtype, in words.
    generation: the special token ids for ``config.json`` and ``generation_config.json``.
  """
  dtype: str
  dtype_from: str
  generation: Generation

  def __post_init__(self):
    if self.dtype not in DTYPES:
      raise ValueError(f"dtype={self.dtype!r}; choose from {DTYPES}.")

  def summary(self) -> str:
    """One line for kvm-export to print: the dtype and the special tokens, each with why."""
    g = self.generation
    tokens = f"special tokens {dict(g.token_ids)}" if g.token_ids else "no special tokens"
    file = f" and {GENERATION_CONFIG_FILE}" if g.generation_config is not None else ""
    return f"{self.dtype} tensors ({self.dtype_from}); {tokens}{file} ({g.source})"


def export_settings(run_dir, dtype: Optional[str] = None) -> ExportSettings:
  """The dtype and generation settings :func:`export_run` uses for ``run_dir``.

  ``dtype`` wins when given; else an imported run keeps the dtype its source stored the weights
  in (a bfloat16 checkpoint goes back out in bfloat16 even when imported to float32), and a run
  trained here (or a source in a dtype the export does not write) the run's parameter dtype. The
  special tokens come from :func:`kvm_jax.hf.special_tokens.export_generation`."""
  run_dir = Path(run_dir)
  run_cfg = load_config(run_dir)
  record = _import_record(run_dir)
  kept = source_dtype(record) if record else None
  if dtype:
    why = "as asked"
  elif kept in DTYPES:
    dtype, why = kept, "the imported source's dtype"
  else:
    dtype = run_cfg.model.param_dtype
    why = "the run's parameter dtype" + (f"; the source's {kept} is not written" if kept else "")
  return ExportSettings(dtype, why, export_generation(record, run_cfg.tokenizer_file))


def export_run(run_dir, dest, *, step: Optional[int] = None, dtype: Optional[str] = None,
               max_shard_bytes: Optional[int] = None, overwrite: bool = False,
               progress: bool = True) -> list[Path]:
  """Writes ``config.json`` and ``model.safetensors`` (or shards plus an index) from a run
  directory's parameters (``step``: default the newest): a GPTAlpha-2 model in the authors'
  format, loadable by their ``RWKV7BackboneForCausalLM.from_pretrained``; a Llama- or
  Gemma-family model without kvm layers in transformers' (``LlamaForCausalLM``,
  ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``Gemma2ForCausalLM`` or
  ``Gemma3ForCausalLM``, as its options say), with ``generation_config.json`` and the special
  token ids in ``config.json`` when the run knows them, and the tokenizer's files when it has one.
  ``dtype`` defaults to the imported source's, else the run's parameter dtype
  (:func:`export_settings`). A model the format cannot express is refused
  (:class:`kvm_jax.hf.ExportError` says why). Returns the files written."""
  run_dir, dest = Path(run_dir), Path(dest)
  if checkpoint_kind(run_dir) != "run":
    raise ValueError(f"{run_dir} is not a kvm_jax run directory (it is already in the authors' "
                     "format).")
  run_cfg = load_config(run_dir)
  settings = export_settings(run_dir, dtype)
  dtype = settings.dtype
  transformers = family_of(run_cfg.model).CHECKPOINT_FORMAT == "transformers"
  # refuse before reading any weights
  if transformers:
    config = families.transformers_config_from_model(run_cfg.model, dtype,
                                                     _max_positions(run_dir, run_cfg))
  else:
    config = authors_config_from_model(run_cfg.model)
  _, model, step = load_trained(run_dir, step, run_cfg)
  params = nnx.state(model, nnx.Param)
  if transformers:
    tensors = families.to_transformers(params, run_cfg.model, jnp.dtype(dtype))
  else:
    tensors = to_authors(params, run_cfg.model, jnp.dtype(dtype))
  config["dtype"] = config["torch_dtype"] = dtype
  generation = settings.generation
  config.update(generation.token_ids)
  with staged(dest, overwrite, run_dir) as stage:
    written = st.write_checkpoint(stage, tensors, metadata={"format": "pt"},
                                  max_shard_bytes=max_shard_bytes, progress=progress)
    (stage / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    names = [p.name for p in written] + [CONFIG_FILE]
    if generation.generation_config is not None:
      (stage / GENERATION_CONFIG_FILE).write_text(
          json.dumps(generation.generation_config, indent=2) + "\n")
      names.append(GENERATION_CONFIG_FILE)
    tok = run_cfg.tokenizer_file
    if tok and Path(tok).exists():
      names += _copy_tokenizer(Path(tok), stage)
  return [dest / name for name in names]


def _max_positions(run_dir: Path, run_cfg: TrainConfig) -> int:
  """``max_position_embeddings`` for an exported config: the imported source's when the run came
  from a transformers checkpoint, else the run's training length."""
  record = _import_record(run_dir)
  if record:
    source = record.get("source_config") or {}
    if isinstance(source.get("max_position_embeddings"), int):
      return source["max_position_embeddings"]
  return max(int(run_cfg.sequence_length), 1)


def tokenizer_of(path):
  """The tokenizer whose ids a model directory's model reads.

  A run directory: its ``tokenizer_file`` (a NIAH run's ``niah.tokenizer_file``; kvm-import and
  kvm-convert copy the tokenizer into the directory and record it there), or the byte tokenizer
  when it names none (the demo's models, whose 320-id vocabulary holds the bytes). An
  authors'-format directory: its ``tokenizer.json``. A ValueError says when there is none."""
  if checkpoint_kind(path) == "run":
    cfg = load_config(path)
    name = cfg.niah.tokenizer_file if cfg.task == "niah" else cfg.tokenizer_file
    if name and not epath.Path(name).exists():
      raise ValueError(f"{path} records the tokenizer {name}, which does not exist (moved?); "
                       "load it with kvm_jax.tasks.tokenizers.HFTokenizer(PATH).")
    return tokenizer(name)
  file = epath.Path(path) / TOKENIZER_FILE
  if not file.exists():
    raise ValueError(f"{path} holds no {TOKENIZER_FILE}; load the tokenizer its model was trained "
                     "with: kvm_jax.tasks.tokenizers.HFTokenizer(PATH) (the paper's: GPT-2's).")
  return tokenizer(str(file))


def numerics_note(cfg: ModelConfig) -> Optional[str]:
  """What changes when a model computed with float32 numerics runs in the authors' code (which
  always casts the RoPE tables and the KVM state-value readout to bfloat16)."""
  if family_of(cfg).CHECKPOINT_FORMAT != "authors":
    return None  # transformers computes its tables in float32 too
  parts = []
  if cfg.rope_table_dtype != "bfloat16":
    parts.append("RoPE tables")
  if any(getattr(cfg.options_of(kind), "readout_value_dtype", "bfloat16") != "bfloat16"
         for kind in set(cfg.layer_mixers)):  # a KVM layer's state-value readout
    parts.append("the KVM state-value readout")
  if not parts:
    return None
  return (f"this run computes {' and '.join(parts)} in float32; the authors' code casts them to "
          "bfloat16, so its logits will differ from this run's by bfloat16 rounding (~1e-3 "
          "relative).")
