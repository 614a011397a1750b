"""The device check: one prepared run of at most 9 minutes and a half on one GPU (an NVIDIA H200
with jax and CUDA), driven by ``scripts/device_check.sh``, that brings back every number it
measures.

Modules: :mod:`~benchmarks.device.cli` (flags), :mod:`~benchmarks.device.runner` (the parent: a
child process per stage, budgets, restarts after a crash, ``stages.log``),
:mod:`~benchmarks.device.records` (``results.jsonl`` and the entry recorder),
:mod:`~benchmarks.device.geometry` (stage order, budgets, shapes), the stages
(:mod:`~benchmarks.device.stages`, :mod:`~benchmarks.device.preflight`,
:mod:`~benchmarks.device.timings`, :mod:`~benchmarks.device.documents`, helpers in
:mod:`~benchmarks.device.measure`) and :mod:`~benchmarks.device.report` (``summary.md``). It is
not part of the installed package: it imports ``kvm_jax`` like any user code and only its public
modules.
"""
