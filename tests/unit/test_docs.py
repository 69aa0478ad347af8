"""The README and docs/ point at things that exist: pages, make targets, settings. The prose itself is not tested."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from app import settings as settings_module
from app.settings import NOT_SETTINGS, Settings

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_WORDS = 3000

# Pages other work writes. The integrator empties this set once they are merged: then a link to a page that
# is not there fails like any other.
ALLOWED_MISSING: set[str] = set()

# SHIM_* names the docs mention that app/settings.py does not know yet. The settings work adds the target
# design's names and lists the removed ones; until it lands the names below are allowed. The integrator
# empties this set: then every name must be a setting, a name other tools read, or one settings.py lists as
# retired.
AWAITING_SETTINGS_WORK: set[str] = set()
TYPO_EXAMPLES = {"SHIM_TRITON_TIMEOUT"}  # docs/troubleshooting.md shows the start refusing it

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_BLOCK = re.compile(r"```.*?```", re.S)
CODE_SPAN = re.compile(r"`[^`\n]+`")


def relative_links(page: Path) -> list[str]:
    text = CODE_BLOCK.sub("", page.read_text())
    return [t.split("#")[0] for t in LINK.findall(text)
            if not re.match(r"^[a-z]+:", t) and not t.startswith("#")]


def code(page: Path) -> str:
    """What a reader would type: the fenced blocks and the `code spans` of a page."""
    text = page.read_text()
    blocks = CODE_BLOCK.findall(text)
    return "\n".join(blocks + CODE_SPAN.findall(CODE_BLOCK.sub("", text)))


def words(page: Path) -> int:
    return len(page.read_text().split())  # as `wc -w` counts


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.M))


def retired_names() -> set[str]:
    """SHIM_* names app/settings.py lists as removed (a start with one of them stops, naming the replacement)."""
    retired = getattr(settings_module, "RETIRED", {})
    return {name for name in retired if name.startswith("SHIM_")}


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in relative_links(page):
            path = (page.parent / target).resolve()
            name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
            if not path.exists() and name not in ALLOWED_MISSING:
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_the_allowed_missing_pages_are_still_missing_or_linked() -> None:
    """An entry that is no longer needed is removed, so the list cannot hide a page that went away later."""
    linked = {(page.parent / t).resolve().relative_to(ROOT).as_posix() for page in PAGES for t in relative_links(page)
              if (page.parent / t).resolve().is_relative_to(ROOT)}
    stale = {name for name in ALLOWED_MISSING if (ROOT / name).exists() or name not in linked}
    assert not stale, f"remove from ALLOWED_MISSING: {sorted(stale)}"


def test_the_readme_is_the_first_ten_minutes() -> None:
    assert words(README) <= README_MAX_WORDS, f"README.md has {words(README)} words; move detail into docs/"


def test_every_make_target_the_docs_name_exists() -> None:
    assert {"run", "test"} <= set(re.findall(r"\bmake ([a-z][\w-]*)", code(README))), "the README's two commands"
    missing = {(target, page.relative_to(ROOT).as_posix()) for page in PAGES
               for target in re.findall(r"\bmake ([a-z][\w-]*)", code(page)) if target not in makefile_targets()}
    assert not missing, sorted(missing)


def test_every_setting_the_docs_name_is_known_to_the_shim() -> None:
    """DEPENDS ON THE SETTINGS WORK: see AWAITING_SETTINGS_WORK above."""
    known = {f"SHIM_{f.name.upper()}" for f in dataclasses.fields(Settings)} | NOT_SETTINGS | retired_names()
    named = {(name, page.relative_to(ROOT).as_posix()) for page in PAGES
             for name in re.findall(r"\bSHIM_[A-Z0-9_]*[A-Z0-9]\b", page.read_text())}
    allowed = known | AWAITING_SETTINGS_WORK | TYPO_EXAMPLES
    unknown = sorted((name, where) for name, where in named if name not in allowed)
    assert not unknown, unknown
