"""Sphinx configuration: the pages of docs/, the notebooks (rendered with their stored outputs,
never executed) and the API reference (docs/api/, autodoc + napoleon over the Google-style
docstrings).

Build (``pip install -e ".[docs]"``)::

    sphinx-build -W --keep-going -b html docs docs/_build/html

``nitpicky`` makes every cross-reference that finds no target a warning (an error under ``-W``);
references into other packages (jax, numpy, flax, ...) cannot be checked offline and are ignored
by name (``nitpick_ignore_regex``), so the check covers exactly the references into
``kvm_jax``. ``tests/repository/test_docs_build.py`` runs the build.
"""

from __future__ import annotations

import ast
import functools
import importlib
import os
import re
import sys
import types
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # autodoc imports the modules; no accelerator needed

project = "kvm_jax"
author = "kvm_jax authors"
copyright = "kvm_jax authors"
release = version = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "myst_nb",  # Markdown pages (myst-parser, which it loads) and notebooks
]

# notebooks/ lives beside docs/; docs/notebooks is a link to it.
exclude_patterns = ["_build", "notebooks/outputs", "**/.ipynb_checkpoints"]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"

# -- notebooks: render what git stores, run nothing --------------------------------------------
nb_execution_mode = "off"

# -- Markdown ----------------------------------------------------------------------------------
myst_heading_anchors = 4  # the pages link to each other's sections by their GitHub anchors

# -- API reference -----------------------------------------------------------------------------
autosummary_generate = False  # docs/api/*.rst are written by hand; nothing is generated
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# "Attributes:" sections as fields: autodoc documents the attributes themselves, once
napoleon_use_ivar = True
# Members without a docstring are part of the surface too, and so is calling a module
autodoc_default_options = {"undoc-members": True, "special-members": "__call__"}

# Every reference must find its target ...
nitpicky = True
# ... except references into other packages and the builtins, which need intersphinx and so the
# network. Everything else (all of kvm_jax) is checked.
OUTSIDE = ("jax", "jaxlib", "jnp", "np", "numpy", "flax", "nnx", "optax", "orbax", "ocp", "grain",
           "chex", "tokamax", "lm_eval", "starlette", "uvicorn", "jinja2", "tokenizers",
           "datasets", "transformers", "safetensors", "ml_dtypes", "typing", "typing_extensions",
           "collections", "types", "builtins", "enum", "dataclasses", "pathlib", "os", "io",
           "abc", "argparse", "json", "threading", "concurrent", "contextlib", "functools",
           "itertools", "asyncio", "subprocess", "logging", "queue", "re", "sys", "time",
           "datetime", "numbers", "weakref", "socket", "tempfile", "importlib", "etils")
nitpick_ignore_regex = [
    (r"py:.*", rf"({'|'.join(OUTSIDE)})(\..*)?"),
    (r"py:class", r"Array"),  # jax.Array, as the modules import it
    # annotations naming a type variable and a private class
    (r"py:class", r"kvm_jax\.util\.progress\.T"),
    (r"py:class", r"kvm_jax\.generation\.serve\._Choice"),
]

# -- HTML --------------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "kvm_jax"
html_theme_options = {"show_toc_level": 2}
html_copy_source = False  # no copies of the pages' sources under _build


# -- one object, several names -----------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def source_tree(module_name: str):
  path = getattr(sys.modules.get(module_name), "__file__", None)
  return ast.parse(Path(path).read_text(encoding="utf-8")) if path else None


@functools.lru_cache(maxsize=None)
def imports_of(module_name: str, type_checking_only: bool = False) -> dict[str, str]:
  """Local name -> full name of what a module imports by name (``from x import y as z``,
  ``import x.y as z``), anywhere in its source; with ``type_checking_only``, only the imports
  under ``if TYPE_CHECKING:`` (absent when the module runs)."""
  tree = source_tree(module_name)
  if tree is None:
    return {}
  if type_checking_only:
    tree = ast.Module([node for node in ast.walk(tree) if isinstance(node, ast.If)
                       and getattr(node.test, "id", None) == "TYPE_CHECKING"], [])
  names = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    elif isinstance(node, ast.Import):
      names.update({a.asname: a.name for a in node.names if a.asname})
  return names


def lookup(name: str):
  """The object a dotted name reaches (the longest importable module, then attributes)."""
  parts = name.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except Exception:
      continue
    try:
      for attr in parts[i:]:
        obj = getattr(obj, attr)
    except AttributeError:
      return None
    return obj
  return None


