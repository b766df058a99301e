"""The package's seams: a pass never imports another pass; what two passes share is an analysis (zerocc/analysis/)."""
from __future__ import annotations

import ast
import pathlib

import zerocc

PACKAGE = pathlib.Path(zerocc.__file__).parent
PASSES = PACKAGE / "passes"


def _imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, as (line, dotted name under zerocc), relative imports resolved."""
    here = ["zerocc", *path.parent.relative_to(PACKAGE).parts]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):   # imports inside functions too
        if isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if node.module:
                found.append((node.lineno, module))
            else:   # from . import x: each name is a module
                found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
    return found


def test_no_pass_imports_another_pass():
    pass_modules = {f"zerocc.passes.{p.stem}" for p in PASSES.glob("*.py") if p.stem != "__init__"}
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
                 for path in sorted(PASSES.glob("*.py"))
                 for line, module in _imported_modules(path)
                 if module in pass_modules or module == "zerocc.passes"]
    assert not offenders, ("a pass imports another pass; move what they share into zerocc/analysis/:\n"
                           + "\n".join(offenders))


def test_analyses_import_no_pass():
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
                 for path in sorted((PACKAGE / "analysis").glob("*.py"))
                 for line, module in _imported_modules(path) if module.startswith("zerocc.passes")]
    assert not offenders, "an analysis imports a pass:\n" + "\n".join(offenders)
