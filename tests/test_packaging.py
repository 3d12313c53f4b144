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
    templates = sorted((ROOT / "templates").glob("*/*.jinja"))
    assert {template.parent.name for template in templates} == {"triton", "gluon"}
    for template in templates:
        assert f"fatune/templates/{template.parent.name}/{template.name}" in names
    assert "fatune/tuned_db/README.md" in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "fatune = fatune.cli:cli" in entry_points

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site)}
    found = subprocess.run([sys.executable, "-c", "from fatune.kernel.triton import codegen; print(codegen.TEMPLATES.path)"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(found) == site / "fatune" / "templates" / "triton"


def test_the_shipped_dbs_entries_are_current_with_these_templates(tmp_path):
    """Every shipped entry's kernels render as they did when it was measured (fatune.db.is_stale): a template
    edit that reaches their code would leave a fresh install on the heuristic until the DB is refreshed
    (`fatune db refresh`), so it fails here first. Read from a copy: opening the asset itself may write to it."""
    import shutil

    import triton

    from fatune.db import is_stale, read_entries

    shipped = sorted((ROOT / "tuned_db").glob("*.sqlite"))
    assert shipped, "no tuned DB in tuned_db/"
    for path in shipped:
        copy = tmp_path / path.name
        shutil.copyfile(path, copy)
        entries = read_entries(copy)
        versions = {entry.triton_version for entry in entries}
        if versions != {triton.__version__}:
            continue  # measured under another Triton: stale here whatever the templates (is_stale says so)
        stale = [(entry.dtype, entry.head_dim, entry.seqlen_q_bucket, reasons)
                 for entry in entries if (reasons := is_stale(entry))]
        assert not stale, f"{path.name}: {len(stale)} of {len(entries)} entries stale, e.g. {stale[:2]}"
