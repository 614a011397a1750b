"""The authors' Hugging Face checkpoint format (``featherless-ai/KVM-paper``'s
``RWKV7BackboneForCausalLM``: ``config.json`` + safetensors), read and written without torch.

    import kvm_jax as kj
    model = kj.load_pretrained("path/to/kvm-256-120m")       # their directory, or a run directory
    logits = model(tokens)

``kvm-import SRC DEST`` writes a run directory from their checkpoint; ``kvm-export RUN_DIR DEST``
writes their format from a run directory. docs/checkpoints.md has the field and tensor tables.
"""

from kvm_jax.hf.config import (ConfigError, ExportError, authors_config_from_model,
                               model_config_from_authors)
from kvm_jax.hf.load import (checkpoint_kind, export_run, import_checkpoint, load_pretrained,
                             numerics_note, read_authors)
from kvm_jax.hf.params import authors_shapes, from_authors, to_authors
from kvm_jax.hf.safetensors import CheckpointError, read_checkpoint, write_checkpoint

__all__ = ["CheckpointError", "ConfigError", "ExportError", "authors_config_from_model",
           "authors_shapes", "checkpoint_kind", "export_run", "from_authors", "import_checkpoint",
           "load_pretrained", "model_config_from_authors", "numerics_note", "read_authors",
           "read_checkpoint", "to_authors", "write_checkpoint"]
