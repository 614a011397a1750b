"""What transformers' ``generate`` reads besides the weights, carried from an imported checkpoint
to its export: the special token ids (``bos_token_id``, ``eos_token_id``, ``pad_token_id``), the
``generation_config.json`` that says where generation stops and how it samples, and the dtype the
weights were stored in (docs/pretrained.md, "Exporting back").

kvm-import keeps them in the run's ``import.json`` (``source_config``, ``generation_config``,
``source_dtype``) and copies the tokenizer's own files; kvm-export writes them back. A run with no
imported source (trained here) takes its special tokens from its tokenizer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping, Optional

GENERATION_CONFIG_FILE = "generation_config.json"
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Beside tokenizer.json, the files that name its special tokens (AutoTokenizer reads them: without
# them a tokenizer loaded from an export knows no EOS).
TOKENIZER_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json")
#: The end of text kvm_jax's own generation stops at when a tokenizer names none
#: (kvm_jax.tasks.tokenizers.HFTokenizer's default).
DEFAULT_EOS = "<|endoftext|>"


def token_ids(config: Mapping[str, Any]) -> dict[str, Any]:
  """The special token ids that ``config`` (a ``config.json`` or ``generation_config.json``)
  sets, in :data:`TOKEN_ID_FIELDS` order; a field that is absent or null is left out. An
  ``eos_token_id`` may be a list (several tokens end generation)."""
  return {f: config[f] for f in TOKEN_ID_FIELDS if config.get(f) is not None}


def source_dtype(record: Mapping[str, Any]) -> Optional[str]:
  """The dtype an imported run's source stored its weights in: ``import.json``'s
  ``source_dtype``, else (a record written before it was kept) its ``config.json``'s ``dtype`` /
  ``torch_dtype`` field; None when neither says."""
  if record.get("source_dtype"):
    return record["source_dtype"]
  config = record.get("source_config") or {}
  named = config.get("dtype") or config.get("torch_dtype")
  return named if isinstance(named, str) else None


def token_name(value) -> Optional[str]:
  """A special token as tokenizer_config.json writes it: a string, or an AddedToken object."""
  if isinstance(value, Mapping):
    value = value.get("content")
  return value if isinstance(value, str) and value else None


def _vocabulary(tokenizer: Mapping) -> dict[str, int]:
  """token -> id of a ``tokenizer.json``: its model's vocabulary (a dict for BPE / WordPiece /
  WordLevel, a ``[piece, score]`` list for Unigram) and its added tokens (which win)."""
  vocab = (tokenizer.get("model") or {}).get("vocab")
  out = dict(vocab) if isinstance(vocab, Mapping) else {}
  if isinstance(vocab, list):
    out = {piece[0]: i for i, piece in enumerate(vocab) if piece}
  out.update({t["content"]: t["id"] for t in tokenizer.get("added_tokens") or []
              if isinstance(t, Mapping) and "content" in t and "id" in t})
  return out


def tokenizer_token_ids(tokenizer_file) -> tuple[dict[str, int], str]:
  """(the special token ids of a ``tokenizer.json``, where their names came from).

  The names are those its ``tokenizer_config.json`` (else ``special_tokens_map.json``) beside it
  gives ``bos_token`` / ``eos_token`` / ``pad_token``; without either file, the end of text is
  :data:`DEFAULT_EOS`, the token kvm_jax's own generation stops at. A name the vocabulary lacks is
  left out. Read as JSON: the ``tokenizers`` package is not needed."""
  path = Path(tokenizer_file)
  vocab = _vocabulary(json.loads(path.read_text()))
  found = [path.parent / c for c in TOKENIZER_COMPANIONS if (path.parent / c).exists()]
  names = {"eos_token_id": DEFAULT_EOS} if not found else {}
  for file in reversed(found):  # the first file that names a token wins
    listed = json.loads(file.read_text())
    names.update({f: name for f in TOKEN_ID_FIELDS
                  if (name := token_name(listed.get(f.removesuffix("_id"))))})
  ids = {f: vocab[names[f]] for f in TOKEN_ID_FIELDS if names.get(f) in vocab}
  return ids, (f"the tokenizer's {found[0].name}" if found
               else f"the tokenizer's {DEFAULT_EOS} (it has no {TOKENIZER_COMPANIONS[0]})")


@dataclasses.dataclass(frozen=True)
class Generation:
  """What an export writes for transformers' ``generate``.

  Attributes:
    token_ids: the fields added to ``config.json`` (:data:`TOKEN_ID_FIELDS` that are known).
    generation_config: the contents of ``generation_config.json``; None writes none.
    source: where both came from, in words (kvm-export prints it).
  """
  token_ids: Mapping[str, Any]
  generation_config: Optional[Mapping[str, Any]]
  source: str

  def __post_init__(self):
    unknown = sorted(set(self.token_ids) - set(TOKEN_ID_FIELDS))
    if unknown:
      raise ValueError(f"token_ids has {unknown}; only {TOKEN_ID_FIELDS} go into config.json.")


def export_generation(record: Optional[Mapping[str, Any]], tokenizer_file: str) -> Generation:
  """The special tokens and generation config of an export.

  ``record`` is the run's ``import.json`` (None for a run trained here), ``tokenizer_file`` its
  tokenizer (``""``: none). In order of preference:

  * the imported source's ``generation_config.json``, verbatim, with ``config.json`` taking the
    source config's ids (and the generation config's where the source config sets none);
  * the source ``config.json``'s ids, into both files: what transformers itself derives for a
    directory without ``generation_config.json`` (``GenerationConfig.from_model_config``);
  * the tokenizer's special tokens (:func:`tokenizer_token_ids`);
  * nothing, as the source had nothing to keep.
  """
  record = record or {}
  config_ids = token_ids(record.get("source_config") or {})
  kept = record.get("generation_config")
  if kept:
    return Generation({**token_ids(kept), **config_ids}, dict(kept),
                      f"the source's {GENERATION_CONFIG_FILE}")
  if config_ids:
    return Generation(config_ids, dict(config_ids), "the source's config.json")
  if tokenizer_file and Path(tokenizer_file).exists():
    ids, where = tokenizer_token_ids(tokenizer_file)
    if ids:
      return Generation(ids, dict(ids), where)
  return Generation({}, None, "neither an imported source nor the run's tokenizer names any")