def canonical_name(target: str, module: str | None, depth: int = 0) -> str | None:
  """Where the object a reference names is documented: ``kvm_jax.KVMConfig`` (a package's
  re-export) -> ``kvm_jax.config.kvm.KVMConfig``; a name inside a module's docstring that the
  module imported (``KVMState``, ``IGNORE``, ``adamc_lib.adamc``) -> the object it names there.
  ``None`` when the name is no object of kvm_jax."""
  target = target.lstrip("~.")
  candidates = [target] if target.startswith("kvm_jax.") else []
  head, _, rest = target.partition(".")
  if module:
    candidates.append(f"{module}.{target}")
    if head in imports_of(module):
      candidates.append(".".join(filter(None, (imports_of(module)[head], rest))))
  for name in candidates:
    obj = lookup(name)
    if obj is None:
      continue
    if isinstance(obj, types.ModuleType):
      return obj.__name__ if obj.__name__.startswith("kvm_jax") else None
    owner, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(owner, str) and isinstance(qualname, str):
      return f"{owner}.{qualname}" if owner.startswith("kvm_jax") else None
    # a constant reached through an import or a package's export: documented where it is defined
    parent, _, attr = name.rpartition(".")
    if name.startswith("kvm_jax") and name != f"{module}.{target}" and depth < 4:
      return canonical_name(attr, parent, depth + 1) or defined_in(parent, attr, obj) or name
  return None


def defined_in(package: str, attr: str, obj) -> str | None:
  """``module.attr`` for the module under ``package`` that defines ``attr`` (binds it to ``obj``
  without importing it), or that imported it from where it is defined."""
  for module_name, module in list(sys.modules.items()):
    if module_name.startswith(package + ".") and vars(module).get(attr) is obj:
      if attr not in imports_of(module_name):
        return f"{module_name}.{attr}"
      return canonical_name(attr, module_name, 3)  # re-exported: where that module took it from
  return None


def resolve_alias(app, env, node, contnode):
  """missing-reference: retry a Python reference at the name its object is documented under."""
  if node.get("refdomain") != "py":
    return None
  name = canonical_name(node["reftarget"], node.get("py:module"))
  if name is None or name == node["reftarget"]:
    return None
  domain = env.get_domain("py")
  retry = node.deepcopy()
  retry["reftarget"] = name
  return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], name, retry,
                             contnode)


# -- the docstrings' own conventions, which napoleon would misread --------------------------------

PROSE = {}
# Module docstrings that are also a command's --help text, laid out for the terminal: shown as
# written.
VERBATIM = {"kvm_jax.train.main"}
FIELD = re.compile(r"^(\s*:(?:param|ivar|var|cvar|keyword|type|vartype) )(\w+(?: / \w+)+):")


def before_napoleon(app, what, name, obj, options, lines):
  """An attribute's docstring is prose here ("Time axis of the query source: ``[B, T, H, D]``"),
  not napoleon's "type: description": keep it as written (restored by ``after_napoleon``)."""
  if what in ("attribute", "data", "property"):
    PROSE[id(lines)] = list(lines)
  elif what == "module" and name in VERBATIM:
    PROSE[id(lines)] = ["::", ""] + ["   " + line for line in lines]


def after_napoleon(app, what, name, obj, options, lines):
  """Restore attribute docstrings; ``a / b / c:`` entries (one description for several arguments
  or fields) become one field named ``a/b/c`` (a field's name is one word to Sphinx)."""
  if id(lines) in PROSE:
    lines[:] = PROSE.pop(id(lines))
  for i, line in enumerate(lines):
    m = FIELD.match(line)
    if m:
      lines[i] = m.group(1) + m.group(2).replace(" / ", "/") + ":" + line[m.end():]


def spell_out_annotations(app, what, name, obj, options, signature, return_annotation):
  """autodoc-process-signature: an annotation naming a type-checking-only import
  (``case: Case``, ``"ovq_cases.Case"``) is spelled out in full, so that it links to the one
  class it means."""
  names = imports_of(getattr(obj, "__module__", None) or "", True)
  if not names:
    return None
  pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, names)) + r")\b")
  spell = lambda text: text and pattern.sub(lambda m: names[m.group(1)], text)
  return spell(signature), spell(return_annotation)


NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def notebook_links(app, doctree):
  """doctree-read: a Markdown link to a notebook (``../notebooks/x.ipynb`` from docs/, as GitHub
  reads it, or ``x.ipynb`` beside it) names the notebook's page. docs/notebooks links to
  notebooks/, and MyST resolves the link through it to a path outside docs/."""
  from sphinx import addnodes
  for node in doctree.findall(addnodes.pending_xref):
    target = node.get("reftarget", "")
    if node.get("refdomain") == "doc" and target.startswith(str(NOTEBOOKS) + "/"):
      node["reftarget"] = "notebooks/" + target[len(str(NOTEBOOKS)) + 1:]


def setup(app):
  app.connect("doctree-read", notebook_links)
  app.connect("autodoc-process-docstring", before_napoleon, priority=400)  # napoleon: 500
  app.connect("autodoc-process-docstring", after_napoleon, priority=600)
  app.connect("autodoc-process-signature", spell_out_annotations)
  app.connect("missing-reference", resolve_alias)
