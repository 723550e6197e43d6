"""mkdocs hook: the docs show plots that live in results/ (outside docs/); copy them into the site.

A page at docs/X.md links `../results/...png`; mkdocs serves it at /X/, so the same relative link
resolves to /results/... in the built site. Copying the images keeps one copy of each in the repo.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def on_post_build(config: Any, **kwargs: Any) -> None:
    site = Path(config["site_dir"])
    for png in (ROOT / "results").rglob("*.png"):
        dest = site / png.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(png, dest)
