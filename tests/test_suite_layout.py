"""The test suite's own layout: shared helpers live in modules of their own, multi-rank tests are marked.

A test module that imports another runs that module's imports (and, under
pytest, collects nothing twice only by luck): shared code goes in
tests/helpers.py, tests/reference.py, tests/models.py or tests/distributed.py.
"""
from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
# what starts several ranks: tests/distributed.py's runs, tests/helpers.py's two-rank comparison, torchrun
RUNS = {"run", "run_tolerant"}                              # distributed.<name>
STARTS_RANKS = {"assert_two_ranks_train_the_same", "TORCHRUN"}


def _imported_modules(path: pathlib.Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules |= {f"{node.module}.{alias.name}" for alias in node.names}   # from tests import test_x
    return modules


def test_no_module_imports_a_test_module():
    offenders = {path.name: sorted(m for m in _imported_modules(path) if m.split(".")[-1].startswith("test_"))
                 for path in sorted(TESTS.glob("*.py"))}
    offenders = {name: modules for name, modules in offenders.items() if modules}
    assert not offenders, (f"test modules imported by others: {offenders}; move what they share into "
                           "tests/helpers.py, tests/reference.py, tests/models.py or tests/distributed.py")


def _starts_ranks(function, functions, seen=()) -> bool:
    """Whether ``function`` starts ranks, itself or through a public helper of its module."""
    for node in ast.walk(function):
        if isinstance(node, ast.Attribute) and node.attr in RUNS and getattr(node.value, "id", None) == "distributed":
            return True
        if isinstance(node, ast.Name) and node.id in STARTS_RANKS:
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions \
                and node.func.id not in seen and functions[node.func.id] is not function:
            if _starts_ranks(functions[node.func.id], functions, (*seen, node.func.id)):
                return True
    return False


def test_every_test_that_starts_ranks_is_marked_multirank():
    """tests/conftest.py checks the tests that run at run time; this also sees the slow ones, without running them."""
    unmarked = []
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text(), str(path))
        module_marks = [ast.unparse(n.value) for n in tree.body if isinstance(n, ast.Assign)
                        and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)]
        functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        for name, function in functions.items():
            marks = module_marks + [ast.unparse(d) for d in function.decorator_list]
            if name.startswith("test_") and _starts_ranks(function, functions) \
                    and not any("multirank" in mark for mark in marks):
                unmarked.append(f"{path.name}::{name}")
    assert not unmarked, f"{unmarked} start several ranks: mark them @pytest.mark.multirank"
