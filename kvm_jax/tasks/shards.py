"""Token shards: a corpus tokenized once, read back through memory maps and packed at read time.

Tokenizing a large corpus on every run start (what :func:`kvm_jax.tasks.text.cram_pack` does) is
slow and holds the whole corpus in memory. ``kvm-data`` (or :func:`write_shards`) tokenizes it once
into a directory that training maps into memory; the "cram" windows are then found by arithmetic
on the document lengths, and each window is gathered from the maps only when a batch asks for it.

On-disk format (version 1), one directory::

  manifest.json       written last: its presence means the directory is complete
  shard-00000.bin     documents 0 .. n0-1
  shard-00001.bin     documents n0 .. n0+n1-1
  ...

``manifest.json`` holds ``format`` ("kvm-token-shards"), ``version``, ``dtype`` ("uint16" or
"uint32"), ``eos_id``, ``vocab_size``, ``append_eos``, ``tokenizer`` (``{"kind": "bytes"}``, or the
tokenizer file's name and the sha256 of its contents), ``shard_tokens`` (the size limit used),
``num_docs`` and ``num_tokens`` (totals) and ``shards``: one ``{"file", "num_tokens", "num_docs"}``
per shard, in document order.

Each ``.bin`` file, all little-endian:

* a header of 256 int32 words (1024 bytes): word 0 the magic number 0x4B564D54 ("KVMT" read as
  an integer), 1 the format version, 2 the bytes per token (2 or 4), 3 zero, words 4-5 the number
  of tokens and words 6-7 the number of documents (each an int64 over two words); the rest zeros;
* the tokens: ``uint16`` when the vocabulary has at most 65536 ids, else ``uint32``;
* zero bytes up to the next multiple of 8 (so that the offsets below are aligned);
* the document start offsets, ``uint64 [num_docs + 1]``, in tokens from the first token of this
  shard; the last one equals the number of tokens.

Documents are stored whole, with the tokenizer's EOS appended (unless ``append_eos=False``), and
never split across shards: a shard closes before the document that would take it past
``shard_tokens`` (a single longer document gets a shard of its own).
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Optional

import grain
import numpy as np

from kvm_jax.util.progress import ProgressReport
from kvm_jax.tasks.text import lm_example
from kvm_jax.tasks.tokenizers import ByteTokenizer

FORMAT = "kvm-token-shards"
FORMAT_VERSION = 1
MAGIC = 0x4B564D54
HEADER_WORDS = 256
HEADER_BYTES = 4 * HEADER_WORDS
MANIFEST = "manifest.json"
MAX_VOCAB = 2 ** 31  # windows are int32


def shard_name(index: int) -> str:
  return f"shard-{index:05d}.bin"


def token_dtype(vocab_size: int) -> np.dtype:
  """The narrowest stored dtype that holds every id below ``vocab_size``."""
  return np.dtype("<u2") if vocab_size <= 2 ** 16 else np.dtype("<u4")


def _padding(nbytes: int) -> int:
  return -nbytes % 8


def _shard_size(num_tokens: int, num_docs: int, itemsize: int) -> int:
  tokens = num_tokens * itemsize
  return HEADER_BYTES + tokens + _padding(tokens) + 8 * (num_docs + 1)


def _header(itemsize: int, num_tokens: int, num_docs: int) -> bytes:
  words = np.zeros(HEADER_WORDS, "<i4")
  words[:4] = (MAGIC, FORMAT_VERSION, itemsize, 0)
  words[4:8].view("<i8")[:] = (num_tokens, num_docs)
  return words.tobytes()


# -- writing -------------------------------------------------------------------------------------

class _ShardWriter:
  """One shard being written: tokens go straight to a temporary file, only the offsets stay in
  memory (8 bytes per document); ``close`` adds the header and renames the file into place."""

  def __init__(self, path: Path, dtype: np.dtype):
    self.path, self.dtype = path, dtype
    self.tmp = path.with_name(path.name + ".tmp")
    self.file = open(self.tmp, "wb")
    self.file.write(bytes(HEADER_BYTES))  # the header is written last, once the counts are known
    self.offsets = array.array("Q", [0])
    self.num_tokens = 0

  @property
  def num_docs(self) -> int:
    return len(self.offsets) - 1

  def add(self, ids: np.ndarray) -> None:
    self.file.write(ids.astype(self.dtype, copy=False).tobytes())
    self.num_tokens += len(ids)
    self.offsets.append(self.num_tokens)

  def close(self) -> dict:
    nbytes = self.num_tokens * self.dtype.itemsize
    self.file.write(bytes(_padding(nbytes)))
    self.file.write(np.asarray(self.offsets, "<u8").tobytes())
    self.file.seek(0)
    self.file.write(_header(self.dtype.itemsize, self.num_tokens, self.num_docs))
    self.file.flush()
    os.fsync(self.file.fileno())
    self.file.close()
    os.replace(self.tmp, self.path)  # a shard file that exists is always complete
    return {"file": self.path.name, "num_tokens": self.num_tokens, "num_docs": self.num_docs}

  def abort(self) -> None:
    self.file.close()
    self.tmp.unlink(missing_ok=True)


def describe_tokenizer(tokenizer, tokenizer_file: str = "") -> dict:
  """What the manifest records about the tokenizer: ``{"kind": "bytes"}`` for UTF-8 bytes, else
  its class, and when ``tokenizer_file`` is given, that file's name and the sha256 of its bytes
  (so a run can tell whether it tokenizes prompts the way the corpus was)."""
  if type(tokenizer) is ByteTokenizer and not tokenizer_file:
    return {"kind": "bytes"}
  out = {"kind": type(tokenizer).__name__}
  if tokenizer_file:
    digest = hashlib.sha256(Path(tokenizer_file).read_bytes()).hexdigest()
    out.update(file=Path(tokenizer_file).name, sha256=digest)
  return out


def _prepare_out_dir(out: Path, overwrite: bool) -> None:
  if out.exists() and not out.is_dir():
    raise ValueError(f"out_dir {str(out)!r} is a file; give a directory (new or empty).")
  if out.exists():
    entries = sorted(p.name for p in out.iterdir())
    if entries and not overwrite:
      shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
      raise ValueError(f"out_dir {str(out)!r} exists and is not empty ({shown}); choose a new "
                       "directory, or pass overwrite=True (kvm-data --overwrite) to replace the "
                       "token shards in it.")
    # The manifest goes first: an interrupted rewrite must not look like a complete directory.
    (out / MANIFEST).unlink(missing_ok=True)
    for p in out.glob("shard-*.bin*"):
      p.unlink()
  out.mkdir(parents=True, exist_ok=True)


def _encode(tokenizer, doc) -> np.ndarray:
  """``tokenizer.encode(doc)`` as int64 numpy; UTF-8 bytes without the per-byte Python list."""
  if not isinstance(doc, str):
    raise ValueError(f"documents must be str, got {type(doc).__name__}: {str(doc)[:80]!r}.")
  if type(tokenizer) is ByteTokenizer:
    return np.frombuffer(doc.encode("utf-8"), np.uint8).astype(np.int64)
  return np.asarray(tokenizer.encode(doc), np.int64).reshape(-1)


def _check_settings(tokenizer, shard_tokens: int, append_eos: bool) -> tuple[int, Optional[int]]:
  """(vocab_size, eos_id) of ``tokenizer``, after the checks that must pass before anything on
  disk is touched: a bad setting must not cost the caller an existing directory."""
  if shard_tokens < 1:
    raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}.")
  vocab_size = int(tokenizer.vocab_size)
  if not 0 < vocab_size <= MAX_VOCAB:
    raise ValueError(f"tokenizer vocab_size={vocab_size} must be in [1, {MAX_VOCAB}]: token "
                     "windows are int32.")
  eos_id = tokenizer.eos_id
  if append_eos and eos_id is None:
    raise ValueError("the tokenizer has no EOS token (eos_id is None); use a tokenizer that has "
                     "one, or append_eos=False (kvm-data --no-eos) to store documents without it.")
  return vocab_size, eos_id


def _check_ids(ids: np.ndarray, vocab_size: int, doc_number: int) -> None:
  """Rejects ids the stored dtype (chosen from ``vocab_size``) could not hold: ``astype`` would
  wrap them silently into other, valid-looking tokens."""
  if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
    bad = int(ids.max()) if ids.max() >= vocab_size else int(ids.min())
    raise ValueError(f"document {doc_number}: token id {bad} is outside [0, vocab_size="
                     f"{vocab_size}); the tokenizer's vocab_size must cover every id it "
                     "produces (and its eos_id).")


def _stream_shards(documents: Iterable[str], tokenizer, out: Path, dtype: np.dtype,
                   vocab_size: int, eos: np.ndarray, shard_tokens: int,
                   bar: Optional[ProgressReport]) -> tuple[list[dict], int, int]:
  """Tokenizes ``documents`` into numbered shards in ``out``, one document at a time.

  Returns (the manifest entries of the shards, in order; documents; tokens). On any error,
  interruptions included, the shard being written is removed, so that only complete shards are
  left behind.
  """
  shards: list[dict] = []
  writer: Optional[_ShardWriter] = None
  num_docs = num_tokens = 0
  try:
    for doc in documents:
      ids = np.concatenate([_encode(tokenizer, doc), eos])
      _check_ids(ids, vocab_size, num_docs)
      # Close before the document that would overflow, never on an empty shard: a document
      # longer than shard_tokens then gets a shard of its own instead of being split.
      if writer is not None and writer.num_docs and writer.num_tokens + len(ids) > shard_tokens:
        shards.append(writer.close())
        writer = None
      if writer is None:
        writer = _ShardWriter(out / shard_name(len(shards)), dtype)
      writer.add(ids)
      num_docs += 1
      num_tokens += len(ids)
      if bar is not None:
        bar.update(num_docs, f"{num_tokens:,} tokens")
    if writer is not None:
      shards.append(writer.close())
      writer = None  # closed: nothing for the handler below to abort
  except BaseException:
    if writer is not None:
      writer.abort()
    raise
  return shards, num_docs, num_tokens


def _write_manifest(out: Path, manifest: dict) -> None:
  """Writes ``out/manifest.json`` atomically: its presence is what marks the directory complete,
  so a reader must never see a partial one."""
  tmp = out / (MANIFEST + ".tmp")
  tmp.write_text(json.dumps(manifest, indent=2) + "\n")
  os.replace(tmp, out / MANIFEST)


def write_shards(documents: Iterable[str], tokenizer, out_dir, *, shard_tokens: int = 100_000_000,
                 append_eos: bool = True, overwrite: bool = False, progress: bool = True,
                 total_docs: Optional[int] = None, tokenizer_file: str = "") -> dict:
  """Tokenizes ``documents`` into token shards in ``out_dir`` (format: this module's docstring).

  Streams: documents are read one at a time and their tokens written straight to the current
  shard's file, so memory holds one document and the current shard's offsets, never the corpus.
  Each shard appears under its final name only once complete, and ``manifest.json`` only once
  every shard is.

  Args:
    documents: the texts, in order (any iterable; consumed once).
    tokenizer: a :mod:`kvm_jax.tasks.tokenizers` tokenizer (``encode``, ``eos_id``,
      ``vocab_size``).
    out_dir: a new or empty directory (created with its parents).
    shard_tokens: a shard closes before the document that would take it past this many tokens.
    append_eos: append ``tokenizer.eos_id`` to every document (what ``cram_pack`` does).
    overwrite: allow a non-empty ``out_dir``; its manifest and shards are deleted first.
    progress: show a progress bar over documents on stderr.
    total_docs: the number of documents, for the bar (default ``len(documents)`` when it has one).
    tokenizer_file: the tokenizer's file, recorded in the manifest with its sha256.

  Returns:
    The manifest (also written to ``out_dir/manifest.json``).
  """
  vocab_size, eos_id = _check_settings(tokenizer, shard_tokens, append_eos)
  dtype = token_dtype(vocab_size)
  out = Path(out_dir)
  _prepare_out_dir(out, overwrite)
  if total_docs is None and hasattr(documents, "__len__"):
    total_docs = len(documents)  # type: ignore[arg-type]
  bar = ProgressReport(total_docs, "tokenizing", min_interval=0.5) if progress else None
  eos = np.asarray([eos_id] if append_eos else [], np.int64)
  shards, num_docs, num_tokens = _stream_shards(documents, tokenizer, out, dtype, vocab_size, eos,
                                                shard_tokens, bar)
  if bar is not None:
    bar.update(num_docs, f"{num_tokens:,} tokens, {len(shards)} shards", final=True)
  if not num_docs:
    raise ValueError("no documents to write: the input yielded none.")
  manifest = {
      "format": FORMAT, "version": FORMAT_VERSION, "dtype": dtype.name, "eos_id": eos_id,
      "vocab_size": vocab_size, "append_eos": append_eos,
      "tokenizer": describe_tokenizer(tokenizer, tokenizer_file), "shard_tokens": shard_tokens,
      "num_docs": num_docs, "num_tokens": num_tokens, "shards": shards,
  }
  _write_manifest(out, manifest)
  return manifest


# -- reading -------------------------------------------------------------------------------------

def _open_shard(path: Path, dtype: np.dtype, entry: dict) -> tuple[np.ndarray, np.ndarray]:
  """(tokens ``[num_tokens]``, offsets ``uint64 [num_docs + 1]``) of one shard, memory-mapped,
  after checking its header and size against the manifest's ``entry``."""
  if not path.is_file():
    raise ValueError(f"{path}: token shard listed in the manifest is missing.")
  size = path.stat().st_size
  if size < HEADER_BYTES:
    raise ValueError(f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte header; the "
                     "file is truncated or not a token shard.")
  words = np.fromfile(path, "<i4", count=HEADER_WORDS)
  magic, version, itemsize = (int(w) for w in words[:3])
  num_tokens, num_docs = (int(c) for c in words[4:8].view("<i8"))
  if magic != MAGIC:
    raise ValueError(f"{path}: not a token shard (magic number {magic:#x}, expected {MAGIC:#x}); "
                     "the file is corrupted or was not written by kvm-data.")
  if version != FORMAT_VERSION:
    raise ValueError(f"{path}: token shard format version {version}; this kvm_jax reads version "
                     f"{FORMAT_VERSION}. Rewrite the corpus with this version's kvm-data.")
  if itemsize != dtype.itemsize:
    raise ValueError(f"{path}: {itemsize}-byte tokens, but the manifest says {dtype.name}.")
  if (num_tokens, num_docs) != (entry["num_tokens"], entry["num_docs"]):
    raise ValueError(f"{path}: header holds {num_tokens} tokens in {num_docs} documents, the "
                     f"manifest {entry['num_tokens']} in {entry['num_docs']}; the directory mixes "
                     "files of different writes. Rewrite it with kvm-data.")
  expected = _shard_size(num_tokens, num_docs, itemsize)
  if size != expected:
    raise ValueError(f"{path}: {size} bytes, expected {expected} for {num_tokens} tokens and "
                     f"{num_docs} documents; the file is truncated or corrupted.")
  if num_tokens:
    tokens = np.memmap(path, dtype, "r", offset=HEADER_BYTES, shape=(num_tokens,))
  else:  # mmap cannot map zero bytes
    tokens = np.zeros(0, dtype)
  nbytes = num_tokens * itemsize
  offsets = np.memmap(path, "<u8", "r", offset=HEADER_BYTES + nbytes + _padding(nbytes),
                      shape=(num_docs + 1,))
  if offsets[0] != 0 or offsets[-1] != num_tokens or np.any(np.diff(offsets.astype(np.int64)) < 0):
    raise ValueError(f"{path}: document offsets are not increasing from 0 to {num_tokens}; the "
                     "file is corrupted.")
  return tokens, offsets


@dataclasses.dataclass(frozen=True, eq=False)
class CramIndex:
  """The windows of ``cram_pack`` over a :class:`TokenShards`, as document numbers, not tokens.

  Window ``k`` is either one document (``long_doc[k] >= 0``: its first ``width`` tokens) or the
  concatenation of the short documents ``short_docs[first[k] : last[k] + 1]``, cut to ``width``
  tokens. All arrays are int64 ``[len(self)]`` except ``short_docs``, the numbers of all documents
  shorter than ``width`` in corpus order.
  """

  shards: "TokenShards"
  width: int
  long_doc: np.ndarray
  first: np.ndarray
  last: np.ndarray
  short_docs: np.ndarray

  def __len__(self) -> int:
    return len(self.long_doc)

  def window(self, k: int) -> np.ndarray:
    """Window ``k``, int32 ``[width]`` (= ``cram_pack(...)[k]``), gathered from the maps."""
    if not 0 <= k < len(self):
      raise IndexError(f"window {k} out of range [0, {len(self)}).")
    out = np.empty(self.width, np.int32)
    doc = int(self.long_doc[k])
    if doc >= 0:
      out[:] = self.shards.doc(doc)[:self.width]
      return out
    filled = 0
    for d in self.short_docs[self.first[k]:self.last[k] + 1]:
      ids = self.shards.doc(int(d))[:self.width - filled]
      out[filled:filled + len(ids)] = ids
      filled += len(ids)
    return out


class TokenShards:
  """A token-shard directory, memory-mapped: documents by number, and their cram windows.

  Opening reads the manifest, checks every shard's header and size against it and maps the
  shards read-only; no token is read until a document or window is asked for. ``doc_lengths``
  (int64 ``[num_docs]``, EOS included) is the one array of corpus size held in memory.
  """

  def __init__(self, path):
    self.path = Path(path)
    manifest_path = self.path / MANIFEST
    if not manifest_path.is_file():
      raise ValueError(f"{self.path}: no {MANIFEST}, so not a complete token-shard directory "
                       "(write one with kvm-data; an interrupted write leaves no manifest).")
    try:
      manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
      raise ValueError(f"{manifest_path}: not valid JSON ({e}).") from None
    if manifest.get("format") != FORMAT:
      raise ValueError(f"{manifest_path}: format {manifest.get('format')!r}, expected {FORMAT!r}.")
    if manifest.get("version") != FORMAT_VERSION:
      raise ValueError(f"{manifest_path}: format version {manifest.get('version')}; this kvm_jax "
                       f"reads version {FORMAT_VERSION}. Rewrite the corpus with kvm-data.")
    self.manifest = manifest
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    self._tokens, self._offsets = [], []
    for entry in manifest["shards"]:
      tokens, offsets = _open_shard(self.path / entry["file"], dtype, entry)
      self._tokens.append(tokens)
      self._offsets.append(offsets)
    counts = [len(o) - 1 for o in self._offsets]
    # _first_doc[s] is the number of shard s's first document; the last entry is num_docs.
    self._first_doc = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    if (int(self._first_doc[-1]), sum(len(t) for t in self._tokens)) != (
        manifest["num_docs"], manifest["num_tokens"]):
      raise ValueError(f"{manifest_path}: its totals ({manifest['num_docs']} documents, "
                       f"{manifest['num_tokens']} tokens) disagree with its shards.")
    self.doc_lengths = np.concatenate(
        [np.diff(o.astype(np.int64)) for o in self._offsets] or [np.zeros(0, np.int64)])

  @property
  def num_docs(self) -> int:
    return int(self.manifest["num_docs"])

  @property
  def num_tokens(self) -> int:
    return int(self.manifest["num_tokens"])

  @property
  def eos_id(self) -> Optional[int]:
    return self.manifest["eos_id"]

  @property
  def vocab_size(self) -> int:
    return int(self.manifest["vocab_size"])

  def __len__(self) -> int:
    return self.num_docs

  def doc(self, i: int) -> np.ndarray:
    """Document ``i``'s tokens (EOS included when written so): a read-only view ``[length]`` in
    the stored dtype."""
    if not 0 <= i < self.num_docs:
      raise IndexError(f"document {i} out of range [0, {self.num_docs}).")
    s = int(np.searchsorted(self._first_doc, i, side="right")) - 1
    j = i - int(self._first_doc[s])
    offsets = self._offsets[s]
    return np.asarray(self._tokens[s][int(offsets[j]):int(offsets[j + 1])])

  def cram_windows(self, seq_len: int) -> CramIndex:
    """The windows of ``text.cram_pack(documents, tokenizer, seq_len)``, in its order, from the
    document lengths alone.

    cram_pack truncates each document to ``width = seq_len + 1`` tokens; a document that then
    has exactly ``width`` tokens (it had at least that many) is a window of its own; the shorter
    ones fill a buffer, which is emitted cut to ``width`` tokens as soon as it holds ``width`` or
    more, its remainder dropped. Windows come in the order of the document that completes them.

    The buffer only ever holds short documents, so over their lengths ``c`` (cumulative sum
    ``C``) a buffer that starts at short document ``p`` is completed by the first ``q`` with
    ``C[q] - C[p - 1] >= width``: one ``searchsorted`` for every ``p`` at once. Following those
    jumps from ``p = 0`` is the only loop, one step per buffer window.
    """
    if seq_len < 1:
      raise ValueError(f"seq_len must be >= 1, got {seq_len}.")
    width = seq_len + 1
    lengths = self.doc_lengths
    long_docs = np.flatnonzero(lengths >= width)
    short_docs = np.flatnonzero(lengths < width)
    c = lengths[short_docs]
    cum = np.cumsum(c)
    completes = np.searchsorted(cum, cum - c + width, side="left")  # q for a buffer starting at p
    firsts = np.empty(len(short_docs), np.int64)
    lasts = np.empty(len(short_docs), np.int64)
    n_buffer, p = 0, 0
    while p < len(short_docs):
      q = int(completes[p])
      if q >= len(short_docs):  # the last buffer never fills: dropped, as in cram_pack
        break
      firsts[n_buffer], lasts[n_buffer] = p, q
      n_buffer += 1
      p = q + 1
    firsts, lasts = firsts[:n_buffer], lasts[:n_buffer]
    # Each window is emitted at the document that completes it; no document completes two.
    order = np.argsort(np.concatenate([long_docs, short_docs[lasts]]), kind="stable")
    n_long = len(long_docs)
    index = CramIndex(
        shards=self, width=width,
        long_doc=np.concatenate([long_docs, np.full(n_buffer, -1, np.int64)])[order],
        first=np.concatenate([np.zeros(n_long, np.int64), firsts])[order],
        last=np.concatenate([np.full(n_long, -1, np.int64), lasts])[order],
        short_docs=short_docs)
    if not len(index):
      raise ValueError(f"the corpus is too small for even one window of {width} tokens "
                       f"({self.path}: {self.num_docs} documents, {self.num_tokens} tokens).")
    return index


def shard_dataset(path, seq_len: int, seed: int, split: str) -> grain.MapDataset:
  """The text task's stream over a token-shard directory: element for element what
  ``text_dataset(windows[n_eval:] or windows[:n_eval], eos_id, seed)`` gives for ``windows =
  cram_pack(documents, ...)``, with ``n_eval = max(1, len(windows) // 20)``.

  Random access: example ``i`` is computed from ``i`` alone (the shuffle permutes window numbers
  per epoch, as ``text_dataset``'s does, since it depends only on the split's length and
  ``seed``), so a resumed run or another host reads exactly the same stream.

  Args:
    path: a directory written by :func:`write_shards` / ``kvm-data``, or its open
      :class:`TokenShards`.
    seq_len: tokens per example (windows hold ``seq_len + 1``).
    seed: the shuffle seed.
    split: "train" (all windows after the first ``n_eval``) or "eval" (the first ``n_eval``).
  """
  if split not in ("train", "eval"):
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")
  shards = path if isinstance(path, TokenShards) else TokenShards(path)
  index = shards.cram_windows(seq_len)
  n = len(index)
  n_eval = max(1, n // 20)
  start, stop = (n_eval, n) if split == "train" else (0, n_eval)
  eos_id = shards.eos_id
  return (grain.MapDataset.range(start, stop).shuffle(seed=seed).repeat()
          .map(lambda k: lm_example(index.window(int(k)), eos_id)))
