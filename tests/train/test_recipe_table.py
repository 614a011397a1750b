"""The recipe table of docs/hardware.md: its cells, its check, and (nightly) its regeneration."""

from __future__ import annotations

import json

import pytest

from kvm_jax.train import recipe_table
from tests.helpers import ROOT


def _row(recipe="kvm256_120m", topology="v5e:4x4", fits=True, peak=9.3, fix=None, fix_peak=None,
         refusal=None):
  return {"recipe": recipe, "topology": topology, "chip_gib": 15.75, "fits": fits,
          "peak_gib": peak, "refusal": refusal, "fix": fix, "fix_peak_gib": fix_peak,
          "flops_ratio": None}


def test_a_cell_that_does_not_fit_names_what_does():
  refused = _row(fits=False, peak=None, fix="grad_accum_steps=2", fix_peak=10.03,
                 refusal="RESOURCE_EXHAUSTED: ... the total memory required for HLO temporaries "
                         "(17.59G) exceeds available HBM (15.75G).")
  assert recipe_table.cell_text(_row()) == "9.30 GiB"
  assert recipe_table.cell_text(refused) == ("**does not fit** (temporaries 17.59 GiB); fits with "
                                             "`grad_accum_steps=2` (10.03 GiB)")
  table = recipe_table.markdown([_row(), refused | {"topology": "v6e:2x2"}])
  assert table.splitlines()[0] == ("| recipe | v5e:4x4 (15.75 GiB per chip) | v6e:2x2 (31.25 GiB "
                                   "per chip) |")
  assert recipe_table.markdown([_row()], ["kvm256_120m", "rwkv7_120m"], ["v5e:4x4"]).splitlines()[
      3] == "| rwkv7_120m | – |"
  assert table.splitlines()[2].startswith("| kvm256_120m | 9.30 GiB | **does not fit**")


def test_the_check_flags_another_fit_and_a_moved_peak_only():
  old = [_row(), _row(recipe="gpta2_120m", peak=8.0)]
  assert recipe_table.compare([_row(peak=9.3 * 1.01)], old) == []
  assert recipe_table.compare([_row(peak=9.3 * 1.05)], old)
  assert recipe_table.compare([_row(fits=False)], old)
  assert recipe_table.compare([_row(recipe="rwkv7_120m")], old)


def test_the_table_goes_between_its_markers(tmp_path):
  doc = tmp_path / "hardware.md"
  doc.write_text(f"before\n{recipe_table.START}\nold\n{recipe_table.END}\nafter\n")
  recipe_table.write_doc("| new |", doc)
  assert doc.read_text() == f"before\n{recipe_table.START}\n| new |\n{recipe_table.END}\nafter\n"


def test_the_committed_table_is_the_one_its_json_renders():
  data = json.loads((ROOT / "docs/data/recipe_table.json").read_text())
  doc = (ROOT / "docs/hardware.md").read_text()
  between = doc.split(recipe_table.START, 1)[1].split(recipe_table.END, 1)[0].strip()
  assert between == recipe_table.markdown(data["cells"], list(recipe_table.RECIPES),
                                          recipe_table.TOPOLOGIES)


@pytest.mark.slow  # compiles every recipe for four topologies (about an hour on 2 cores): nightly
@pytest.mark.chip_compile
@pytest.mark.xdist_group("libtpu")
def test_the_recipe_table_regenerates_to_what_the_docs_say():
  pytest.importorskip("libtpu")
  assert recipe_table.main(["--check"]) == 0
