"""The documented pass order is the compiler's: README, the docs site's pipeline page and design.md against default_pipeline."""
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
