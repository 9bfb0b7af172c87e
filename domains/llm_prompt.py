"""Prompt templates of the language-model features: a text file with ``{placeholders}``.

Each feature ships its prompt as package data (``domains/<domain>/prompts/*.txt``) and has a setting
naming a user's own file instead. Only the feature's own placeholders are replaced, literally, so a
prompt may show JSON (braces) as it is. A template without ``{text}`` is refused: it would send the
model nothing to work on.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    template: str
    source: str  # the file it came from, for error messages
    placeholders: tuple[str, ...]

    @property
    def digest(self) -> str:
        """Short and stable: what a dataset or a graph records of the prompt that wrote it."""
        return hashlib.sha256(self.template.encode()).hexdigest()[:8]

    def render(self, **values: object) -> str:
        unknown = set(values) - set(self.placeholders)
        if unknown:
            raise ValueError(f"prompt {self.source}: no placeholder {sorted(unknown)}")
        text = self.template
        for name in self.placeholders:
            text = text.replace("{" + name + "}", str(values.get(name, "")))
        return text


def load_prompt(
    package: str, filename: str, override: str, setting: str, placeholders: tuple[str, ...]
) -> Prompt:
    """The user's file ``override`` if set (``setting`` names it in errors), else the shipped one."""
    if override:
        path = Path(override).expanduser()
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{setting}={override!r}: cannot read it ({exc})") from exc
        source = str(path)
    else:
        template = resources.files(package).joinpath("prompts").joinpath(filename).read_text(encoding="utf-8")
        source = f"{package}/prompts/{filename}"
    if "{text}" not in template:
        raise ValueError(
            f"prompt {source} has no {{text}} placeholder ({setting}; placeholders: {placeholders})"
        )
    return Prompt(template, source, placeholders)
