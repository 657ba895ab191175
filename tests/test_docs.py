"""The docs stay true to the code: the settings table is the models' own, and every link resolves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_the_settings_table_is_generated_from_the_models():
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "generate_reference.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr


def _anchors(page: Path) -> set[str]:
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_no_page_cites_a_file_outside_the_repository():
    outside = [
        str(p.relative_to(ROOT))
        for p in [*PAGES, *ROOT.joinpath("mrlx_plugin").rglob("*.py")]
        if "SLIME_CONTRACT" in p.read_text() or "DESIGN.md" in p.read_text()
    ]
    assert not outside, outside
