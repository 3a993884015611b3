"""What `diffrl presets` shows: each preset's purpose and how far it has been verified.

Both come from the preset file's leading comment block:

    # <what the preset is for: its first sentence is the summary> ...
    # ... more lines of explanation ...
    # verified: <level>[. <the evidence: where the measurement is written down,
    # over as many comment lines as it needs>]

`<level>` is one of `LEVELS`, from least to most: the preset has not been run yet; a test of the
suite runs it end to end on CPU (CI); it has run at its full size on a GPU and the numbers are in
the docs; training with it measurably improved its target metric (docs hold the before/after).
"""

from __future__ import annotations

import re
import shutil
import textwrap
from dataclasses import dataclass
from pathlib import Path

PRESETS_DIR = Path(__file__).parent / "presets"
LEVELS = (
    "not yet run",
    "CPU end to end in CI",
    "measured on a GPU at full size",
    "learning verified",
)
_VERIFIED = re.compile(r"^#\s*verified:\s*(.*)$")
# A sentence ends at . ! or ? followed by whitespace; dots inside names (FLUX.1-dev, SD3.5) and
# file names (nft.py) have no space after them.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class PresetInfo:
    name: str
    summary: str  # the first sentence of the header
    level: str  # one of LEVELS
    evidence: str  # what the level rests on ("" when not yet run)


def preset_info(name: str, presets_dir: Path = PRESETS_DIR) -> PresetInfo:
    """Read the header of preset `name`; a missing or unknown verification level is a ValueError."""
    path = presets_dir / f"{name}.yaml"
    text_lines, verified = [], None
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        match = _VERIFIED.match(line)
        if match:
            verified = match.group(1).strip()
        elif verified is not None:  # the evidence goes on over the following comment lines
            verified += " " + line.lstrip("#").strip()
        else:
            text_lines.append(line.lstrip("#").strip())
    if verified is None:
        raise ValueError(
            f"preset {path} has no '# verified: <level>' line in its header comment; levels: {', '.join(LEVELS)}"
        )
    level = next((lv for lv in LEVELS if verified == lv or verified.startswith(lv + ".")), None)
    if level is None:
        raise ValueError(f"preset {path}: 'verified: {verified}' does not start with one of {list(LEVELS)}")
    paragraph = " ".join(line for line in text_lines if line)
    summary = _SENTENCE_END.split(paragraph, maxsplit=1)[0] if paragraph else ""
    return PresetInfo(name, summary, level, verified[len(level) :].lstrip(". ").strip())


def preset_names(presets_dir: Path = PRESETS_DIR) -> list[str]:
    return sorted(path.stem for path in presets_dir.glob("*.yaml"))


def format_presets(width: int | None = None) -> str:
    """The `diffrl presets` listing: name, summary wrapped to the terminal, verification level."""
    names = preset_names()
    width = width or shutil.get_terminal_size((100, 24)).columns
    indent = max(map(len, names)) + 2
    body = max(40, width - indent)
    lines = []
    for name in names:
        info = preset_info(name)
        wrapped = textwrap.wrap(info.summary, body) or [""]
        lines.append(f"{name:<{indent}}{wrapped[0]}")
        lines += [" " * indent + rest for rest in wrapped[1:]]
        lines.append(" " * indent + f"[{info.level}]")
    lines.append("")
    lines.append("levels: " + " < ".join(LEVELS) + " (the evidence is in each preset's header)")
    return "\n".join(lines) + "\n"
