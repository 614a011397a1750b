"""The repository's layout contract, checked on the source (no imports executed):

* one installed namespace: the folders that pyproject maps into ``kvm_jax`` are the only code, and
  nothing anywhere imports the folder names ``train``, ``eval`` or ``pallas_kernels`` as packages;
* imports run one way — config ← ops ← kernels ← op registry ← model ← tasks ← runs ← train | eval
  ← CLIs/notebooks — including imports inside functions, with train and eval never importing each
  other and no import cycle between modules;
* no private name (``_x``) of one module is used by another, in the library, tests or notebooks;
* one module reads JAX's default backend (:data:`PLATFORM_READER`); every backend decision takes
  the platform from it;
* the repository's text (docs, code, tests) stands on its own: no pointers to the internal design
  notes or issues, and every ``docs/…`` file and section cited exists;
* every function is at most 80 lines, and no module outside a kind's own compares with a kind's
  name;
* every test docs/design.md names (``tests/<file>.py::<name>``) exists, and each of its "How to
  add" recipes names one.
"""

from __future__ import annotations

import ast
import json
import re
import tomllib
from pathlib import Path

import pytest

from tests.helpers import ROOT  # noqa: E402

# Layers, lowest first. A pattern "x" names one module; "x.*" names x and everything below it.
# The most specific pattern wins. Modules of one layer may import each other (without cycles).
LAYERS = (
    ("config", ("kvm_jax.config.*", "kvm_jax.util.*")),
    ("ops", ("kvm_jax.ops.*",)),
    ("kernels", ("kvm_jax.kernels.*",)),
    ("op registry", ("kvm_jax.ops", "kvm_jax.ops.kvm", "kvm_jax.ops.kvm.api",
                     "kvm_jax.ops.attention.api")),
    ("model", ("kvm_jax", "kvm_jax.nn.*", "kvm_jax.presets", "kvm_jax.generation.*")),
    ("tasks", ("kvm_jax.tasks.*",)),
    ("runs", ("kvm_jax.runs.*", "kvm_jax.hf.*")),
    ("train", ("kvm_jax.train.*",)),
    ("eval", ("kvm_jax.eval.*",)),
    ("cli", ("kvm_jax.core_demo", "kvm_jax.generation.serve", "kvm_jax.hf.cli",
             "kvm_jax.train.main", "kvm_jax.train.demo", "kvm_jax.train.prepare_data",
             "kvm_jax.train.configs.*", "kvm_jax.train.conversion_study", "kvm_jax.eval.cli",
             "kvm_jax.train.recipe_table")),
)
RANK = {"config": 0, "ops": 1, "kernels": 2, "op registry": 3, "model": 4, "tasks": 5, "runs": 6,
        "train": 7, "eval": 7, "cli": 8}
SIBLINGS = {frozenset({"train", "eval"})}  # same rank, must not import each other
# Upward imports allowed only inside a function body, run when it is called: the top-level
# package's ``kj.load_pretrained`` (its public name) hands over to the run-directory layer
# without ``import kvm_jax`` loading that layer (orbax) or forming an import cycle.
DEFERRED = {("kvm_jax", "kvm_jax.hf.load")}
FOLDER_NAMES = ("train", "eval", "pallas_kernels")
NOT_CODE = ("eval/lm_eval_tasks",)  # lm-eval task data (its utils.py is loaded by lm-eval)
DATA_PACKAGES = ("kvm_jax.eval.lm_eval_tasks",)  # installed as data folders, not code


def package_dirs() -> dict[str, Path]:
  """Installed package -> source folder, as pyproject.toml maps them."""
  setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
  mapping = setuptools.get("package-dir", {})
  out = {}
  for package in setuptools["packages"]:
    parent, path = package, None
    while parent:  # the nearest mapped ancestor decides the folder
      if parent in mapping:
        path = ROOT / mapping[parent] / Path(*package[len(parent):].split(".")[1:])
        break
      parent = parent.rpartition(".")[0]
    out[package] = path if path is not None else ROOT / Path(*package.split("."))
  return out


def library_modules() -> dict[str, Path]:
  """Every module the package installs: name -> file."""
  modules = {}
  for package, folder in package_dirs().items():
    if package.startswith(DATA_PACKAGES):
      continue
    assert (folder / "__init__.py").exists(), f"{package}: no {folder}/__init__.py"
    modules[package] = folder / "__init__.py"
    for f in folder.glob("*.py"):
      if f.name != "__init__.py":
        modules[f"{package}.{f.stem}"] = f
  return modules


