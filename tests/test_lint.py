"""The code is clean under the project's ruff configuration (pyproject.toml: line length, import order, unused names)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def ruff() -> str:
    """The ruff the test extra installs, beside this interpreter (a virtualenv's bin/), else on PATH."""
    beside = pathlib.Path(sys.executable).with_name("ruff")
    found = str(beside) if beside.exists() else shutil.which("ruff")
    assert found, "ruff is not installed: it comes with the test extra (pip install -e '.[test]')"
    return found


def test_ruff_finds_nothing():
    result = subprocess.run([ruff(), "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_configuration_catches_a_long_line_unsorted_imports_and_an_unused_name(tmp_path):
    """A configuration that checked nothing would pass the test above: a file breaking each rule is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nimport os\n\nx = '" + "a" * 170 + "'\n")
    result = subprocess.run(
        [ruff(), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), "--output-format", "concise", str(bad)],
        capture_output=True, text=True,
    )
    found = {line.split(" ")[1] for line in result.stdout.splitlines() if line.startswith(str(bad))}
    assert {"E501", "I001", "F401"} <= found, result.stdout
