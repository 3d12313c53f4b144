"""The built wheel carries the templates and tuned DBs, and finds them when installed."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_templates_and_finds_them_installed(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist")], check=True, cwd=tmp_path, timeout=300)
    wheel = next((tmp_path / "dist").glob("fatune-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for template in (ROOT / "templates").glob("*.jinja"):
        assert f"fatune/templates/{template.name}" in names
    assert "fatune/tuned_db/README.md" in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "fatune = fatune.cli:cli" in entry_points

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site)}
    found = subprocess.run([sys.executable, "-c", "from fatune import codegen; print(codegen.template_dir())"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(found) == site / "fatune" / "templates"
