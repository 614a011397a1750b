"""Which fields a resumed run may change, field by field (``kvm_jax.runs.resume.RESUMABLE``).

Every field of a config (the task specs, every mixer kind's options, every backbone family's) is
changed alone, through the command line's ``--config.FIELD=VALUE``:

* ``check_resume`` refuses the change, naming the field, unless the field is resumable, or a
  spec of a task neither config trains on (accepted as no change at all);
* a resumable field is proven harmless by properties it must not touch: the first batches of
  the training stream, and the shapes and dtypes of the parameters of the model the resumed run
  builds (``jax.eval_shape``: nothing is compiled or allocated);
* a field that must stay is proven to matter: it changes those batches or parameters, or it is
  one of :data:`FUNCTION_FIELDS`, each with the reason it decides what the model or the
  objective computes from the same parameters and data. That list is exact: none of them is
  resumable, and none has a batch or shape witness.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import jax
import numpy as np
import pytest
from flax import nnx

import kvm_jax as kj
import kvm_jax.nn  # registers the backbone families  # noqa: F401
from kvm_jax.config import budget as budget_lib
from kvm_jax.config import io as config_io
from kvm_jax.runs.directory import TRAIN_CLASSES, save_config
from kvm_jax.runs.resume import RESUMABLE, check_resume, config_differences
from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.tasks.mqar import MQARSpec
from kvm_jax.tasks.niah import NIAHSpec
from kvm_jax.tasks.pipeline import BatchReader
from kvm_jax.train.data import task_dataset
from kvm_jax.train.main import apply_override
from kvm_jax.train.start import with_init_model

TASK_SPECS = ("mqar", "niah")

# A kvm layer's rotary channels are the model's (KVMConfig checks it): they change together.
ROPE_DIMS = (("model.rope_dims", "4"), ("model.options.kvm.rope_dims", "4"))
# Another valid value of every field, as a command line spells it (or the flags that change it
# with the fields it must agree with); "{name}" is a file of the test's (the fixture ``files``).
# Family options are per family (FAMILY_ALTERNATIVES); model.family is changed with its options
# (_changed).
ALTERNATIVES = {
    "model.vocab_size": "384", "model.num_layers": "4", "model.hidden_size": "128",
    "model.num_heads": "2", "model.num_kv_heads": "2", "model.head_dim": "32",
    "model.value_head_dim": "32", "model.mixers": "swa",
    "model.options.bswa.chunk_size": "16", "model.options.bswa.window_chunks": "3",
    "model.options.bswa.sink_rows": "0",
    "model.options.kvm.chunk_size": "16", "model.options.kvm.window_chunks": "3",
    "model.options.kvm.sink_rows": "0", "model.options.kvm.rope_dims": ROPE_DIMS,
    "model.options.kvm.budget": "fixed:16", "model.options.kvm.max_state_rows": "64",
    "model.options.kvm.gate_keys": "false", "model.options.kvm.gate_values": "false",
    "model.options.kvm.gate_appends": "true", "model.options.kvm.gate_initial_state": "true",
    "model.options.kvm.head_temperatures": "false", "model.options.kvm.value_norm": "none",
    "model.options.kvm.readout_value_dtype": "bfloat16", "model.options.kvm.ln_eps": "1e-6",
    "model.options.kvm.logit_softcap": "30.0", "model.options.kvm.state_rope_dims": "4",
    "model.options.ovq.chunk_size": "16", "model.options.ovq.max_centroids": "16",
    "model.options.ovq.min_state_size": "true", "model.options.ovq.count_bias": "false",
    "model.options.ovq.normalize_centroids": "true", "model.options.ovq.delta_rule": "true",
    "model.options.rwkv7.chunk_size": "8",
    "model.options.swa.window": "16", "model.options.swa.rope_dims": "8",
    "model.rope_dims": ROPE_DIMS, "model.rope_theta": "500000.0", "model.residual_scale": "0.5",
    "model.mup_base_dim": "128", "model.param_dtype": "bfloat16",
    "model.compute_dtype": "bfloat16", "model.rope_table_dtype": "bfloat16",
    "model.kvm_implementation": "auto", "model.attention_implementation": "xla",
    "model.kv_sharing": "cla", "model.fusedkv_init": "mean",
    "model.kvm_kv_sharing": "shared_routing",
    "mqar.seq_len": "48", "mqar.vocab_size": "96", "mqar.num_pairs": "6",
    "mqar.power_a": "0.1", "niah.seq_len": "640", "niah.min_len": "450",
    "niah.task": "niah_single_2", "niah.tokenizer_file": "{tokenizer}",
    "text_files": "{corpus}", "seq_len": "48", "packing": "pad", "batch_size": "4",
    "steps": "20", "warmup_steps": "2", "learning_rate": "1e-3", "weight_decay": "0.01",
    "seed": "1", "log_every": "5", "eval_every": "5", "checkpoint_every": "7",
    "eval_batches": "2", "keep_checkpoints": "1", "mesh_data": "1", "mesh_fsdp": "2",
    "mesh_tensor": "2", "tokenizer_file": "{tokenizer}", "hf_dataset": "other/corpus",
    "hf_split": "validation", "hf_text_field": "content", "data_dir": "{shards}",
    "peak_tflops_per_device": "100.0", "remat": "block", "grad_accum_steps": "2",
    "loss_slice_len": "16", "grad_clip_norm": "1.0", "on_nonfinite": "skip",
    "init_from": "{other_run}", "teacher": "{other_run}", "distill.stage": "logits",
    "distill.temperature": "2.0", "distill.kl_weight": "0.25", "distill.trainable": "kvm_only",
}
FAMILY_ALTERNATIVES = {
    "gptalpha2": {"ffn_expansion": "2.0", "tokenshift_attention": "false",
                  "tokenshift_mlp": "false", "value_residual": "false",
                  "share_value_anchor": "true"},
    "llama": {"intermediate_size": "96", "norm_eps": "1e-5", "qkv_bias": "true",
              "output_bias": "true", "mlp_bias": "true", "qk_norm": "true",
              "tie_embeddings": "true", "rope_scaling": "llama3", "rope_factor": "8.0",
              "rope_low_freq_factor": "2.0", "rope_high_freq_factor": "8.0",
              "rope_original_max_len": "4096", "initializer_range": "0.01"},
    "gemma": {"intermediate_size": "96", "norm_eps": "1e-5", "query_pre_attn_scalar": "32.0",
              "local_layers": "0", "local_rope_theta": "20000.0", "rope_scaling": "linear",
              "rope_factor": "2.0", "attention_bias": "true", "qk_norm": "false",
              "attention_softcap": "50.0", "final_logit_softcap": "30.0",
              "initializer_range": "0.01"},
}
NEXT_TASK = {"mqar": "niah", "niah": "text", "text": "mqar"}
NEXT_FAMILY = {"gptalpha2": "llama", "llama": "gemma", "gemma": "gptalpha2"}

# Fields that must stay although they change neither the batches nor the parameters' shapes: why
# each decides what is computed from the same parameters and data (or what a step optimizes).
FUNCTION_FIELDS = {
    "model.options.kvm.window_chunks": "the exact window each query attends",
    "model.options.kvm.sink_rows": "the rows every query keeps",
    "model.options.kvm.chunk_size": "the chunk the state grows by",
    "model.options.kvm.rope_dims": "the rotary channels of the keys and queries",
    "model.options.kvm.budget": "how many state rows the model keeps",
    "model.options.kvm.max_state_rows": "the state's cap",
    "model.options.kvm.gate_keys": "whether keys are gated",
    "model.options.kvm.gate_values": "whether values are gated",
    "model.options.kvm.gate_appends": "whether appended rows are gated",
    "model.options.kvm.gate_initial_state": "whether the initial state is gated",
    "model.options.kvm.value_norm": "how values are normalised",
    "model.options.kvm.readout_value_dtype": "the precision of the readout",
    "model.options.kvm.ln_eps": "LN_s's epsilon",
    "model.options.kvm.logit_softcap": "the scores' soft cap",
    "model.options.kvm.state_rope_dims": "the rotary channels of the state",
    "model.options.bswa.chunk_size": "the block of the window",
    "model.options.bswa.window_chunks": "the window's length",
    "model.options.bswa.sink_rows": "the rows every query keeps",
    "model.options.swa.window": "the window's length",
    "model.options.swa.rope_dims": "the rotary channels",
    "model.options.ovq.chunk_size": "the chunk the state is updated by",
    "model.options.ovq.max_centroids": "the state's size",
    "model.options.ovq.min_state_size": "the state's size",
    "model.options.ovq.count_bias": "the readout's bias by counts",
    "model.options.ovq.normalize_centroids": "the centroids' normalisation",
    "model.options.ovq.delta_rule": "the state's update rule",
    "model.options.rwkv7.chunk_size": "the scan's chunking of the recurrence's numerics",
    "model.family_options.share_value_anchor": "which value the value residual mixes in",
    "model.rope_dims": "the rotary channels of the layers without their own",
    "model.rope_theta": "the rotary frequencies",
    "model.residual_scale": "the residual branches' scale",
    "model.mup_base_dim": "CompleteP's width multipliers (forward scales, learning rates)",
    "model.rope_table_dtype": "the rotary table's precision",
    "model.fusedkv_init": "the fused projections' initialisation",
    "model.kvm_kv_sharing": "what a kvm layer shares across layers",
    "llama:norm_eps": "the norms' epsilon",
    "llama:rope_scaling": "the rotary frequencies",
    "llama:rope_factor": "the rotary frequencies",
    "llama:rope_low_freq_factor": "the rotary frequencies",
    "llama:rope_high_freq_factor": "the rotary frequencies",
    "llama:rope_original_max_len": "the rotary frequencies",
    "llama:initializer_range": "the initialisation (a fresh run's parameters)",
    "gemma:norm_eps": "the norms' epsilon",
    "gemma:query_pre_attn_scalar": "the scores' scale",
    "gemma:local_layers": "which layers attend locally",
    "gemma:local_rope_theta": "the local layers' rotary frequencies",
    "gemma:rope_scaling": "the rotary frequencies",
    "gemma:rope_factor": "the rotary frequencies",
    "gemma:attention_softcap": "the scores' soft cap",
    "gemma:final_logit_softcap": "the logits' soft cap",
    "gemma:initializer_range": "the initialisation (a fresh run's parameters)",
    "teacher": "the frozen model the distillation objective compares with",
    "distill.stage": "the objective",
    "distill.temperature": "the objective's KL temperature",
    "distill.kl_weight": "the objective's mixture of KL and cross-entropy",
    "distill.trainable": "which parameters train (the others are frozen)",
}


def _model(**fields) -> kj.ModelConfig:
  """Two layers (cross-layer sharing needs them), holding the tiny options of every mixer kind."""
  return kj.presets.tiny(**{"mixers": "kvm", "num_layers": 2, "vocab_size": 320, **fields})


def _bases() -> dict[str, TrainConfig]:
  """A config per task, one with a Hugging Face corpus, and one per other backbone family."""
  mqar = TrainConfig(model=_model(), task="mqar", mqar=MQARSpec(seq_len=32, vocab_size=64,
                                                                num_pairs=4),
                     batch_size=2, steps=10, warmup_steps=1, checkpoint_every=5)
  text = dataclasses.replace(mqar, task="text", seq_len=32)
  return {
      "mqar": mqar,
      "niah": dataclasses.replace(mqar, task="niah", niah=NIAHSpec(seq_len=512)),
      "text": text,
      "text_hf": dataclasses.replace(text, hf_dataset="some/corpus"),
      "llama": dataclasses.replace(mqar, model=_model(mixers="full", family="llama")),
      "gemma": dataclasses.replace(mqar, model=_model(mixers="full", family="gemma")),
  }


def _leaves(value, prefix: str = "") -> dict:
  """``{dotted path: value}`` of a config's leaves, walked over its dataclass fields and option
  tables (a budget and a sequence are leaves): independent of ``config_io.flat_fields``."""
  budgets = (budget_lib.FixedBudget, budget_lib.PowerLawBudget, budget_lib.SaturatingBudget)
  if isinstance(value, Mapping):
    items = value.items()
  elif dataclasses.is_dataclass(value) and not isinstance(value, budgets):
    items = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
  else:
    return {prefix: value}
  out = {}
  for name, item in items:
    out.update(_leaves(item, f"{prefix}.{name}" if prefix else name))
  return out


def _alternative(cfg: TrainConfig, field: str) -> str:
  if field == "task":
    return NEXT_TASK[cfg.task]
  if field.startswith("model.family_options."):
    return FAMILY_ALTERNATIVES[cfg.model.family][field.rsplit(".", 1)[1]]
  return ALTERNATIVES[field]


def _has_alternative(cfg: TrainConfig, field: str) -> bool:
  try:
    _alternative(cfg, field)
    return True
  except KeyError:
    return False


def _changed(cfg: TrainConfig, field: str, files: dict) -> TrainConfig:
  """``cfg`` with ``field`` alone changed, through kvm-train's ``--config.FIELD=VALUE``."""
  if field == "model.family":  # another family comes with its own options (their defaults)
    model = dataclasses.replace(cfg.model, family=NEXT_FAMILY[cfg.model.family],
                                family_options=None)
    return dataclasses.replace(cfg, model=model)
  flags = _alternative(cfg, field)
  if isinstance(flags, str):
    return apply_override(cfg, field, flags.format(**files))
  # Fields that must agree change at once: in the config's JSON form, read back (and checked).
  data = config_io.to_jsonable(cfg)
  for name, text in flags:
    *path, leaf = name.split(".")
    owner = data
    for key in path:
      owner = owner[key]
    owner[leaf] = config_io.parse_value(owner[leaf], text, leaf)
  return config_io.from_jsonable(data, TRAIN_CLASSES)


