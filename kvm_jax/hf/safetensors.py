"""The safetensors format, read and written with numpy alone (no torch, no ``safetensors`` package).

A ``.safetensors`` file is an 8-byte little-endian header length N, N bytes of JSON, then the raw
tensor bytes. The JSON maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin,
end]}`` (offsets into the bytes after the header) and may hold ``"__metadata__"`` (str -> str).
Hugging Face splits large checkpoints into several files listed by ``model.safetensors.index.json``
(``{"weight_map": {tensor name: file name}}``).

Reading memory-maps the file, so a tensor costs nothing until it is used. Every structural fault —
a short file, a header that is not JSON, offsets outside the data, a size that does not match the
shape, a tensor listed twice — is a :class:`CheckpointError` naming the file and the tensor.
bfloat16 tensors come back as ``ml_dtypes.bfloat16`` arrays (JAX's own bfloat16 type).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Iterable, Mapping, Optional

import ml_dtypes
import numpy as np

from kvm_jax.util.progress import ProgressReport

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Pickled PyTorch checkpoints: never unpickled here (unpickling runs arbitrary code).
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

# safetensors dtype codes <-> numpy dtypes.
DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
CODES = {dtype: code for code, dtype in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the reference implementation's limit on the JSON header

CONVERT_HINT = (
    "Convert it to safetensors on a machine with PyTorch: "
    "`python -c \"import torch, safetensors.torch as st; "
    "sd = torch.load('pytorch_model.bin', map_location='cpu', weights_only=True); "
    "st.save_file({k: v.contiguous() for k, v in sd.items()}, 'model.safetensors')\"` "
    "(or load the model with transformers and call save_pretrained(dir, safe_serialization=True)).")


class CheckpointError(ValueError):
  """A checkpoint file or directory that cannot be read as asked; the message says which file,
  which tensor and what to do."""


def _header(path: Path) -> tuple[dict, int, int]:
  """(header dict, offset of the data, file size) of one safetensors file, validated."""
  size = path.stat().st_size
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors file "
                            "(truncated or not safetensors).")
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_HEADER or 8 + n > size:
      raise CheckpointError(f"{path}: header length {n} does not fit the file's {size} bytes "
                            "(truncated, or not a safetensors file).")
    raw = f.read(n)
  try:
    header = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e}).") from None
  if not isinstance(header, dict):
    raise CheckpointError(f"{path}: the safetensors header is not a JSON object.")
  data_start, data_size = 8 + n, size - 8 - n
  for name, info in header.items():
    if name == "__metadata__":
      continue
    try:
      dtype = DTYPES[info["dtype"]]
      shape = tuple(int(d) for d in info["shape"])
      begin, end = (int(o) for o in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
      if isinstance(info, dict) and info.get("dtype") not in DTYPES and "dtype" in info:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {info['dtype']!r}, which kvm_jax "
                              f"does not read (known: {sorted(DTYPES)}).") from None
      raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry "
                            f"{info!r}.") from None
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected or begin < 0:
      raise CheckpointError(f"{path}: tensor {name!r} ({info['dtype']} {list(shape)}) needs "
                            f"{expected} bytes but its offsets span {end - begin}.")
    if end > data_size:
      raise CheckpointError(f"{path}: tensor {name!r} ends at byte {end} of the data but the file "
                            f"holds only {data_size} bytes after its header: the file is "
                            "truncated (an interrupted download?); fetch it again.")
  return header, data_start, size


def tensor_info(path) -> dict[str, tuple[str, tuple[int, ...]]]:
  """``{name: (dtype code, shape)}`` of one safetensors file, without reading any data."""
  header, _, _ = _header(Path(path))
  return {name: (info["dtype"], tuple(info["shape"])) for name, info in header.items()
          if name != "__metadata__"}


def stored_dtype(directory) -> Optional[str]:
  """The dtype a model directory's floating tensors are stored in, by numpy's name ("float32",
  "bfloat16", ...), from the headers alone: the one they all share, "float32" when they differ
  (it holds float16 and bfloat16 values exactly), None when none is floating."""
  codes = {code for path in checkpoint_files(directory)
           for code, _ in tensor_info(path).values()}
  floating = {DTYPES[c].name for c in codes if c in ("F64", "F32", "F16", "BF16")}
  if len(floating) > 1:
    return "float32"
  return floating.pop() if floating else None


def read_metadata(path) -> dict[str, str]:
  """The ``__metadata__`` strings of one safetensors file (empty when it has none)."""
  return dict(_header(Path(path))[0].get("__metadata__") or {})


def read_file(path, names: Optional[Iterable[str]] = None) -> dict[str, np.ndarray]:
  """Tensors of one safetensors file as read-only, memory-mapped numpy arrays.

  ``names`` restricts the result (a name the file lacks is an error)."""
  path = Path(path)
  header, data_start, size = _header(path)
  wanted = [n for n in header if n != "__metadata__"] if names is None else list(names)
  out = {}
  if not wanted:
    return out
  whole = np.memmap(path, dtype=np.uint8, mode="r", shape=(size,))
  for name in wanted:
    if name not in header or name == "__metadata__":
      raise CheckpointError(f"{path}: no tensor named {name!r}.")
    info = header[name]
    begin, end = info["data_offsets"]
    dtype = DTYPES[info["dtype"]]
    buf = whole[data_start + begin:data_start + end]
    out[name] = buf.view(dtype).reshape(tuple(info["shape"]))
  return out


def write_file(path, tensors: Mapping[str, np.ndarray],
               metadata: Optional[Mapping[str, str]] = None) -> None:
  """Writes ``tensors`` (C-contiguous little-endian copies are made as needed) to ``path``
  atomically: a temporary file in the same folder, renamed once complete. Tensors are stored in
  name order; the header is padded to a multiple of 8 bytes, as the reference writer does."""
  path = Path(path)
  header: dict = {}
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  arrays, offset = [], 0
  for name in sorted(tensors):
    arr = np.asarray(tensors[name])
    if arr.dtype.byteorder == ">":  # safetensors is little-endian
      arr = arr.astype(arr.dtype.newbyteorder("<"))
    if arr.dtype not in CODES:
      raise CheckpointError(f"tensor {name!r} has dtype {arr.dtype}, which safetensors cannot "
                            f"store here (known: {sorted(str(d) for d in CODES)}).")
    arr = np.require(arr, requirements="C")  # (np.ascontiguousarray would make a scalar 1-d)
    header[name] = {"dtype": CODES[arr.dtype], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + arr.nbytes]}
    arrays.append(arr)
    offset += arr.nbytes
  raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
  raw += b" " * (-len(raw) % 8)
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for arr in arrays:
      f.write(memoryview(arr.reshape(-1).view(np.uint8)))
  os.replace(tmp, path)


def read_weight_map(index: Path) -> dict[str, str]:
  """The ``weight_map`` of a ``model.safetensors.index.json``: tensor name -> file name, every
  file a plain name in the index's own folder."""
  try:
    weight_map = json.loads(index.read_text())["weight_map"]
  except (json.JSONDecodeError, KeyError, TypeError) as e:
    raise CheckpointError(f"{index}: not a safetensors index ({e!r}); it needs a "
                          "\"weight_map\" object.") from None
  if not isinstance(weight_map, dict) or not all(
      isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
    raise CheckpointError(f"{index}: \"weight_map\" must map tensor names to file names.")
  for name, file in weight_map.items():
    if Path(file).name != file or file in (".", ".."):
      raise CheckpointError(f"{index} assigns tensor {name!r} to {file!r}; shards must be plain "
                            "file names in the same directory.")
  return weight_map


def checkpoint_files(directory) -> list[Path]:
  """The safetensors files of a Hugging Face model directory: ``model.safetensors``, or the files
  its ``model.safetensors.index.json`` names, or a lone ``*.safetensors``. Pickled checkpoints
  (``pytorch_model.bin`` and the like) are refused with the command that converts them."""
  directory = Path(directory)
  if not directory.is_dir():
    raise CheckpointError(f"{directory} is not a directory.")
  index = directory / INDEX_FILE
  if index.exists():
    weight_map = read_weight_map(index)
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not (directory / f).exists()]
    if missing:
      raise CheckpointError(f"{index} lists {missing}, which {directory} does not hold "
                            "(an incomplete download?).")
    return [directory / f for f in files]
  if (directory / SINGLE_FILE).exists():
    return [directory / SINGLE_FILE]
  found = sorted(directory.glob("*.safetensors"))
  if len(found) == 1:
    return found
  if len(found) > 1:
    names = [p.name for p in found]
    raise CheckpointError(f"{directory} holds several .safetensors files ({names}) "
                          f"but no {INDEX_FILE} saying which tensors each holds.")
  pickled = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLED_SUFFIXES)
  if pickled:
    raise CheckpointError(f"{directory} holds only pickled PyTorch weights ({pickled}), which "
                          "kvm_jax never unpickles (unpickling can run arbitrary code). "
                          + CONVERT_HINT)
  raise CheckpointError(f"{directory} holds no {SINGLE_FILE}, {INDEX_FILE} or other "
                        ".safetensors file.")


