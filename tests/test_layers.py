"""The layers of DESIGN.md section 9, checked so that they cannot drift back.

- the import contracts in pyproject.toml ([tool.importlinter]: layers,
  services independent, torch-free orchestrator / SDK / core, no cycles),
  run with import-linter;
- no module uses another module's underscore names;
- no module over 500 lines (generated code excepted).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specdec", "drafter", "verifier", "orchestrator")
GENERATED = ROOT / "specdec" / "v1"
MAX_LINES = 500

def our_modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if GENERATED not in p.parents)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_import_contracts_hold():
    """lint-imports with the contracts of pyproject.toml: every one KEPT."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "BROKEN" not in done.stdout and "KEPT" in done.stdout


def test_the_command_line_loads_without_torch():
    """`specdec --help`, and the orchestrator's entry point ``python -m
    specdec.cli.stack``, import no torch: the application layer may use torch
    (import-linter sees every import, also inside functions), but only in the
    commands that run models."""
    code = ("import sys; from specdec.cli import main, stack; main.build_parser(); "
            "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; assert not bad, bad")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# -- underscore names ------------------------------------------------------------------------
def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_private_names(tree: ast.Module) -> set[str]:
    """Underscore names a module defines: functions, classes, assignments
    (module, class or ``self.`` / ``cls.`` attributes) and import aliases."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if private(n)}


def module_aliases(tree: ast.Module) -> set[str]:
    """Local names bound to one of our modules (``import specdec.x``, ``from specdec import wire``)."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in PACKAGES}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            aliases |= {a.asname or a.name for a in node.names}
    return aliases


def private_uses(path: Path, tree: ast.Module, ours: set[str]) -> set[tuple[str, str, int]]:
    """(module, name, line) for each underscore name of another of our modules
    used here: imported from it, read off it, or read off an object (not
    ``self`` / ``cls``) under a name that only other modules of ours define.
    Underscore attributes of third-party objects (``namedtuple._replace``)
    are not ours to judge and pass."""
    mine = defined_private_names(tree)
    aliases = module_aliases(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            found |= {(rel(path), a.name, node.lineno) for a in node.names if private(a.name)}
        elif isinstance(node, ast.Attribute) and private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Name) and base.id in aliases:
                found.add((rel(path), node.attr, node.lineno))
            elif node.attr in ours and node.attr not in mine:
                found.add((rel(path), node.attr, node.lineno))
    return found


def all_private_uses() -> set[tuple[str, str, int]]:
    trees = {path: ast.parse(path.read_text(), filename=str(path)) for path in our_modules()}
    ours = set().union(*(defined_private_names(t) for t in trees.values()))
    return set().union(*(private_uses(path, t, ours) for path, t in trees.items()))


def test_no_module_uses_another_modules_underscore_names():
    uses = all_private_uses()
    assert not uses, "make these public and name them well:\n" + "\n".join(
        f"{where}:{line}: {name}" for where, name, line in sorted(uses))


def test_the_private_name_check_sees_what_it_must(tmp_path):
    """The checker flags imports, module attributes and other objects'
    underscore names of ours, and lets self, cls and third-party names pass."""
    source = ("from specdec.cli import _hidden\n"
              "from specdec import procs\n"
              "procs._spawn('x', [])\n"
              "def f(stack, details):\n"
              "    stack._wait_serving([])\n"
              "    details._replace(metadata=None)\n"
              "class A:\n"
              "    def g(self, other):\n"
              "        self._own = other._own\n")
    path = ROOT / "specdec" / "example.py"        # only named, never written
    found = {(name, line) for _, name, line in private_uses(path, ast.parse(source), {"_wait_serving", "_spawn"})}
    assert found == {("_hidden", 1), ("_spawn", 3), ("_wait_serving", 5)}


# -- sizes -----------------------------------------------------------------------------------
def test_no_module_is_over_500_lines():
    sizes = {rel(p): len(p.read_text().splitlines()) for p in our_modules()}
    long = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not long, f"split these (at most {MAX_LINES} lines): " + ", ".join(
        f"{name} ({n})" for name, n in sorted(long.items()))


# -- the layout ------------------------------------------------------------------------------
APPLICATION_MODULES = {"__init__.py", "local.py", "procs.py", "protos_build.py"}


def test_specdec_holds_packages_not_modules():
    """The core lives in packages named for their layers; directly in specdec/
    only the application's entry points beside them (DESIGN.md §9)."""
    flat = {p.name for p in (ROOT / "specdec").glob("*.py")}
    assert flat == APPLICATION_MODULES, f"move these into the package of their layer: {sorted(flat - APPLICATION_MODULES)}"


def test_every_package_says_what_it_is_and_what_it_may_import():
    packages = sorted(p.parent for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")
                      if p.parent != GENERATED)
    missing = [rel(p) for p in packages
               if "May import:" not in (ast.get_docstring(ast.parse((p / "__init__.py").read_text())) or "")]
    assert len(packages) >= 16 and not missing, f"docstrings without a 'May import:' line: {missing}"
