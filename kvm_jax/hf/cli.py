"""``kvm-import``, ``kvm-export`` and ``kvm-convert``: Hugging Face checkpoints (the authors'
format, and transformers' of the Llama and Gemma families) to kvm_jax run directories and back
(docs/checkpoints.md, docs/pretrained.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from kvm_jax.util import compilation_cache
from kvm_jax.config.kvm import add_kvm_flag

# The readers and writers import JAX: each command imports them once its flags are parsed, so that
# --help and a bad flag answer without them. The two reading options, as
# kvm_jax.hf.authors_config.DTYPES and NUMERICS (tests/repository/test_cli_startup.py keeps them equal):
DTYPES = ("float32", "bfloat16")
NUMERICS = ("authors", "float32")

IMPORT_HELP = """\
Write a kvm_jax run directory (config.json, checkpoints/0 with the parameters, import.json) from a
Hugging Face checkpoint directory: the authors' format (config.json of their MixerConfig and
model.safetensors, or model-*.safetensors shards with model.safetensors.index.json), e.g. one of
the paper's released models, or a transformers directory of the Llama or Gemma family (Llama 2/3,
Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3 text: what save_pretrained writes), each fetched beforehand with `hf download`. The result works wherever a run directory
does: kvm-eval --checkpoint DEST, the lm-eval adapter (KVMEvalLM(checkpoint=DEST)),
kvm_jax.load_pretrained(DEST), and fine-tuning with kvm-train --config.init_from=DEST.

  kvm-import ~/models/kvm-256-120m runs/kvm256 --tokenizer gpt2/tokenizer.json