MODULES = library_modules()


def layer_of(module: str) -> str:
  """The layer of the most specific matching pattern (an exact name beats ``name.*``)."""
  best, best_key = None, None
  for layer, patterns in LAYERS:
    for pattern in patterns:
      exact = not pattern.endswith(".*")
      base = pattern if exact else pattern[:-2]
      hit = module == base or (not exact and module.startswith(base + "."))
      if hit and (best_key is None or (len(base), exact) > best_key):
        best, best_key = layer, (len(base), exact)
  assert best is not None, f"{module} belongs to no layer: add it to LAYERS in {__file__}"
  return best


class Imports(ast.NodeVisitor):
  """Every import (module level or inside functions) and every ``alias._private`` use."""

  def __init__(self):
    self.edges: list[tuple[int, str, str]] = []   # (line, imported module, name or "")
    self.aliases: dict[str, str] = {}            # local name -> kvm_jax module
    self.attributes: list[tuple[int, str, str]] = []

  def visit_Import(self, node):
    for a in node.names:
      self.edges.append((node.lineno, a.name, ""))
      if a.asname:
        self.aliases[a.asname] = a.name
      else:
        self.aliases[a.name.split(".")[0]] = a.name.split(".")[0]

  def visit_ImportFrom(self, node):
    assert node.level == 0, f"line {node.lineno}: use absolute imports"
    for a in node.names:
      self.edges.append((node.lineno, node.module, a.name))
      full = f"{node.module}.{a.name}"
      if full in MODULES:
        self.aliases[a.asname or a.name] = full

  def visit_Attribute(self, node):
    if isinstance(node.value, ast.Name):
      self.attributes.append((node.lineno, node.value.id, node.attr))
    self.generic_visit(node)


def scan(source: str) -> Imports:
  visitor = Imports()
  visitor.visit(ast.parse(source))
  return visitor


def target(module: str, name: str) -> str:
  """The kvm_jax module an import statement reaches (a submodule when ``name`` is one)."""
  return f"{module}.{name}" if f"{module}.{name}" in MODULES else module


def private_uses(where: str, found: Imports) -> list[str]:
  bad = []
  for line, module, name in found.edges:
    if module.split(".")[0] == "kvm_jax" and name.startswith("_") and not name.startswith("__"):
      bad.append(f"{where}:{line}: imports private {module}.{name}")
  for line, alias, attr in found.attributes:
    module = found.aliases.get(alias, "")
    if module.startswith("kvm_jax") and attr.startswith("_") and not attr.startswith("__"):
      bad.append(f"{where}:{line}: uses private {module}.{attr}")
  return bad


def folder_imports(where: str, found: Imports) -> list[str]:
  return [f"{where}:{line}: imports the folder {module!r}; use kvm_jax.…"
          for line, module, _ in found.edges if module.split(".")[0] in FOLDER_NAMES]


def notebook_sources():
  for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
    cells = json.loads(path.read_text())["cells"]
    yield path, "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def test_packages_cover_every_source_file():
  """Every .py under the mapped folders is installed (no stray module a user could not import)."""
  installed = set(MODULES.values())
  for package, folder in package_dirs().items():
    for f in folder.rglob("*.py"):
      rel = f.relative_to(ROOT).as_posix()
      if not rel.startswith(NOT_CODE) and "__pycache__" not in rel:
        assert f in installed, f"{rel} is not in any installed package: list it in pyproject"


def internal_edges(module: str, found: Imports) -> list[tuple[int, str]]:
  """(line, kvm_jax module) of every import of ``module`` that stays inside the package."""
  edges = []
  for line, imported, name in found.edges:
    if imported.split(".")[0] == "kvm_jax":
      dest = target(imported, name)
      assert dest in MODULES, f"{module}:{line}: imports unknown module {dest}"
      edges.append((line, dest))
  return edges


def function_lines(source: str) -> set[int]:
  """Line numbers inside function bodies."""
  lines = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      lines.update(range(node.body[0].lineno, node.end_lineno + 1))
  return lines


def layering_problems(module: str, found: Imports, deferred_lines: set[int] = frozenset()
                      ) -> list[str]:
  """Edges of ``module`` that go to a higher layer or to a sibling layer (except the
  :data:`DEFERRED` ones made inside a function body)."""
  here, bad = layer_of(module), []
  for line, dest in internal_edges(module, found):
    there = layer_of(dest)
    if (module, dest) in DEFERRED and line in deferred_lines:
      continue
    if RANK[there] > RANK[here] or frozenset({here, there}) in SIBLINGS:
      bad.append(f"{module} ({here}) -> {dest} ({there}), line {line}")
  return bad


