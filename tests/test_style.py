"""The formatter and the linter (ruff, configured in pyproject.toml) agree with the tree."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")


@pytest.mark.skipif(RUFF is None, reason="ruff is not installed (pip install -e '.[test]')")
@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff(args):
    done = subprocess.run([RUFF, *args], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


OUTSIDE = ("../" + "shared/", "ENVIRON" + "MENT.md", "FIELD" + "_NOTES.md")  # the steering repo's files: users do not have them
SKIP_DIRS = {".git", ".venv", ".cache", "outputs", "__pycache__"}


def test_no_project_file_points_outside_the_repository():
    found = []
    for path in ROOT.rglob("*"):
        if path.is_file() and not SKIP_DIRS & set(path.relative_to(ROOT).parts) and path.suffix in (".py", ".md", ".sh", ".yaml", ".cfg"):
            text = path.read_text(encoding="utf-8", errors="replace")
            found += [f"{path.relative_to(ROOT)}: {ref}" for ref in OUTSIDE if ref in text]
    assert not found, "\n".join(found)