"""

EXPORT_HELP = """\
Write config.json + model.safetensors from a kvm_jax run directory's parameters: a GPTAlpha-2
model in the authors' format, loadable by their RWKV7BackboneForCausalLM.from_pretrained (their
repository's model/ on the Python path); a Llama- or Gemma-family model in transformers' format
(Llama, Qwen2, Qwen3, Mistral, Gemma 2 or Gemma 3, as its options say), loadable by
AutoModelForCausalLM.from_pretrained. What generate reads comes along: the special token ids in
config.json and a generation_config.json (an imported run's source's, else those its tokenizer
names), and the tensors keep the dtype the source stored them in unless --dtype says otherwise.
Models the format cannot express (kvm layers in transformers' format; cross-layer KV sharing, a
callable KVM budget, layer layouts other than one mixer or two alternating in the authors') are
refused with the reason.

  kvm-export runs/text exported/text-kvm
"""


CONVERT_HELP = """\
Convert the attention layers of a trained model into KVM layers and write a run directory.

SRC is a kvm_jax run directory (kvm-train, kvm-demo's sub-runs, kvm-import) or a checkpoint
directory: the authors' format (their GPTAlpha-2 models) or transformers' (Llama, Qwen2, Qwen3,
Mistral, Gemma 2, Gemma 3). The chosen layers (full attention; sliding-window attention, exact up to the shorter of
the two windows; block sliding-window attention whose chunks equal the KVM window's) become kvm
layers with the family's attention front end; every
parameter of SRC is kept, and the new ones (LN_s, the merge gate W_g, the window and state
temperatures) start where DEST's logits equal SRC's on every sequence of at most
window_chunks x chunk_size tokens; beyond that the compressed state takes over. DEST works
wherever a run directory does: kvm-eval --checkpoint DEST, kj.load_pretrained(DEST), generate,
and kvm-train --config.init_from=DEST (train/configs/distill.py distils it against SRC).

  kvm-convert runs/demo/full runs/full-as-kvm --layers all --kvm.budget=sqrt:4@8
  kvm-convert ~/models/gptalpha2-120m runs/converted --layers odd --kvm.chunk_size=256

KVM options (--kvm.FIELD=VALUE, any field of kvm_jax.KVMConfig): budget takes fixed:ROWS,
sqrt:FACTOR, pow:FACTOR:EXPONENT or sat:LIMIT, each with an optional @MIN_ROWS floor; without
flags the options are SRC's own kvm options when it records some, else KVMConfig's defaults with
SRC's rotary width (and the chunk geometry of converted bswa layers); when SRC rotates every
channel of its heads (Llama, Qwen, Mistral, Gemma), state_rope_dims is half the head, so that
the state keys keep the slower half of the rotary pairs (--kvm.state_rope_dims=none zeroes them
all, the paper's rule).
"""


def _reading_flags(p: argparse.ArgumentParser, when: str) -> None:
  """``--dtype`` and ``--numerics`` of reading an authors' checkpoint (``when``: a prefix saying
  when they apply)."""
  p.add_argument("--dtype", choices=DTYPES, default="float32",
                 help=f"{when}parameter and activation dtype of the run (default float32; "
                      "bfloat16 halves memory and is how the authors trained).")
  p.add_argument("--numerics", choices=NUMERICS, default="authors",
                 help=f"{when}'authors' (default) casts the RoPE tables and the KVM state-value "
                      "readout to bfloat16 as their code does, so logits match theirs; 'float32' "
                      "computes both in float32 (a transformers checkpoint always computes in "
                      "float32, as transformers does).")


def _fail(e: Exception) -> int:
  print(f"error: {e}", file=sys.stderr)
  return 2


def _destination_flags(p: argparse.ArgumentParser, work: str) -> argparse.ArgumentParser:
  """The flags both commands share: how DEST is treated and whether ``work`` shows a bar."""
  p.add_argument("--overwrite", action="store_true",
                 help="replace DEST if it exists and is not empty.")
  p.add_argument("--no-progress", action="store_true", help=f"no progress bar while {work}.")
  compilation_cache.add_flag(p)
  return p


# What a bad SRC, DEST, config or tensor raises (CheckpointError, ConfigError and ExportError are
# ValueErrors): reported in one line, exit status 2.
USER_ERRORS = (ValueError, FileExistsError, FileNotFoundError)


def import_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="kvm-import", description=IMPORT_HELP,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("src", help="the model directory (config.json + safetensors) in the authors' "
                             "or transformers' format.")
  p.add_argument("dest", help="the run directory to create (must not exist or be empty).")
  _reading_flags(p, "")
  p.add_argument("--tokenizer", default=None, metavar="TOKENIZER_JSON",
                 help="a tokenizer.json to record in the run (default: SRC/tokenizer.json when "
                      "present; otherwise none, and text evaluations need one: the paper's models "
                      "use GPT-2's).")
  return _destination_flags(p, "reading")


def import_main(argv: Optional[Sequence[str]] = None) -> int:
  args = import_parser().parse_args(argv)
  compilation_cache.enable(args.compilation_cache)
  from kvm_jax.hf.load import import_checkpoint
  from kvm_jax.nn.families.family import family_of
  try:
    dest = import_checkpoint(args.src, args.dest, dtype=args.dtype, numerics=args.numerics,
                             tokenizer_file=args.tokenizer, overwrite=args.overwrite,
                             progress=not args.no_progress)
  except USER_ERRORS as e:
    return _fail(e)
  from kvm_jax.runs.directory import load_config
  cfg = load_config(dest)
  print(f"imported {args.src} -> {dest}: {cfg.model.num_layers} layers "
        f"({', '.join(sorted(set(cfg.model.layer_mixers)))}), width {cfg.model.hidden_size}, "
        f"vocabulary {cfg.model.vocab_size}, {args.dtype}"
        + (f", {args.numerics} numerics"
           if family_of(cfg.model).CHECKPOINT_FORMAT == "authors" else "")
        + ("" if cfg.tokenizer_file else "; no tokenizer recorded (pass --tokenizer for text)"))
  return 0


def export_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="kvm-export", description=EXPORT_HELP,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("run_dir",
                 help="a kvm_jax run directory (kvm-train, a kvm-demo sub-run, kvm-import).")
  p.add_argument("dest", help="the directory to write (must not exist or be empty).")
  p.add_argument("--step", type=int, default=None,
                 help="checkpoint step to export (default: the newest).")
  p.add_argument("--dtype", choices=DTYPES, default=None,
                 help="tensor dtype in the file (default: the dtype the source stored its "
                      "weights in, for a run kvm-import wrote; else the run's parameter dtype).")
  p.add_argument("--max-shard-size", type=float, default=None, metavar="GB",
                 help="split the weights into shards of at most this many GB (10^9 bytes) with "
                      "model.safetensors.index.json, as Hugging Face does (default: one file).")
  return _destination_flags(p, "writing")


def export_main(argv: Optional[Sequence[str]] = None) -> int:
  args = export_parser().parse_args(argv)
  compilation_cache.enable(args.compilation_cache)
  from kvm_jax.hf.load import export_run, numerics_note
  shard = None if args.max_shard_size is None else int(args.max_shard_size * 1e9)
  if shard is not None and shard < 1:
    return _fail(ValueError(f"--max-shard-size={args.max_shard_size} must be positive."))
  try:
    files = export_run(args.run_dir, args.dest, step=args.step, dtype=args.dtype,
                       max_shard_bytes=shard, overwrite=args.overwrite,
                       progress=not args.no_progress)
  except USER_ERRORS as e:
    return _fail(e)
  from kvm_jax.runs.directory import load_config
  note = numerics_note(load_config(args.run_dir).model)
  from kvm_jax.hf.load import export_settings
  settings = export_settings(args.run_dir, args.dtype)
  print(f"exported {args.run_dir} -> {args.dest}: {', '.join(f.name for f in files)}; "
        f"{settings.summary()}")
  if note:
    print(f"note: {note}")
  return 0


def convert_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="kvm-convert", description=CONVERT_HELP,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("src", help="a kvm_jax run directory, or a checkpoint directory in the authors' "
                             "or transformers' format.")
  p.add_argument("dest", help="the run directory to write (must not exist or be empty).")
  p.add_argument("--layers", default="all",
                 help="which layers become kvm layers: all, odd (1,3,...), even (0,2,...), "
                      "global (the full-attention layers, e.g. Gemma's global ones), local (the "
                      "sliding-window ones) or comma-separated indices such as 1,3 (default: "
                      "all).")
  p.add_argument("--step", type=int, default=None,
                 help="checkpoint step of a run directory SRC (default: the newest).")
  _reading_flags(p, "when SRC is an authors' checkpoint (a run directory keeps its own): ")
  add_kvm_flag(p, "the new layers'")
  return _destination_flags(p, "reading")


def convert_main(argv: Optional[Sequence[str]] = None) -> int:
  args, rest = convert_parser().parse_known_args(argv)
  compilation_cache.enable(args.compilation_cache)
  from kvm_jax.nn.convert import kvm_flags
  from kvm_jax.runs.conversion import write_converted
  from kvm_jax.runs.directory import CONVERSION_RECORD
  try:
    fields = kvm_flags(args, rest)
    dest = write_converted(args.src, args.dest, layers=args.layers, kvm=fields or None,
                           step=args.step, dtype=args.dtype, numerics=args.numerics,
                           overwrite=args.overwrite,
                           progress=not args.no_progress)
  except USER_ERRORS as e:
    return _fail(e)
  record = json.loads((Path(dest) / CONVERSION_RECORD).read_text())
  kvm = record["kvm"]
  print(f"converted {args.src} -> {dest}: layers {record['layers']} are kvm "
        f"({'/'.join(record['mixers'])}); chunks of {kvm['chunk_size']} x {kvm['window_chunks']}, "
        f"budget {kvm['budget']}; {len(record['new_parameters'])} new parameter tensors; logits "
        f"equal the source's up to {record['exact_up_to_tokens']} tokens")
  return 0
