"""The documentation against the code: the documented pass order is default_pipeline's (README, the pipeline page,
design.md), and the keywords, step attributes, report entries, CLI flags and environment variables the pages name
exist."""
from __future__ import annotations

import pathlib
import re

from zerocc.pipeline import default_pipeline

ROOT = pathlib.Path(__file__).resolve().parent.parent


def pipeline_names() -> list[str]:
    """Every pass the compiler can run, in order: capture, then default_pipeline with every optional pass turned on.

    mixed_precision, clip_gradients and place_buffers join the list only when compile() asks for them
    (param_dtype=, clip_grad_norm=, memory_pools=True); the documentation lists them in their place.
    """
    passes = default_pipeline(3, clip=(1.0, 2.0), mixed_precision=True, memory_pools=True)
    return ["capture", *[p.name for p in passes]]


def table_names(path: pathlib.Path, heading: str | None = None) -> list[str]:
    """The pass names in the first column of the first Markdown table (after ``heading``, when given)."""
    text = path.read_text()
    if heading is not None:
        assert heading in text, f"{path.name} has no heading {heading!r}"
        text = text[text.index(heading):]
    names = []
    for line in text.splitlines():
        if line.startswith("|"):
            first = line.split("|")[1]
            match = re.search(r"`(\w+)`", first)
            if match:
                names.append(match.group(1))
        elif names:
            break   # the table ended
    return names


def test_readme_pass_table_is_default_pipeline():
    assert table_names(ROOT / "README.md", "## How it works") == pipeline_names()


def test_docs_pipeline_page_is_default_pipeline():
    assert table_names(ROOT / "docs" / "passes" / "index.md") == pipeline_names()


def test_design_pipeline_is_default_pipeline():
    text = (ROOT / "docs" / "design.md").read_text()
    assert re.findall(r"^  -> (\w+)", text, flags=re.MULTILINE) == pipeline_names()


def test_every_pass_has_a_page_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for name in pipeline_names()[1:]:
        assert (ROOT / "docs" / "passes" / f"{name}.md").is_file(), f"no docs/passes/{name}.md"
        assert f"passes/{name}.md" in nav, f"docs/passes/{name}.md is not in mkdocs.yml's nav"


# -- what the pages name exists with that name ------------------------------------------------------------------

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _calls(text: str, function: str) -> list[str]:
    """The argument text of every ``function(...)`` call written in ``text`` (parentheses balanced)."""
    calls = []
    for match in re.finditer(re.escape(function) + r"\(", text):
        depth, i = 1, match.end()
        while depth and i < len(text):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        calls.append(text[match.end():i - 1])
    return calls


def test_keywords_the_pages_pass_to_compile_and_plan_exist():
    import inspect

    import zerocc
    for function, accepted in (("zerocc.compile", set(inspect.signature(zerocc.compile).parameters)),
                               ("zerocc.plan", set(inspect.signature(zerocc.plan).parameters))):
        for page in PAGES:
            for call in _calls(page.read_text(), function):
                for keyword in re.findall(r"(?<![=\w.])(\w+)=(?!=)", call):
                    assert keyword in accepted, f"{page.relative_to(ROOT)}: {function}(..., {keyword}=...)"


def test_plan_takes_every_keyword_of_compile():
    """planning.md: zerocc.plan "takes compile's keywords with the same meaning"; those that only concern a running
    step are accepted and change nothing (cache_dir was refused with a TypeError)."""
    import inspect

    import torch

    import zerocc
    from zerocc.planning import RUNTIME_ONLY
    compile_keywords = set(inspect.signature(zerocc.compile).parameters) - {"model", "optimizer", "group"}
    plan_keywords = set(inspect.signature(zerocc.plan).parameters) | set(RUNTIME_ONLY)
    assert compile_keywords <= plan_keywords, sorted(compile_keywords - plan_keywords)
    model = torch.nn.Linear(4, 1)
    plan = zerocc.plan(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=lambda out: out.sum(),
                       example_inputs=(torch.randn(2, 4),), timeout=5, static_shapes=True, max_programs=2,
                       cache_dir=str(ROOT / "no-such-folder"))
    assert plan.report()["param_count"] == 5 and not (ROOT / "no-such-folder").exists()


def test_step_attributes_the_pages_name_exist():
    import zerocc
    for page in PAGES:
        for name in re.findall(r"\bstep\.(\w+)", page.read_text()):
            assert hasattr(zerocc.CompiledStep, name), f"{page.relative_to(ROOT)}: step.{name}"


def test_cli_flags_the_pages_name_exist(capsys):
    import pytest

    from zerocc.cli import main
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    flags = set(re.findall(r"(?<![\w-])(--[\w-]+)", capsys.readouterr().out))
    assert "--world-size" in flags
    for page in PAGES:
        for command in re.findall(r"zerocc plan ((?:[^\n]*\\\n)*[^\n]*)", page.read_text()):   # continued lines too
            for flag in re.findall(r"(?<![\w-])(--[\w-]+)", command):
                assert flag in flags, f"{page.relative_to(ROOT)}: zerocc plan {flag}"


