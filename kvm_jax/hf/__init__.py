"""Hugging Face checkpoints read and written without torch: the authors' format
(``featherless-ai/KVM-paper``'s ``RWKV7BackboneForCausalLM``: ``config.json`` + safetensors) for
GPTAlpha-2 models, and transformers' own for the Llama family (Llama, Qwen2, Qwen3, Mistral) and
Gemma 2 and 3 (:mod:`kvm_jax.hf.families`).

    import kvm_jax as kj
    model = kj.load_pretrained("path/to/kvm-256-120m")   # either format, or a run directory
    logits = model(tokens)

``kvm-import SRC DEST`` writes a run directory from a checkpoint; ``kvm-export RUN_DIR DEST``
writes the family's format from a run directory. docs/checkpoints.md (the authors' format) and
docs/pretrained.md (transformers') have the field and tensor tables.
"""

from kvm_jax.util import lazy_exports as _lazy_exports

__all__ = ["CheckpointError", "ConfigError", "ExportError", "authors_config_from_model",
           "authors_shapes", "checkpoint_kind", "export_run", "from_authors", "import_checkpoint",
           "from_transformers", "load_pretrained", "model_config_from_authors",
           "model_config_from_transformers", "numerics_note", "read_authors",
           "read_model_directory", "read_transformers", "to_transformers",
           "transformers_config_from_model",
           "read_checkpoint", "to_authors", "write_checkpoint"]


# Imported on first use (kvm_jax.util.lazy_exports): kvm-import's --help needs none of it.
__getattr__, __dir__ = _lazy_exports.exports(__name__, {
    "kvm_jax.hf.authors_config": ("ConfigError", "ExportError", "authors_config_from_model",
                                  "model_config_from_authors"),
    "kvm_jax.hf.families": ("from_transformers", "model_config_from_transformers",
                            "to_transformers", "transformers_config_from_model"),
    "kvm_jax.hf.load": ("checkpoint_kind", "export_run", "import_checkpoint", "load_pretrained",
                        "numerics_note", "read_authors", "read_model_directory",
                        "read_transformers"),
    "kvm_jax.hf.params": ("authors_shapes", "from_authors", "to_authors"),
    "kvm_jax.hf.safetensors": ("CheckpointError", "read_checkpoint", "write_checkpoint")})