def read_checkpoint(directory) -> dict[str, np.ndarray]:
  """Every tensor of a Hugging Face model directory (single file or sharded with an index), as
  memory-mapped numpy arrays: the headers are read and checked, the data stays on disk until used.
  A tensor that appears in two files, or that the index assigns to another file than the one
  holding it, is an error."""
  directory = Path(directory)
  files = checkpoint_files(directory)
  index = directory / INDEX_FILE
  weight_map = read_weight_map(index) if index.exists() else None
  tensors: dict[str, np.ndarray] = {}
  where: dict[str, str] = {}
  for path in files:
    for name, arr in read_file(path).items():
      if name in tensors:
        raise CheckpointError(f"tensor {name!r} appears in both {where[name]} and {path.name}.")
      if weight_map is not None and weight_map.get(name) != path.name:
        raise CheckpointError(f"{path.name} holds tensor {name!r}, which {INDEX_FILE} assigns to "
                              f"{weight_map.get(name)!r}.")
      tensors[name], where[name] = arr, path.name
  if weight_map is not None:
    absent = sorted(set(weight_map) - set(tensors))
    if absent:
      raise CheckpointError(f"{INDEX_FILE} lists tensors that no file holds: {absent[:8]}"
                            f"{' ...' if len(absent) > 8 else ''}.")
  return tensors