def _function_key(cfg: TrainConfig, field: str) -> str:
  """The key of ``field`` in FUNCTION_FIELDS (another family's options: ``FAMILY:FIELD``)."""
  if field.startswith("model.family_options.") and cfg.model.family != "gptalpha2":
    return f"{cfg.model.family}:{field.rsplit('.', 1)[1]}"
  return field


def _unused_spec(cfg: TrainConfig, field: str) -> bool:
  """A field of a task's spec when the run trains on another task."""
  head = field.split(".")[0]
  return head in TASK_SPECS and head != cfg.task


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
  """The files some alternatives name: a corpus, a tokenizer, token shards, another run."""
  tokenizers = pytest.importorskip("tokenizers")
  root = tmp_path_factory.mktemp("resume-fields")
  docs = [f"document {i}: " + "the quick brown fox jumps over the lazy dog " * (3 + i % 5)
          for i in range(60)]
  (root / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  words = sorted({w for d in docs for w in d.split()})
  vocab = {"<|endoftext|>": 0, **{w: i + 1 for i, w in enumerate(words)}}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<|endoftext|>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.save(str(root / "tokenizer.json"))
  from kvm_jax.tasks.shards import write_shards
  from kvm_jax.tasks.tokenizers import ByteTokenizer
  write_shards(docs, ByteTokenizer(), root / "shards", progress=False)
  save_config(TrainConfig(model=_model(num_layers=4)), root / "other", verbose=False)
  return {"corpus": str(root / "corpus.jsonl"), "tokenizer": str(root / "tokenizer.json"),
          "shards": str(root / "shards"), "other_run": str(root / "other")}


def _saved(cfg: TrainConfig, workdir) -> str:
  """A run directory holding ``cfg`` and a checkpoint (step 5) to resume: nothing is trained."""
  save_config(cfg, workdir, verbose=False)
  (workdir / "checkpoints" / "5").mkdir(parents=True)
  return str(workdir)


def test_the_table_names_every_field_of_every_config():
  """Every field of the configs below has an alternative here, and every resumable field is a
  field (a misspelt entry of RESUMABLE would allow nothing)."""
  fields = set()
  for cfg in _bases().values():
    leaves = _leaves(cfg)
    assert set(leaves) == set(config_io.flat_fields(cfg)), "flat_fields misses or adds a field"
    missing = [f for f in leaves if f != "model.family" and not _has_alternative(cfg, f)]
    assert not missing, f"no alternative value for {missing}"
    fields |= set(leaves)
  assert set(RESUMABLE) <= fields, set(RESUMABLE) - fields
  assert {f for f in FUNCTION_FIELDS if ":" not in f} <= fields


@pytest.mark.parametrize("base", ["mqar", "niah", "text", "llama", "gemma"])
def test_every_field_is_refused_by_name_unless_resumable(tmp_path, files, base):
  """Each field changed alone: refused, the message naming it (old → new) and nothing else;
  accepted with exactly that change when resumable; accepted as no change when it is the spec
  of a task neither config trains on."""
  cfg = _bases()[base]
  workdir = _saved(cfg, tmp_path / "run")
  before = _leaves(cfg)
  for field in before:
    new = _changed(cfg, field, files)
    after = _leaves(new)
    changed = {f for f in {*before, *after} if before.get(f) != after.get(f)}
    flags = _alternative(cfg, field) if field != "model.family" else None
    if field == "model.family":  # with the new family's options
      assert field in changed and all(f.startswith("model.family") for f in changed)
    elif isinstance(flags, str):
      assert changed == {field}, (field, changed)
    else:  # with the fields it must agree with
      assert field in changed and changed <= {name for name, _ in flags}, (field, changed)
    if field in RESUMABLE or _unused_spec(cfg, field):
      step, differences = check_resume(new, workdir)
      assert step == 5
      assert [d.field for d in differences] == ([] if _unused_spec(cfg, field) else [field])
      continue
    with pytest.raises(ValueError) as refused:
      check_resume(new, workdir)
    listed = [line.strip().split(": ", 1)[0] for line in str(refused.value).splitlines()
              if line.startswith("  ")]
    order = list(dict.fromkeys([*config_io.flat_fields(cfg), *config_io.flat_fields(new)]))
    assert listed == sorted(changed, key=order.index), (field, listed)


def test_unused_task_specs_are_ignored_only_while_unused():
  """config_differences skips MQAR's spec when neither config trains on MQAR, compares it when
  either does (the other task's spec, likewise)."""
  mqar = _bases()["mqar"]
  text = dataclasses.replace(mqar, task="text")
  bigger = lambda c: dataclasses.replace(c, mqar=dataclasses.replace(c.mqar, num_pairs=6),
                                         niah=dataclasses.replace(c.niah, seq_len=1024))
  assert config_differences(text, bigger(text)) == []
  assert [d.field for d in config_differences(mqar, bigger(mqar))] == ["mqar.num_pairs"]
  # Either side training on the task makes its spec count: the task changes with it.
  assert [d.field for d in config_differences(text, bigger(mqar))] == ["task", "mqar.num_pairs"]
  assert [d.field for d in config_differences(mqar, bigger(text))] == ["task", "mqar.num_pairs"]
  niah = dataclasses.replace(mqar, task="niah")
  assert [d.field for d in config_differences(niah, bigger(niah))] == ["niah.seq_len"]


def _batches(cfg: TrainConfig) -> list[dict]:
  """The first two global batches of the run's training stream."""
  reader = BatchReader(task_dataset(cfg, "train"), cfg.batch_size, prefetch=False)
  return [reader.read(0), reader.read(1)]


def _same_batches(a: list[dict], b: list[dict]) -> bool:
  return all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
             for x, y in zip(a, b))


