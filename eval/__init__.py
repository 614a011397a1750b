"""Evaluation and benchmarks (installed as ``kvm_jax.eval``).

* ``cli`` — ``kvm-eval``: NIAH, MQAR and position-wise loss of run directories, one report;
* ``niah``, ``mqar``, ``position_loss`` — the suites (their data comes from :mod:`kvm_jax.tasks`);
* ``lm_eval_adapter`` — any kvm_jax model as an lm-evaluation-harness LM (``kvm_jax``);
* ``check`` — ``kvm-check``: oracle ↔ XLA scan ↔ Pallas ↔ prefill+decode on this machine;
* ``speed`` / ``core_speed`` / ``timing`` — ``kvm-bench`` and ``kvm-bench-core``, ratios against
  full attention measured in the same run.

The prepared check of a GPU machine (``scripts/device_check.sh``) is not part of the package: its
harness is the repository's ``benchmarks/device/``, run from a checkout.
"""