def test_imports_run_one_way():
  graph: dict[str, set[str]] = {}
  problems = []
  for module, path in MODULES.items():
    source = path.read_text()
    found = scan(source)
    problems += folder_imports(module, found) + layering_problems(module, found,
                                                                  function_lines(source))
    graph[module] = {dest for _, dest in internal_edges(module, found)}
  assert not problems, "imports against the layering:\n" + "\n".join(problems)
  # No cycle between modules (within a layer, too).
  state: dict[str, int] = {}

  def visit(m, stack):
    state[m] = 1
    for n in sorted(graph[m]):
      if state.get(n) == 1:
        raise AssertionError("import cycle: " + " -> ".join(stack + [m, n]))
      if n not in state:
        visit(n, stack + [m])
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m, [])


def imports_of_test_files(where: str, source: str) -> list[str]:
  """The imports of other test files or of conftest in ``source`` (a file of tests/)."""
  problems = []
  for line, module, name in scan(source).edges:
    parts = f"{module}.{name}".split(".")
    if parts[0] == "tests" and any(p == "conftest" or p.startswith("test_") for p in parts):
      problems.append(f"{where}:{line}: imports {module}.{name}")
  return problems


def test_tests_share_code_only_through_their_helpers():
  """A test file imports no other test file and not conftest: what tests share lives in
  ``tests/helpers/`` (fixtures alone in conftest), so moving or deleting a test file breaks no
  other."""
  problems = []
  for path in sorted((ROOT / "tests").rglob("*.py")):
    problems += imports_of_test_files(str(path.relative_to(ROOT)), path.read_text())
  assert not problems, "\n".join(problems)
  assert imports_of_test_files("x", "from tests.eval.test_reports import check_eval_report\n")
  assert imports_of_test_files("x", "from tests.conftest import make_model\n")
  assert not imports_of_test_files("x", "from tests.helpers.reports import check_eval_report\n")


def test_no_private_names_across_modules():
  problems = []
  for module, path in MODULES.items():
    problems += private_uses(module, scan(path.read_text()))
  for path in sorted((ROOT / "tests").rglob("*.py")):
    found = scan(path.read_text())
    problems += private_uses(path.name, found) + folder_imports(path.name, found)
  for path, source in notebook_sources():
    found = scan(source)
    problems += private_uses(path.name, found) + folder_imports(path.name, found)
  for path in harness_files():
    found = scan(path.read_text())
    problems += private_uses(str(path.relative_to(ROOT)), found) + folder_imports(
        str(path.relative_to(ROOT)), found)
  assert not problems, "\n".join(problems)


def harness_files():
  """The harnesses that run from a checkout (the device check): ``benchmarks/``."""
  return sorted((ROOT / "benchmarks").rglob("*.py"))


def test_harnesses_are_not_installed_and_use_the_package_as_users_do():
  """``benchmarks/`` is in no installed package, and imports only modules the package has."""
  setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
  assert not [p for p in setuptools["packages"] if p.split(".")[0] == "benchmarks"]
  assert not [d for d in setuptools.get("package-dir", {}).values() if "benchmarks" in d]
  assert harness_files()
  for path in harness_files():
    for line, dest in internal_edges(path.name, scan(path.read_text())):
      assert dest in MODULES, f"{path}:{line}: {dest}"


def test_the_checker_reports_what_it_guards_against():
  """An upward edge, a sibling edge, a private name and a folder import are each reported; a
  downward edge and a package's own facade are not."""
  assert (layer_of("kvm_jax.ops.kvm.scan"), layer_of("kvm_jax.ops.kvm.api"), layer_of("kvm_jax"),
          layer_of("kvm_jax.eval.cli")) == ("ops", "op registry", "model", "cli")
  with pytest.raises(AssertionError, match="no layer"):
    layer_of("kvm_jax_other.module")
  upward = scan("from kvm_jax.kernels.readout import joint_attention_pallas\n"
                "def f():\n  import kvm_jax as kj\n")
  assert len(layering_problems("kvm_jax.ops.kvm.scan", upward)) == 2
  assert layering_problems("kvm_jax.train.loop", scan("from kvm_jax.eval import mqar\n"))
  assert layering_problems("kvm_jax.eval.mqar", scan("from kvm_jax.train.loop import train\n"))
  assert not layering_problems("kvm_jax.eval.cli", scan(
      "import kvm_jax as kj\nfrom kvm_jax.train import loop\nfrom kvm_jax.ops.kvm import api\n"))
  found = scan("from kvm_jax.runs.directory import _secret\nimport kvm_jax.nn.model as m\nm._x\n")
  assert len(private_uses("x", found)) == 2
  assert folder_imports("x", scan("from train import loop\nimport eval.cli\n")) == [
      "x:1: imports the folder 'train'; use kvm_jax.…", "x:2: imports the folder 'eval.cli'; "
      "use kvm_jax.…"]


