"""kvm_jax: Key-Value Means attention in JAX.

Curated public surface (docs/design.md)::

    import kvm_jax as kj
    cfg = kj.KVMConfig(chunk_size=256, window_chunks=2, budget=kj.PowerLawBudget(16.0, 0.5, 256))
    y, state = kj.kvm_attention(q, k, v, merge_gate, kj.KVMParams.init(D, H), cfg)

Everything installed lives under this name: the op and model here, and the sub-packages
``kvm_jax.kernels`` (Pallas), ``kvm_jax.tasks`` (MQAR, NIAH, text), ``kvm_jax.runs`` (run
directories), ``kvm_jax.train`` and ``kvm_jax.eval``. The paper's OVQ and RWKV-7 baselines are the
mixer kinds ``ovq`` (options ``kj.OVQConfig``) and ``rwkv7`` (``kj.RWKV7Options``;
docs/ovq-rwkv7.md), their ops
``kvm_jax.ops.ovq`` and ``kvm_jax.ops.rwkv7``. A trained model's memory changes with
``kj.with_kvm`` (another budget or window for its kvm layers) and ``kj.convert_to_kvm``
(attention layers made kvm layers; docs/conversion.md). ``kj.Engine`` serves many requests of
any lengths over the slots of one cache and ``kj.generate_many`` runs a list of prompts through it
(docs/generation.md).
"""

from kvm_jax.util import lazy_exports as _lazy_exports

# Where each public name lives, imported on first use (kvm_jax.util.lazy_exports): ``import kvm_jax``
# alone costs no JAX, so the commands' --help and argument errors answer at once.
_EXPORTS = {
    "kvm_jax.config.budget": ("CallableBudget", "FixedBudget", "KVMSchedule", "PowerLawBudget",
                       "SaturatingBudget", "kvm_schedule", "state_rows_after"),
    "kvm_jax.config.kvm": ("KVMConfig",),
    "kvm_jax.config.model": ("ModelConfig",),
    "kvm_jax.ops.common": ("current_platform",),
    "kvm_jax.config.target": ("compile_target", "current_target", "parse_target"),
    "kvm_jax.ops.kvm": ("KVMBackend", "KVMCache", "KVMOutput", "KVMParams", "KVMState",
                        "KVMStepOutput", "RoutedKVMOutput", "RoutedKVMStepOutput", "kvm_attention",
                        "kvm_attention_reference", "kvm_decode_step", "kvm_init_cache",
                        "kvm_prefill", "resolve_kvm_backend"),
    "kvm_jax.ops.ovq": ("OVQConfig",),
    "kvm_jax.nn.model": ("LM", "count_params"),
    "kvm_jax.nn.mixers.rwkv7": ("RWKV7Options",),
    "kvm_jax.generation.generate": ("SamplingConfig", "generate", "generate_text", "sample_logits"),
    "kvm_jax.generation.engine": ("Engine", "generate_many"),
    "kvm_jax.nn.convert": ("convert_to_kvm", "with_kvm"),
}

__version__ = "0.1.0"


def load_pretrained(path, dtype: str = "float32", **kwargs):
  """A ``kvm_jax.LM`` from the authors' Hugging Face checkpoint directory or a kvm_jax run
  directory: :func:`kvm_jax.hf.load_pretrained` (imported on first use: it pulls in orbax)."""
  from kvm_jax.hf.load import load_pretrained as load
  return load(path, dtype, **kwargs)

def tokenizer_of(path):
  """The tokenizer a run directory (or an authors' checkpoint directory) reads its text with:
  :func:`kvm_jax.hf.load.tokenizer_of` (imported on first use, like :func:`load_pretrained`)."""
  from kvm_jax.hf.load import tokenizer_of as find
  return find(path)

__all__ = [
    "KVMConfig", "FixedBudget", "PowerLawBudget", "SaturatingBudget", "CallableBudget",
    "KVMSchedule", "kvm_schedule", "state_rows_after", "KVMParams", "KVMState", "KVMCache",
    "KVMOutput", "RoutedKVMOutput", "KVMStepOutput", "RoutedKVMStepOutput", "kvm_attention", "kvm_attention_reference", "kvm_init_cache", "kvm_prefill", "kvm_decode_step",
    "KVMBackend", "resolve_kvm_backend", "current_platform", "compile_target", "current_target",
    "parse_target",
    "ModelConfig", "LM", "count_params", "presets", "generate", "generate_text", "SamplingConfig",
    "Engine", "generate_many",
    "sample_logits", "load_pretrained", "tokenizer_of", "OVQConfig", "RWKV7Options", "with_kvm", "convert_to_kvm",
]


# The names of _EXPORTS on first use.
__getattr__, __dir__ = _lazy_exports.exports(__name__, _EXPORTS, modules=("presets",))
