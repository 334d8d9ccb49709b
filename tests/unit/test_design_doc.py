"""docs/design.md's package layout names every module of every package, as the tree has them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("contract/rft_contract", "operator/rft_operator", "trainer_image/rft_trainer",
            "trainer_image/rft_rollout", "trainer_image/rft_serving")


def layout() -> dict[str, set[str]]:
    """package dir -> the words of its lines in the layout block of section 2."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("## 2. Package layout", 1)[1].split("```", 2)[1]
    out: dict[str, set[str]] = {}
    current = None
    for line in block.splitlines():
        head = line.split()[0] if line.strip() and not line.startswith(" ") else None
        if head:
            current = head.rstrip("/")
        if current:
            out.setdefault(current, set()).update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", line))
    return out


def test_the_package_layout_names_every_module():
    words = layout()
    missing = {}
    for pkg in PACKAGES:
        modules = {p.stem for p in (ROOT / pkg).glob("*.py") if p.stem != "__init__"}
        modules |= {p.name for p in (ROOT / pkg).iterdir() if p.is_dir() and (p / "__init__.py").exists()}
        if gone := sorted(modules - words.get(pkg, set())):
            missing[pkg] = gone
    assert not missing, f"docs/design.md section 2 does not name: {missing}"
