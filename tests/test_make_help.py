"""`make` alone lists every target with its whole description: the listing once cut the image
target's line at the `|` of `KIND=cuda|cpu`."""

from __future__ import annotations

import re

from tests.conftest import REPO_ROOT, make

TARGET = re.compile(r"^\.PHONY: ([a-z0-9-]+) +## (.*)$", re.MULTILINE)


def test_make_help_shows_every_target_with_its_whole_description():
    targets = TARGET.findall((REPO_ROOT / "Makefile").read_text())
    assert ("image", next(d for t, d in targets if t == "image")) in targets
    shown = make("help", timeout=60)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    for target, description in targets:
        assert any(line.split() == [target, *description.split()] for line in lines), (
            target,
            shown.stdout,
        )
    assert "KIND=cuda|cpu" in shown.stdout
