"""Harnesses that run from a checkout and are never installed (``pip install .`` leaves them out):
``benchmarks.device`` is the prepared check of a GPU/TPU machine (``scripts/device_check.sh``)."""
