"""The README's layout table against the package it describes."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_layout_table_names_every_module_of_medusa_infer():
    """A module moved out of another one (chat.py out of decoding.py) went unnamed in the table."""
    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `medusa_infer/` |"))
    modules = sorted(p.name for p in (ROOT / "medusa_infer").glob("*.py") if not p.name.startswith("__"))
    folders = sorted(f"{p.name}/" for p in (ROOT / "medusa_infer").iterdir() if (p / "__init__.py").is_file())
    assert [name for name in modules + folders if f"`{name}`" not in row] == []