def _parameters(model: kj.ModelConfig) -> list:
  """(path, shape, dtype) of every parameter of LM(model), traced abstractly."""
  # Rngs passed in, not made inside: its counter then traces in half the time.
  state = nnx.state(nnx.eval_shape(lambda rngs: kj.LM(model, rngs=rngs), nnx.Rngs(0)), nnx.Param)
  return [(jax.tree_util.keystr(p), x.shape, x.dtype)
          for p, x in jax.tree_util.tree_leaves_with_path(state)]


# Fields that act between layers: witnessed on two (every other field on one, as tracing a
# model costs time quadratic in its size).
ACROSS_LAYERS = ("model.kv_sharing", "model.fusedkv_init", "model.kvm_kv_sharing")


def _witness_model(cfg: TrainConfig, field: str) -> TrainConfig:
  """``cfg`` with the smallest model ``field`` acts in: one layer (two for ACROSS_LAYERS), of
  the kind whose options ``field`` names (the options of a kind no layer has change nothing,
  by construction)."""
  parts = field.split(".")
  mixers = parts[2] if parts[:2] == ["model", "options"] else cfg.model.mixers
  layers = 2 if field in ACROSS_LAYERS else 1
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mixers=mixers,
                                                            num_layers=layers))


@pytest.fixture
def hf_corpus(monkeypatch):
  """A stand-in for the Hugging Face cache: documents that depend on (name, split, field)."""
  from kvm_jax.tasks import text
  monkeypatch.setattr(text, "read_hf_documents", lambda name, split, field: [
      f"{name} {split} {field} {i} " * 8 for i in range(40)])