def write_checkpoint(directory, tensors: Mapping[str, np.ndarray],
                     metadata: Optional[Mapping[str, str]] = None,
                     max_shard_bytes: Optional[int] = None, progress: bool = True) -> list[Path]:
  """Writes ``tensors`` into ``directory`` as ``model.safetensors``, or, when they exceed
  ``max_shard_bytes``, as ``model-0000i-of-0000n.safetensors`` files plus
  ``model.safetensors.index.json`` (Hugging Face's layout; tensors are never split). Returns the
  files written."""
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  names = sorted(tensors)
  sizes = {n: np.asarray(tensors[n]).nbytes for n in names}
  shards: list[list[str]] = [[]]
  filled = 0  # bytes in the last shard
  for n in names:
    if max_shard_bytes and shards[-1] and filled + sizes[n] > max_shard_bytes:
      shards.append([])
      filled = 0
    shards[-1].append(n)
    filled += sizes[n]
  report = ProgressReport(sum(sizes.values()), "write", min_interval=0.2) if progress else None
  if len(shards) == 1:
    files = [directory / SINGLE_FILE]
  else:
    files = [directory / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
             for i in range(len(shards))]
  done = 0
  for path, shard in zip(files, shards):
    write_file(path, {n: tensors[n] for n in shard}, metadata)
    done += sum(sizes[n] for n in shard)
    if report:
      report.update(done, path.name, final=path == files[-1])
  if len(files) > 1:
    index = {"metadata": {"total_size": sum(sizes.values())},
             "weight_map": {n: path.name for path, shard in zip(files, shards) for n in shard}}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
  return files
