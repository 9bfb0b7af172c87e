"""The local generator and the plan a dataset draws from: deterministic, every (chunk, ordinal) once,
and the order a resume relies on."""

from __future__ import annotations

import pytest

from domains.evaluation.generation import (
    Chunk,
    GeneratedItem,
    ItemRequest,
    LocalGenerator,
    capacity,
    load_generator,
    plan,
    relevant_chunks,
)
from domains.evaluation.handlers import outcome

CHUNKS = [
    Chunk("b-0", "Rivers carve valleys over thousands of years. Floods move the banks."),
    Chunk("a-0", "Glaciers grind rock into flour. Meltwater carries it far downstream."),
    Chunk("a-1", "Meltwater carries it far downstream. Short."),
]


def test_the_plan_takes_ordinal_0_of_every_chunk_then_ordinal_1_in_chunk_id_order() -> None:
    requests = list(plan(CHUNKS, 2))
    assert [(r.chunk.chunk_id, r.ordinal) for r in requests] == [
        ("a-0", 0), ("a-1", 0), ("b-0", 0), ("a-0", 1), ("a-1", 1), ("b-0", 1),
    ]  # fmt: skip
    assert list(plan(list(reversed(CHUNKS)), 2)) == requests  # the input order does not matter
    assert capacity(len(CHUNKS), LocalGenerator.per_chunk) == 3 * LocalGenerator.per_chunk


def test_the_local_generator_is_deterministic_and_quotes_its_chunk() -> None:
    requests = list(plan(CHUNKS, LocalGenerator.per_chunk))
    first, again = LocalGenerator().generate(requests), LocalGenerator().generate(requests)
    assert first == again
    assert [(i.chunk_id, i.ordinal) for i in first] == [(r.chunk.chunk_id, r.ordinal) for r in requests]
    for item, request in zip(first, requests, strict=True):
        quoted = item.question.removeprefix("Which passage says: ").removesuffix("?").split()
        assert quoted and all(word in request.chunk.text for word in quoted)
        assert item.answer in request.chunk.text
    # Different ordinals of a long enough chunk ask different questions.
    questions = {i.question for i in first if i.chunk_id == "b-0"}
    assert len(questions) > 1


def test_relevant_chunks_are_the_source_then_chunks_holding_the_answer_verbatim() -> None:
    [item] = LocalGenerator().generate([ItemRequest(CHUNKS[0], 0)])
    assert item.answer == "Rivers carve valleys over thousands of years."
    assert relevant_chunks(item, CHUNKS) == ["b-0"]
    shared = GeneratedItem("a-0", 1, "q", "Meltwater carries it far downstream.")
    assert relevant_chunks(shared, CHUNKS) == ["a-0", "a-1"]


def test_outcome_of_one_item() -> None:
    assert outcome(0, ["x"], ["y", "x", "z"]) == {
        "seq": 0, "hit": True, "rank": 2, "recall": 1.0, "retrieved_chunk_ids": ["y", "x", "z"],
    }  # fmt: skip
    assert outcome(1, ["x", "w"], ["x"])["recall"] == 0.5
    assert outcome(2, ["x"], ["y"]) | {"retrieved_chunk_ids": []} == {
        "seq": 2, "hit": False, "rank": None, "recall": 0.0, "retrieved_chunk_ids": [],
    }  # fmt: skip


def test_load_generator_refuses_what_is_not_a_generator() -> None:
    assert isinstance(load_generator("local"), LocalGenerator)
    with pytest.raises(ValueError, match="not an ItemGenerator"):
        load_generator("domains.evaluation.generation:QUESTIONS_PER_CHUNK")
    for spec in ("domains.evaluation.generation:Chunk", "no_such_module:x", "nonsense"):
        with pytest.raises(ValueError, match="DTASK_EVAL_GENERATOR="):
            load_generator(spec)