# The base each field that is not resumable is witnessed on: where the field is read.
WITNESS_BASE = {"niah": "niah", "mqar": "mqar", "text_files": "text", "seq_len": "text",
                "packing": "text", "tokenizer_file": "text", "data_dir": "text",
                "hf_dataset": "text_hf", "hf_split": "text_hf", "hf_text_field": "text_hf"}


def _witness_base(field: str) -> str:
  if field.startswith("model.family_options."):
    return "mqar"
  return WITNESS_BASE.get(field, WITNESS_BASE.get(field.split(".")[0], "mqar"))


def test_resumable_fields_change_neither_the_batches_nor_the_parameters(tmp_path, files,
                                                                       hf_corpus):
  """For every resumable field on every base: the batches the resumed run reads and the
  parameters of the model it builds (through init_from's resolution, as the trainer does) are
  those of the run it resumes."""
  seen = set()  # (model, field): the bases share models
  for name, cfg in _bases().items():
    workdir = _saved(cfg, tmp_path / name)
    batches = _batches(cfg)
    for field in RESUMABLE:
      new = _changed(cfg, field, files)
      assert _same_batches(_batches(new), batches), (name, field)
      # What the resumed run builds: with init_from, the model its directory records.
      built = with_init_model(new, workdir).model
      if built != cfg.model and (built, field) not in seen:
        seen.add((built, field))
        small = _witness_model(new, field).model
        assert _parameters(small) == _parameters(_witness_model(cfg, field).model), (name, field)


