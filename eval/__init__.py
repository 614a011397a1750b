"""Evaluation and benchmarks. ``eval.core_speed`` times the KVM core against full attention."""
