"""Tokenizers: UTF-8 bytes by default, or any local ``tokenizer.json`` (nothing is downloaded)."""

from __future__ import annotations

from typing import Iterable, Optional


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255, EOS = 256. ``vocab_size`` is padded to a multiple of 64."""

  eos_id = 256
  vocab_size = 320

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """UTF-8 bytes (there is no special token to add)."""
    return list(text.encode("utf-8"))

  def decode(self, ids: Iterable[int]) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
  """Any ``tokenizers``-format tokenizer file (``tokenizer.json``), loaded from local disk only."""

  def __init__(self, path: str, eos_token: Optional[str] = None):
    try:
      from tokenizers import Tokenizer  # optional dependency
    except ImportError as e:  # pragma: no cover - depends on the environment
      raise ValueError("--tokenizer needs the `tokenizers` package: pip install tokenizers") from e
    self._tok = Tokenizer.from_file(path)
    self.vocab_size = self._tok.get_vocab_size()
    eos = eos_token or "<|endoftext|>"
    self.eos_id = self._tok.token_to_id(eos)

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``; ``add_special_tokens=False`` leaves out what the tokenizer's post
    processor adds (a BOS): a chat template's text already has its own."""
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Iterable[int]) -> str:
    return self._tok.decode(list(int(i) for i in ids))


def tokenizer(tokenizer_file: str = ""):
  """The tokenizer of a run: a local ``tokenizer.json`` file, or bytes when ``""``."""
  return HFTokenizer(tokenizer_file) if tokenizer_file else ByteTokenizer()