# -- documentation that stands on its own --------------------------------------------------------

OUTSIDE = re.compile(r"\.\./shared|shared/design|issue[ -]?#|issue notes|closing note|spec §|"
                     r"lands with issue|the issue's|the issue set|the brie[f]\b")
CITATION = re.compile(r"docs/([\w-]+\.md)(?:\W{0,3}§\s?(\d+(?:\.\d+)?))?")


def user_facing_files():
  yield ROOT / "README.md"
  for folder in ("docs", "kvm_jax", "pallas_kernels", "train", "eval", "scripts", "notebooks",
                 "benchmarks", "tests"):
    for f in sorted((ROOT / folder).rglob("*")):
      if f.suffix in (".py", ".md", ".sh", ".ipynb", ".yaml") and "__pycache__" not in f.parts \
          and f != Path(__file__).resolve():  # this file spells the patterns out
        yield f


def has_section(doc: str, section: str) -> bool:
  major, _, minor = section.partition(".")
  if not minor:
    return re.search(rf"^## {major}\. ", doc, re.M) is not None
  if re.search(rf"^### {major}\.{minor} ", doc, re.M):
    return True
  body = re.split(rf"^## {major}\. ", doc, flags=re.M)
  return len(body) > 1 and re.search(rf"^{minor}\. ", body[1].split("\n## ")[0], re.M) is not None


def test_user_facing_text_stands_on_its_own():
  problems = []
  for f in user_facing_files():
    text = f.read_text(encoding="utf-8")
    rel = f.relative_to(ROOT)
    for m in OUTSIDE.finditer(text):
      problems.append(f"{rel}: points outside the repository: {m.group(0)!r}")
    for m in CITATION.finditer(text):
      doc = ROOT / "docs" / m.group(1)
      if not doc.exists():
        problems.append(f"{rel}: cites missing docs/{m.group(1)}")
      elif m.group(2) and not has_section(doc.read_text(encoding="utf-8"), m.group(2)):
        problems.append(f"{rel}: cites docs/{m.group(1)} §{m.group(2)}, which does not exist")
  assert not problems, "\n".join(problems)


# -- one reader of the platform -------------------------------------------------------------------

# The one installed module that may ask JAX for its default backend (``current_platform``); the
# backend resolvers of the KVM op and of softmax attention, and everything else, go through it.
PLATFORM_READER = "kvm_jax.config.target"


def platform_reads(where: str, source: str) -> list[str]:
  """Every ``….default_backend`` use (a call or a reference) and ``from jax import
  default_backend`` in ``source``."""
  bad = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Attribute) and node.attr == "default_backend":
      bad.append(f"{where}:{node.lineno}: reads jax.default_backend()")
    elif isinstance(node, ast.ImportFrom) and any(a.name == "default_backend" for a in node.names):
      bad.append(f"{where}:{node.lineno}: imports default_backend")
  return bad


def test_one_module_reads_the_platform():
  """Only :data:`PLATFORM_READER` calls ``jax.default_backend()``; the rest of the package asks
  ``kvm_jax.config.target.current_target()`` (or ``kvm_jax.ops.common.current_platform()``) or a
  backend resolver."""
  problems = [p for module, path in MODULES.items() if module != PLATFORM_READER
              for p in platform_reads(module, path.read_text())]
  assert not problems, ("read the platform through kvm_jax.config.target.current_target():\n"
                        + "\n".join(problems))
  assert platform_reads(PLATFORM_READER, MODULES[PLATFORM_READER].read_text())  # not vacuous
  assert len(platform_reads("x", "import jax\nfrom jax import default_backend\n"
                                 "p = jax.default_backend()\n")) == 2


