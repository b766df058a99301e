"""The default suite's slowest tests and their seconds, so tests/conftest.py can start them first.

Under ``pytest -n 2 --dist worksteal`` each worker first gets a contiguous half of
the collection and an idle worker steals from the end of the other's queue: a
long test collected late runs alone at the end. Ordering the slowest first keeps
that tail short. The numbers go stale as tests change; a stale number only
changes the order, never what runs. Refresh them from a whole run's junit file:

    python -m pytest -q -n 2 --dist worksteal tests --junitxml=/tmp/suite.xml
    python tests/durations.py /tmp/suite.xml
"""
from __future__ import annotations

import json
import pathlib
import sys
import xml.etree.ElementTree as ElementTree

FILE = pathlib.Path(__file__).with_name("durations.json")
KEEP_SECONDS = 5.0   # faster tests keep their collection order: they cannot make a long tail


def load() -> dict[str, float]:
    """Test node id -> seconds its call took in the last recorded run (only the slow ones)."""
    return json.loads(FILE.read_text()) if FILE.exists() else {}


def node_id(case) -> str:
    """A junit testcase's pytest node id (junit writes the module as a dotted classname)."""
    module = case.get("classname").split(".")
    return "/".join(module) + ".py::" + case.get("name")


def main(junit_path: str) -> None:
    cases = ElementTree.parse(junit_path).getroot().iter("testcase")
    seconds = {node_id(case): round(float(case.get("time")), 1) for case in cases}
    slow = dict(sorted(((k, v) for k, v in seconds.items() if v >= KEEP_SECONDS), key=lambda kv: -kv[1]))
    FILE.write_text(json.dumps(slow, indent=1) + "\n")
    print(f"{FILE}: {len(slow)} tests of {len(seconds)} take {KEEP_SECONDS:g} s or more")


if __name__ == "__main__":
    main(sys.argv[1])
