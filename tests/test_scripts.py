"""The scripts no other test runs: every benchmark and example still starts against the current API, the commands
the pages write for them use flags they define, and the wheel a user installs (not an editable checkout) holds
every zerocc subpackage.

Each benchmark is a measurement too long for the suite; what rots between runs is cheaper to catch: an import or a
module-level name that moved (``--help`` runs the script's top level and its argument parser), a flag renamed in
the script but not on the page that tells a reader to pass it, a package directory the build leaves out.
"""
from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("examples/*.py")])
# where a reader is told which command to run (benchmarks/results/ records what ran on its date: not rewritten)
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
         *SCRIPTS, *sorted(ROOT.glob("benchmarks/*.sh"))]
# `python[3] [-m x] benchmarks/x.py ...` or `torchrun <its options> examples/x.py ...`, to the end of the code
COMMAND = re.compile(r"(?:python3?|torchrun[^\n`]*?)\s+((?:benchmarks|examples)/\w+\.py)([^\n`]*)")
FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)")


def has_argument_parser(script: pathlib.Path) -> bool:
    return "ArgumentParser(" in script.read_text()


def defined_flags(script: pathlib.Path) -> set[str]:
    """The options ``script``'s argparse parser defines (read from its source: no process, no torch import)."""
    flags = {"--help"}
    for call in ast.walk(ast.parse(script.read_text())):
        if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "add_argument":
            flags |= {a.value for a in call.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return flags


def documented_commands():
    """(page, line, script, flags) for every command line the pages write for a script of this repository."""
    for page in PAGES:
        text = re.sub(r"\\\n\s*", " ", page.read_text())   # a shell line continued with a backslash
        for number, line in enumerate(text.splitlines(), 1):
            for match in COMMAND.finditer(line):
                script, rest = match.group(1), match.group(2).split(" #")[0]
                forwarded = ""
                if " -- " in f"{rest} ":   # sanitized_run.py passes what follows `--` to long_run.py (or to pytest)
                    rest, _, forwarded = f"{rest} ".partition(" -- ")
                yield page, number, script, FLAG.findall(rest.replace("=", " "))
                if forwarded and script.endswith("sanitized_run.py") and "--pytest" not in rest:
                    yield page, number, "benchmarks/long_run.py", FLAG.findall(forwarded.replace("=", " "))


def test_documented_script_commands_use_flags_the_scripts_define():
    """A page telling the reader to run a benchmark or example with a flag the script does not define sends them into
    argparse's error (docs/testing.md gave gpu_session.sh's arguments after they had changed)."""
    seen, wrong = 0, []
    for page, number, script, flags in documented_commands():
        path = ROOT / script
        where = f"{page.relative_to(ROOT)}:{number}"
        if not path.exists():
            wrong.append(f"{where}: {script} does not exist")
            continue
        seen += 1
        if flags and not has_argument_parser(path):
            wrong.append(f"{where}: {script} takes no options, the page passes {flags}")
        elif flags:
            wrong += [f"{where}: {script} has no {flag}" for flag in flags if flag not in defined_flags(path)]
    assert seen >= 40   # the pattern still finds the commands
    assert not wrong, "\n".join(wrong)


def test_gpu_session_arguments_are_as_documented():
    """gpu_session.sh takes one positional argument, its seconds (docs/testing.md had it as MODEL [PRECISION])."""
    script = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    assert "budget=${1:-450}" in script and "${2" not in script
    for page in PAGES:
        for usage in re.findall(r"gpu_session\.sh( \[[^\]`]*\]*)", page.read_text()):
            assert usage.strip() == "[SECONDS]", f"{page.relative_to(ROOT)}: gpu_session.sh{usage}"


HELP_RUNNER = r"""
import contextlib, io, runpy, sys, traceback
failed = []
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    saved_path = list(sys.path)
    try:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            runpy.run_path(path, run_name="__main__")
        failed.append(f"{path}: --help returned without exiting")
    except SystemExit as done:
        if done.code not in (0, None):
            failed.append(f"{path}: --help exited with {done.code}")
        elif "usage:" not in out.getvalue():
            failed.append(f"{path}: --help printed no usage")
    except BaseException:
        failed.append(f"{path}:\n{traceback.format_exc()}")
    sys.path[:] = saved_path
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_script_with_options_prints_its_help():
    """``--help`` runs a script's imports, its module-level code and its parser: a benchmark importing a name that
    moved, or reading an attribute zerocc no longer has at import, fails here rather than at its next measurement.
    One process for all of them (torch is imported once); scripts without options are parsed only."""
    with_options = [str(s) for s in SCRIPTS if has_argument_parser(s)]
    for script in SCRIPTS:
        ast.parse(script.read_text(), filename=str(script))
    assert len(with_options) >= 20
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", HELP_RUNNER, *with_options], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]


def test_the_wheel_holds_every_subpackage_and_file_of_zerocc(tmp_path):
    """A user who runs ``pip install .`` (or installs a wheel) gets only what the build packs: every directory of
    zerocc/ with Python in it, and any file the package reads beside its modules, must be in the wheel. Built
    from a copy of the sources, so the build's own folders (build/, *.egg-info) stay out of the checkout."""
    pytest.importorskip("setuptools", reason="the build backend (pyproject.toml's build-system) is not installed")
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        (source / name).write_bytes((ROOT / name).read_bytes())
    files = [p for p in (ROOT / "zerocc").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for path in files:
        target = source / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    build = ("import sys; from setuptools import build_meta; "
             "print(build_meta.build_wheel(sys.argv[1]))")
    result = subprocess.run([sys.executable, "-c", build, str(tmp_path / "dist")], cwd=source,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    wheel = tmp_path / "dist" / result.stdout.strip().splitlines()[-1]
    packed = set(zipfile.ZipFile(wheel).namelist())
    missing = [str(p.relative_to(ROOT)) for p in files if str(p.relative_to(ROOT)) not in packed]
    assert not missing, f"not in the wheel: {missing}"
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in packed if n.endswith(".dist-info/entry_points.txt")))
    assert "zerocc = zerocc.cli:main" in entry_points.decode()


def test_messages_name_zerocc_pages_that_exist():
    """An installed zerocc has no docs/ folder beside the user's code: a message pointing at a page says it is
    zerocc's, and the page exists in the repository (a page renamed or moved leaves the message pointing nowhere).
    Strings only (docstrings and comments are for readers of the source, who have the checkout)."""
    wrong, seen = [], 0
    for path in sorted((ROOT / "zerocc").rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docstrings:
                continue
            for match in re.finditer(r"(\S*\s?)(docs/[\w/-]+\.md)", node.value):
                seen += 1
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                if not (ROOT / match.group(2)).exists():
                    wrong.append(f"{where}: {match.group(2)} does not exist")
                if match.group(1).strip("( ") != "zerocc's":
                    wrong.append(f"{where}: '{match.group(0)}' does not say the page is zerocc's")
    assert seen >= 5
    assert not wrong, "\n".join(wrong)


def test_benchmarks_readme_lists_every_script():
    """benchmarks/README.md's table is where a reader finds what each script measures (first_step.py and predict.py
    were missing from it)."""
    listed = set(re.findall(r"^\| `([\w.]+)` \|", (ROOT / "benchmarks" / "README.md").read_text(), flags=re.MULTILINE))
    scripts = {p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh")}
    assert not scripts - listed, sorted(scripts - listed)


DEEPSPEED_LINEAR = r"""
import os, sys
sys.path.insert(0, "benchmarks")
import compare   # sets DeepSpeed's CPU environment before torch is imported
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("gloo", rank=0, world_size=1)
plain = torch.nn.functional.linear
seen = []
hook = torch.nn.modules.module.register_module_forward_pre_hook(
    lambda module, args: seen.append(torch.nn.functional.linear.__module__) if isinstance(module, torch.nn.Linear) else None)
step = compare.system("DeepSpeed-3")()
assert torch.nn.functional.linear is plain, f"after building DeepSpeed-3: {torch.nn.functional.linear.__module__}"
step(*compare.model_batch(torch.Generator().manual_seed(0)))
assert torch.nn.functional.linear is plain, f"after its step: {torch.nn.functional.linear.__module__}"
assert seen and all("deepspeed" in m for m in seen), f"DeepSpeed-3's step ran {set(seen)}"
hook.remove()
dist.destroy_process_group()
"""


def test_compare_gives_back_the_linear_deepspeed_zero3_replaces():
    """DeepSpeed ZeRO-3 replaces ``torch.nn.functional.linear`` for the whole process with its own autograd.Function,
    and keeps it (issue 19): frontier.py's budgeted zerocc compiles, built after DeepSpeed-3, traced DeepSpeed's
    linear, a different step whose floor (56,536,576 bytes on the 5M GPT) was above the one zerocc.plan named
    (56,257,536) before DeepSpeed ran, and every budget between them was refused; DDP and FSDP2 stepped after it
    ran DeepSpeed's linear too. compare's DeepSpeed builder puts torch's back, and its steps alone run DeepSpeed's."""
    pytest.importorskip("deepspeed")
    import socket
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", DEEPSPEED_LINEAR, str(port)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
