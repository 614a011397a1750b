"""Benchmarks (``kvm-bench``, ``kvm-bench-core``): speed of the ops, the model, packed documents and
the engine, as ratios against a baseline measured in the same run."""
