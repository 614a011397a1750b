"""Deprecated name of :mod:`kvm_jax.ops.rwkv7.scan` (each op's chunk-parallel form is its
``scan`` module); importing it warns and gives the same objects."""

import warnings

from kvm_jax.ops.rwkv7.scan import (MAX_CHUNK, rwkv7_recurrence, rwkv7_step, solve_unit_lower,
                                    validate_inputs)

warnings.warn("kvm_jax.ops.rwkv7.chunked is deprecated; import from kvm_jax.ops.rwkv7.scan.",
              DeprecationWarning, stacklevel=2)

__all__ = ["MAX_CHUNK", "rwkv7_recurrence", "rwkv7_step", "solve_unit_lower", "validate_inputs"]
