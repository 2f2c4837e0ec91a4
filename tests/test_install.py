"""The installed package (not the checkout) carries conf/, and Hydra finds it there."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_wheel_install_composes_the_recipes_outside_the_checkout(tmp_path):
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(ROOT)], check=True)
    wheel = next((tmp_path / "dist").glob("streamdraft-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp_path / "site"), str(wheel)], check=True)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    out = subprocess.run(
        [sys.executable, "-m", "trainer", "--cfg", "job", "+experiment=grok_100ep"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "epochs: 100" in out and "name: constant" in out
    where = subprocess.run(
        [sys.executable, "-c", "import trainer.__main__ as m; print(m.CONF_DIR)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert where == str(tmp_path / "site" / "conf")
