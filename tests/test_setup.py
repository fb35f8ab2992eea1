"""The set-up contract: README starts with the two commands; a second `make` installs nothing."""

from __future__ import annotations

import subprocess

from tests.procs import REPO


def test_readme_starts_with_run_and_test() -> None:
    head = (REPO / "README.md").read_text().splitlines()[:12]
    assert any(line.startswith("make run") for line in head)
    assert any(line.startswith("make test") for line in head)


def test_second_make_does_not_reinstall() -> None:
    plan = subprocess.run(
        ["make", "-n", "test"], cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert plan.returncode == 0
    assert "pip install" not in plan.stdout
    assert "pytest" in plan.stdout