def test_deferred_imports_are_allowed_only_inside_functions():
  """The one upward import kvm_jax's top level may make (``DEFERRED``) is refused at module level."""
  top = "from kvm_jax.hf.load import load_pretrained\n"
  inside = "def load_pretrained(path):\n  from kvm_jax.hf.load import load_pretrained\n  return 1\n"
  assert layering_problems("kvm_jax", scan(top), function_lines(top))
  assert not layering_problems("kvm_jax", scan(inside), function_lines(inside))
  other = "def f():\n  from kvm_jax.runs.directory import load_trained\n"
  assert layering_problems("kvm_jax", scan(other), function_lines(other))


# -- small functions everywhere ------------------------------------------------------------------

MAX_FUNCTION_LINES = 80
# Code outside the installed package held to the same limit: the device benchmarks and the
# float64 model oracle (an oracle is easiest to check against the spec in short pieces).
OTHER_CODE = ("benchmarks", "tests/helpers/reference_model.py")


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
  """(qualified name, length) of every function of ``source`` longer than ``limit`` lines, its
  length counted from the ``def`` line to its last line (docstring included, decorators not)."""
  found = []

  def visit(node, prefix):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        length = child.end_lineno - child.lineno + 1
        if length > limit:
          found.append((prefix + child.name, length))
        visit(child, f"{prefix}{child.name}.")
      elif isinstance(child, ast.ClassDef):
        visit(child, f"{prefix}{child.name}.")
      else:
        visit(child, prefix)

  visit(ast.parse(source), "")
  return found


def test_functions_are_short():
  """Every function of the package (kernels and oracles included), the benchmarks and the model
  oracle fits in :data:`MAX_FUNCTION_LINES` lines, nested functions and methods each on their
  own: code composes small parts with names instead of inlining them."""
  paths = set(library_modules().values())
  for name in OTHER_CODE:
    paths |= set((ROOT / name).rglob("*.py")) if (ROOT / name).is_dir() else {ROOT / name}
  problems = [f"{path.relative_to(ROOT)}: {name} is {length} lines"
              for path in sorted(paths) if "__pycache__" not in path.parts
              for name, length in long_functions(path.read_text(), MAX_FUNCTION_LINES)]
  assert not problems, (f"functions over {MAX_FUNCTION_LINES} lines; split them:\n"
                        + "\n".join(problems))
  nested = "class A:\n  def f(self):\n    def g():\n" + "      x = 1\n" * 3
  assert long_functions(nested, 3) == [("A.f", 5), ("A.f.g", 4)]  # the checker sees them all


def _parameter_owner_names() -> set[str]:
  """Every module and vector name on a parameter path of the built-in families and kinds, less
  the leaf names (``kernel``, ``scale``, ...), the sharding and μP vocabularies (``mlp`` is a
  logical axis, ``lm_head`` a μP group) and plain English words that other code says for other
  reasons (``key``, ``value``, ``output``)."""
  import dataclasses

  from flax import nnx

  import kvm_jax as kj
  from kvm_jax.nn import registry

  names = set()
  kvm16 = dataclasses.replace(kj.presets.TINY_OPTIONS["kvm"], rope_dims=16)
  for family in kj.nn.registered_families():
    if family not in ("gptalpha2", "llama", "gemma"):
      continue
    kw = {} if family == "gptalpha2" else dict(family=family, rope_dims=16, options={"kvm": kvm16})
    for mixers in ("swa,kvm", "full,bswa", "rwkv7,ovq"):
      extra = (dict(family_options=kj.nn.GPTAlpha2Options(share_value_anchor=True))
               if family == "gptalpha2" and "rwkv7" in mixers else {})
      cfg = kj.presets.tiny(mixers, **kw, **extra)
      state = nnx.state(nnx.eval_shape(lambda: kj.LM(cfg, rngs=nnx.Rngs(0))))
      names |= {p for path, _ in nnx.to_flat_state(state) for p in path[:-1] if isinstance(p, str)}
  return names - set(registry.LOGICAL_AXIS_NAMES) - set(registry.PARAM_GROUP_NAMES) - {
      "key", "value", "output"}


def test_no_module_outside_nn_matches_parameter_names():
  """Parameter names belong to ``kvm_jax.nn``: sharding, μP groups, distillation, conversion
  and the checkpoint mappings ask ``kvm_jax.nn.roles`` and the modules' own tables, so renaming
  a parameter is a change inside ``nn/``. The ops and kernels take arrays, never parameter
  trees (``KVMParams`` fields share some names), so they are not scanned."""
  owners = _parameter_owner_names()
  assert {"c_q", "ln_s", "wte", "blocks", "attn", "c_gate", "post_mlp_norm"} <= owners
  problems = []
  for module, path in MODULES.items():
    if module.startswith(("kvm_jax.nn.", "kvm_jax.ops", "kvm_jax.kernels")):
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in owners:
        problems.append(f"{module}:{node.lineno}: {node.value!r}")
  assert not problems, "parameter names matched outside kvm_jax.nn:\n  " + "\n  ".join(problems)


