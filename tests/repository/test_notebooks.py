"""Every notebook executes top to bottom (nbclient, a fresh kernel each) and renders its plots; a
notebook's own assertions (03: every comparison of its table passes) fail the test."""

from __future__ import annotations

import os
import time
from pathlib import Path

import nbclient  # the `test` extra: a missing test dependency must fail CI, not skip it
import nbformat
import pytest
from tests.helpers import in_ci

from tests.helpers import ROOT  # noqa: E402
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_six_notebooks_with_stripped_outputs():
  assert len(NOTEBOOKS) == 6
  for path in NOTEBOOKS:
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
      if cell.cell_type == "code":
        assert not cell.outputs and cell.execution_count is None, f"{path.name}: strip outputs"


# CI executes 01 (budget tables and memory plots, a few seconds); nightly also 02 (one update,
# plotted), 03 (its own assertions check its equivalence table, ~40 s; the same comparisons run in
# CI in tests/ops/kvm/test_kvm_equivalence.py and kvm-check's tests) and 04 (it retrains the default
# job's four models, which tests/train/test_train.py runs in CI), 05 (it trains, converts and distils
# the main job's models; tests/nn/test_convert.py and tests/train/test_distill.py run each part in CI) and
# 06 (the same for a Llama-family model beside GPTAlpha-2; tests/nn/test_families.py checks the
# family's conversion in CI).
@pytest.mark.parametrize("path", in_ci(NOTEBOOKS, {"01_budgets_and_memory"}, ids=lambda p: p.stem),
                         ids=lambda p: p.stem)
def test_notebook_executes_and_plots(path, tmp_path, monkeypatch):
  nb = nbformat.read(path, as_version=4)
  # A fresh kernel in a scratch directory; the repository on its path; few training steps.
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("KVM_NOTEBOOK_STEPS", "30")
  # As conftest does in-process: tiny programs compile much faster without XLA's optimizations.
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS",
                     "1" if os.environ.get("KVM_TEST_FAST_COMPILE", "1") == "1" else "0")
  monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
  start = time.perf_counter()
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  seconds = time.perf_counter() - start
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "image/png" in o.get("data", {})]
  assert images, f"{path.name} rendered no plot"
  assert seconds < 240, f"{path.name} took {seconds:.0f} s; notebooks must stay quick"
