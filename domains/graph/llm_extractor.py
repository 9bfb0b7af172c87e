"""``DTASK_GRAPH_EXTRACTOR=llm``: a language model names a chunk's entities.

The model lists each entity once, with its canonical name and the exact forms the text names it
by; the occurrences are then found in the text itself, so the counts a build adds (mentions per
entity, in order) come from the text, not from the model's arithmetic, and a name the text never
contains is dropped. Entities only: a build stores co-occurrence edges, not typed relations.

The prompt is ``domains/graph/prompts/entities.txt`` or the file DTASK_GRAPH_LLM_PROMPT names; its
one placeholder, ``{text}``, is the chunk's text. The extractor's ``name``, recorded on the build
(and checked by every retry of it), holds the model and the prompt's digest.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, Field, StringConstraints
from pydantic_settings import BaseSettings, SettingsConfigDict

from domains.graph.extraction import MAX_NAME_CHARS
from domains.llm_client import LLMClient, client_from_settings
from domains.llm_prompt import Prompt, load_prompt

PLACEHOLDERS = ("text",)
Name = Annotated[str, StringConstraints(strip_whitespace=True)]


class LLMExtractorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DTASK_GRAPH_LLM_", env_file=".env", extra="ignore")

    # A prompt file of your own instead of the shipped entities.txt (placeholder: {text}).
    prompt: str = ""


class Entity(BaseModel):
    name: Name
    mentions: list[Name] = Field(default_factory=list)


class Entities(BaseModel):
    # A bare name is taken as an entity that the text names only that way.
    entities: list[Entity | Name]

    def listed(self) -> list[Entity]:
        return [Entity(name=e) if isinstance(e, str) else e for e in self.entities]


def _needs_boundary(char: str) -> bool:
    # Letters and digits of scripts written with spaces must not continue into the next word
    # ("Ada" is not in "Adams"); CJK text has no spaces, so its names are found anywhere.
    return char.isalnum() and ord(char) < 0x2E80


def occurrences(text: str, entities: list[Entity]) -> list[str]:
    """Each entity's canonical name at every place the text names it, in the text's order. The
    longer form wins where two overlap ("Marie Curie" over "Curie"); a form claimed by two entities
    goes to the first listed."""
    forms: dict[str, str] = {}
    for entity in entities:
        name = " ".join(entity.name.split())
        if not name or len(name) > MAX_NAME_CHARS or "\x00" in name:
            continue  # what a graph cannot store (see extraction.MAX_NAME_CHARS)
        for form in (entity.name, *entity.mentions):
            if form and len(form) <= MAX_NAME_CHARS and form not in forms:
                forms[form] = name
    found: list[tuple[int, int, str]] = []
    taken = [False] * len(text)
    for form in sorted(forms, key=lambda f: (-len(f), f)):
        for match in re.finditer(re.escape(form), text):
            start, end = match.span()
            if any(taken[start:end]):
                continue
            if _needs_boundary(form[0]) and start > 0 and _needs_boundary(text[start - 1]):
                continue
            if _needs_boundary(form[-1]) and end < len(text) and _needs_boundary(text[end]):
                continue
            taken[start:end] = [True] * (end - start)
            found.append((start, end, forms[form]))
    return [name for _, _, name in sorted(found)]


class LLMExtractor:
    def __init__(self, client: LLMClient, prompt: Prompt) -> None:
        self.client = client
        self.prompt = prompt
        self.name = f"llm:{client.model} prompt:{prompt.digest}"

    def extract(self, text: str) -> list[str]:
        if not text.strip():
            return []
        reply = self.client.chat_json(self.prompt.render(text=text), Entities)
        return occurrences(text, reply.listed())


def from_settings() -> LLMExtractor:
    """The extractor DTASK_GRAPH_EXTRACTOR=llm loads: DTASK_LLM_* and DTASK_GRAPH_LLM_* as set now."""
    settings = LLMExtractorSettings()
    prompt = load_prompt(
        "domains.graph", "entities.txt", settings.prompt, "DTASK_GRAPH_LLM_PROMPT", PLACEHOLDERS
    )
    return LLMExtractor(client_from_settings(), prompt)