# -- no branching on kind names outside the kinds ----------------------------------------------

BUILT_IN_KINDS = frozenset({"full", "swa", "bswa", "kvm", "ovq", "rwkv7"})
# What a kind is (its window, its memory, its conversion, its checkpoint rows, its decode ring) is
# answered by its own module through the registry, so a comparison with a kind's name elsewhere
# would state a fact about a kind in a second place: none is allowed.


def kind_branches(source: str) -> int:
  """Comparisons (``==``, ``!=``, ``in``, ``not in``) in ``source`` with a built-in kind's name,
  alone or in a literal tuple, list or set."""
  count = 0
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Compare):
      for part in (node.left, *node.comparators):
        items = part.elts if isinstance(part, (ast.Tuple, ast.List, ast.Set)) else [part]
        if any(isinstance(i, ast.Constant) and i.value in BUILT_IN_KINDS for i in items):
          count += 1
          break
  return count


def test_kind_names_are_not_branched_on_outside_their_modules():
  """Outside ``kvm_jax.nn.<kind>``, no installed module (and no benchmark) compares with a
  kind's name."""
  own = {f"kvm_jax.nn.{kind}" for kind in BUILT_IN_KINDS}
  files = {**MODULES, **{str(f.relative_to(ROOT)): f for f in (ROOT / "benchmarks").rglob("*.py")}}
  found = {name: n for name, path in files.items() if name not in own
           and (n := kind_branches(path.read_text()))}
  assert not found, ("comparisons with a kind's name outside its module (module: count); ask "
                     f"the kind through the registry instead: {found}")
  assert kind_branches('if kind == "kvm" or x in ("swa", "full") or "ovq" in kinds: pass') == 3
  assert kind_branches('if family == "llama": pass') == 0


# -- the design document's recipes name tests that exist ----------------------------------------

DESIGN = ROOT / "docs" / "design.md"
TEST_REFERENCE = re.compile(r"tests/([\w/]+\.py)::(\w+)")


def functions_defined(path: Path) -> set[str]:
  """The names of every function ``path`` defines (module level, in classes, nested), read
  without importing it."""
  return {node.name for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def missing_test_references(text: str) -> list[str]:
  """Every ``tests/<file>.py::<name>`` in ``text`` whose file does not exist or defines no
  function ``<name>``."""
  problems, defined = [], {}
  for m in TEST_REFERENCE.finditer(text):
    path = ROOT / "tests" / m.group(1)
    if not path.is_file():
      problems.append(f"{m.group(0)}: no file tests/{m.group(1)}")
      continue
    if path not in defined:
      defined[path] = functions_defined(path)
    if m.group(2) not in defined[path]:
      problems.append(f"{m.group(0)}: tests/{m.group(1)} defines no {m.group(2)}()")
  return problems


def test_design_recipes_name_tests_that_exist():
  """Every test docs/design.md names (``tests/<file>.py::<name>``, the "Checked by" lines of its
  "How to add" recipes among them) is a function that exists, and every recipe names one: a
  renamed or deleted test cannot leave a recipe claiming a check that no longer runs."""
  text = DESIGN.read_text(encoding="utf-8")
  problems = missing_test_references(text)
  assert not problems, "docs/design.md names tests that do not exist:\n" + "\n".join(problems)
  recipes = text.split("\n## How to add", 1)[1].split("\n## ", 1)[0].split("\n### ")[1:]
  assert len(recipes) >= 4, "docs/design.md: the 'How to add' section lost its recipes"
  unchecked = [r.splitlines()[0] for r in recipes
               if "Checked by:" not in r or not TEST_REFERENCE.search(r.split("Checked by:", 1)[1])]
  assert not unchecked, f"recipes without a 'Checked by:' test: {unchecked}"
  # the checker sees a missing file and a missing function
  planted = ("`tests/repository/test_layout.py::test_design_recipes_name_tests_that_exist` "
             "`tests/repository/test_layout.py::no_such_test` `tests/test_nothing.py::test_x`")
  assert missing_test_references(planted) == [
      "tests/repository/test_layout.py::no_such_test: tests/repository/test_layout.py defines no no_such_test()",
      "tests/test_nothing.py::test_x: no file tests/test_nothing.py"]

