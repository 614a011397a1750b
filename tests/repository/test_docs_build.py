"""The documentation builds with warnings as errors (Sphinx, docs/conf.py): every page of docs/, the
notebooks (rendered with their stored outputs, not executed) and the API reference, where
``nitpicky`` makes every cross-reference into kvm_jax that finds no target (a renamed function, a
private helper, a method cited as a function) an error, as are docstring markup errors.

Needs the docs extra (``pip install -e ".[docs]"``), which the test extra does not install: skipped
without Sphinx. About 35 s on 2 CPU cores.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tests.helpers import ROOT

pytest.importorskip("sphinx")


def test_docs_build_without_warnings(tmp_path):
  # The dummy builder reads, cross-references and checks every page as the HTML one does (the
  # same warnings) without writing them: 35 s against 49 s for HTML on 2 cores.
  result = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "dummy",
       str(ROOT / "docs"), str(tmp_path / "build"), "-d", str(tmp_path / "doctrees")],
      capture_output=True, text=True, timeout=900, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == 0, result.stderr[-20000:]
