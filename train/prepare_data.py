"""``kvm-data``: tokenize a text corpus once into token shards that training memory-maps.

  kvm-data data/*.jsonl --out=shards/mycorpus
  kvm-data --hf-dataset=roneneldan/TinyStories --hf-split=train --out=shards/tinystories
  kvm-data notes/*.txt --tokenizer=tokenizer.json --out=shards/notes --shard-tokens=50000000

Then train with ``kvm-train --config=train/configs/tiny_text.py --workdir=W
--config.data_dir=shards/mycorpus``: the "cram" windows are formed from the shards at read time,
so one directory serves every sequence length.

Inputs: ``.jsonl`` files give one document per non-blank line (the ``--text-field`` of each
JSON record); any other file (``.txt``) is one document. Glob patterns are expanded here too
(quote them to keep the shell from doing it), each pattern's matches in sorted order. Documents
are written in input order; the first 5% of the packed windows become the eval split.
"""

from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path
from typing import Optional, Sequence

from kvm_jax.tasks.tokenizers import tokenizer as make_tokenizer


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="kvm-data", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("inputs", nargs="*", metavar="FILE",
                 help="local .jsonl (one document per line) or .txt (one document per file) "
                      "files, or glob patterns of them.")
  p.add_argument("--hf-dataset", default="", metavar="NAME",
                 help="instead of files: a HuggingFace dataset already in the local cache (name "
                      "or local path; offline, nothing is downloaded; needs `datasets`).")
  p.add_argument("--hf-split", default="train", metavar="SPLIT",
                 help="split of --hf-dataset (default: train).")
  p.add_argument("--text-field", default="text", metavar="FIELD",
                 help="JSON field (.jsonl) or dataset column (--hf-dataset) holding the text "
                      "(default: text).")
  p.add_argument("--tokenizer", default="", metavar="FILE",
                 help="a local tokenizer.json (needs `tokenizers`); default: UTF-8 bytes. Train "
                      "with the same file as --config.tokenizer_file.")
  p.add_argument("--out", required=True, metavar="DIR",
                 help="output directory (new or empty) for shard-*.bin and manifest.json.")
  p.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N",
                 help="tokens per shard file at most (a longer single document gets its own "
                      "shard; default: 100,000,000).")
  p.add_argument("--overwrite", action="store_true",
                 help="allow a non-empty --out: its manifest and shards are replaced.")
  p.add_argument("--no-eos", action="store_true",
                 help="do not append the tokenizer's EOS token to each document.")
  return p


def expand_inputs(patterns: Sequence[str]) -> list[str]:
  """Existing paths as given; glob patterns expanded (sorted). Missing files are errors."""
  paths = []
  for pattern in patterns:
    if Path(pattern).exists():
      paths.append(pattern)
    elif glob.has_magic(pattern):
      matches = sorted(glob.glob(pattern, recursive=True))
      if not matches:
        raise SystemExit(f"kvm-data: no file matches {pattern!r}.")
      paths.extend(matches)
    else:
      raise SystemExit(f"kvm-data: input file {pattern!r} does not exist.")
  return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = build_parser().parse_args(argv)
  if args.inputs and args.hf_dataset:
    raise SystemExit("kvm-data: give input files or --hf-dataset, not both.")
  if not args.inputs and not args.hf_dataset:
    raise SystemExit("kvm-data: no input; give .jsonl/.txt files (or glob patterns) or "
                     "--hf-dataset=NAME. See kvm-data --help.")
  if args.shard_tokens < 1:
    raise SystemExit(f"kvm-data: --shard-tokens must be >= 1, got {args.shard_tokens}.")
  if args.tokenizer and not Path(args.tokenizer).is_file():
    raise SystemExit(f"kvm-data: --tokenizer {args.tokenizer!r} does not exist.")
  from kvm_jax.tasks import shards, text  # grain, which imports JAX: after the flags are checked
  try:
    tok = make_tokenizer(args.tokenizer)
    if args.hf_dataset:
      docs = text.iter_hf_documents(args.hf_dataset, args.hf_split, args.text_field)
    else:
      docs = text.iter_documents(expand_inputs(args.inputs), args.text_field)
    manifest = shards.write_shards(docs, tok, args.out, shard_tokens=args.shard_tokens,
                                   append_eos=not args.no_eos, overwrite=args.overwrite,
                                   tokenizer_file=args.tokenizer)
  except ValueError as e:
    raise SystemExit(f"kvm-data: {e}") from None
  files = [s["file"] for s in manifest["shards"]]
  eos = f"eos_id {manifest['eos_id']}" + ("" if manifest["append_eos"] else ", not appended")
  print(f"documents: {manifest['num_docs']:,}\n"
        f"tokens:    {manifest['num_tokens']:,} ({manifest['dtype']}, {eos})\n"
        f"shards:    {len(files)} ({files[0]}{' .. ' + files[-1] if len(files) > 1 else ''})\n"
        f"out dir:   {args.out}")
  sys.stdout.flush()
  return 0


if __name__ == "__main__":
  sys.exit(main())