def test_environment_variables_the_pages_name_are_read():
    source = "".join(path.read_text() for path in [*(ROOT / "zerocc").rglob("*.py"), *(ROOT / "tests").glob("*.py")])
    for page in PAGES:
        for name in re.findall(r"\bZEROCC_[A-Z_]*[A-Z]", page.read_text()):
            assert name in source, f"{page.relative_to(ROOT)}: ${name}"


def test_report_entries_the_pages_name_exist():
    """``report()["key"]`` in the pages, and the peak entries memory-pools.md and planning.md list, are in a compiled
    step's report and (but for what only a run measures or loads) in a plan's."""
    import torch

    import zerocc
    named = {key for page in PAGES for key in re.findall(r'report\(\)\["(\w+)"\]', page.read_text())}
    named |= {"planned_peak_bytes", "live_peak_bytes", "lower_bound_bytes", "unplanned_bytes", "memory_pools"}
    model = torch.nn.Linear(4, 1)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=lambda out: out.sum())
    step(torch.randn(2, 4))
    assert named <= set(step.report()), sorted(named - set(step.report()))
    model = torch.nn.Linear(4, 1)
    plan = zerocc.plan(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       loss_fn=lambda out: out.sum(), example_inputs=(torch.randn(2, 4),))
    missing = named - set(plan.report()) - {"measured_peak_bytes", "compile_cache"}
    assert not missing, sorted(missing)


def test_dotted_names_and_test_ids_the_pages_name_exist():
    """`zerocc.x.y` in the pages resolves to a module or attribute; `tests/test_x.py::name` is a test there."""
    import importlib
    for page in PAGES:
        text = page.read_text()
        for dotted in set(re.findall(r"`(zerocc(?:\.\w+)+)", text)) - {"zerocc.json"}:   # a checkpoint's file
            parts = dotted.split(".")
            for end in range(len(parts), 0, -1):
                try:
                    value = importlib.import_module(".".join(parts[:end]))
                except ImportError:
                    continue
                for part in parts[end:]:
                    assert hasattr(value, part), f"{page.relative_to(ROOT)}: {dotted}"
                    value = getattr(value, part)
                break
        for path, name in re.findall(r"(tests/test_\w+\.py)::(\w+)", text):
            assert f"def {name}(" in (ROOT / path).read_text(), f"{page.relative_to(ROOT)}: {path}::{name}"


def test_defaults_the_pages_state_are_compiles():
    """"`bucket_bytes` (4 MiB by default)", "`max_programs` (8)": a compile keyword followed by a number in
    parentheses is its default in compile's signature."""
    import inspect

    import zerocc
    keywords = inspect.signature(zerocc.compile).parameters
    units = {None: 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    stated = 0
    for page in PAGES:
        text = " ".join(page.read_text().split())   # a statement broken over lines
        for name, number, unit in re.findall(r"`(\w+)` \(([\d.,_]+)(?: (KiB|MiB|GiB))?\b", text):
            if name in keywords:
                value = float(number.replace(",", "").replace("_", "")) * units[unit or None]
                assert value == keywords[name].default, f"{page.relative_to(ROOT)}: `{name}` ({number} {unit})"
                stated += 1
    assert stated >= 3


def test_the_cli_help_example_and_planning_page_run_the_same_flags(capsys):
    """`zerocc plan --help` shows a command line; every flag in it exists (the page's are checked above)."""
    import pytest

    from zerocc.cli import main
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = capsys.readouterr().out
    flags = set(re.findall(r"(?<![\w-])(--[\w-]+)", help_text.split("options:")[-1]))
    example = help_text.split("options:")[0]
    for flag in re.findall(r"(?<![\w-])(--[\w-]+)", example.split("zerocc plan", 1)[-1]):
        assert flag in flags, f"zerocc plan --help's example: {flag}"


def test_the_home_page_links_every_page_of_the_site_nav():
    """docs/index.md is where a reader starts: every guide page (and launch, models) in mkdocs.yml's nav is linked
    from it (what capture accepts, the compile cache, launching and the model zoo were in the nav but not there)."""
    nav = (ROOT / "mkdocs.yml").read_text()
    linked = set(re.findall(r"\]\(([\w/.-]+\.md)(?:#[\w-]*)?\)", (ROOT / "docs" / "index.md").read_text()))
    pages = [page for page in re.findall(r":\s+([\w/.-]+\.md)\s*$", nav, flags=re.MULTILINE)
             if page.startswith("guide/") or page in ("launch.md", "models.md")]
    assert len(pages) >= 15
    assert not [page for page in pages if page not in linked], sorted(set(pages) - linked)


def test_readme_links_and_named_files_exist():
    """README.md is not built by mkdocs (whose --strict build checks the site's links): its relative links (and
    their #anchors) and the files it names in backticks exist."""
    def slug(heading: str) -> str:   # Python-Markdown's toc slugify, as mkdocs and GitHub make anchors
        return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        assert (ROOT / path).exists(), f"README.md links {target}"
        if anchor and path.endswith(".md"):
            headings = {slug(h) for h in re.findall(r"^#+ (.*)$", (ROOT / path).read_text(), flags=re.MULTILINE)}
            assert anchor in headings, f"README.md links {target}: no such heading"
    for path in re.findall(r"`((?:zerocc|tests|benchmarks|examples|docs)/[\w./-]+\.(?:py|md))`", text):
        assert (ROOT / path).exists(), f"README.md names {path}"