def test_fields_that_must_stay_change_the_batches_the_parameters_or_what_is_computed(
    files, hf_corpus):
  """Every field that is not resumable (a used task spec) changes the first batches or the
  parameters' shapes or dtypes, or is in FUNCTION_FIELDS; those have neither witness, and none
  is resumable."""
  assert not set(FUNCTION_FIELDS) & set(RESUMABLE)
  bases = _bases()
  unwitnessed, shapes, batches = set(), {}, {}
  for name in ("mqar", "llama", "gemma", "niah", "text", "text_hf"):
    for field in _leaves(bases[name]):
      if field in RESUMABLE or _unused_spec(bases[name], field):
        continue
      if _witness_base(field) != name and not (field.startswith("model.family_options.")
                                               and name in ("llama", "gemma")):
        continue
      cfg = _witness_model(bases[name], field)
      new = _changed(cfg, field, files)
      if field.startswith("model."):
        if cfg.model not in shapes:
          shapes[cfg.model] = _parameters(cfg.model)
        if _parameters(new.model) != shapes[cfg.model]:
          continue
      else:
        if name not in batches:
          batches[name] = _batches(cfg)
        if not _same_batches(_batches(new), batches[name]):
          continue
      unwitnessed.add(_function_key(cfg, field))
  assert unwitnessed == set(FUNCTION_FIELDS), (
      f"without a witness, not listed: {sorted(unwitnessed - set(FUNCTION_FIELDS))}; listed, "
      f"with one: {sorted(set(FUNCTION_FIELDS) - unwitnessed)}")


def test_init_from_given_again_on_resume_does_not_change_the_model(tmp_path, files):
  """A resumed fine-tuning run builds the model its own directory records, whatever init_from
  now names (another run, with another model) or none."""
  cfg = _bases()["mqar"]
  workdir = _saved(cfg, tmp_path / "run")
  for init_from in (files["other_run"], ""):
    new = dataclasses.replace(cfg, init_from=init_from)
    assert with_init_model(new, workdir).model == cfg.model
