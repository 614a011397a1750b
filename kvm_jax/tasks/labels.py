"""The label convention every task shares."""

# Label of positions that carry no loss (prompt tokens, padding, tokens after a document's EOS):
# the ``ignore_index`` of the authors' cross-entropy. Defined next to the loss that honours it.
from kvm_jax.ops.loss import IGNORE

__all__ = ["IGNORE"]
