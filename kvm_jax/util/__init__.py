"""Plumbing with no model in it: progress lines, lazily imported exports, ``--plugin`` and the
persistent compilation cache."""
