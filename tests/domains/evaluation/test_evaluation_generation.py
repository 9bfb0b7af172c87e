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


def test_the_plan_takes_ordinal_0_of_every_chunk_then_ordinal_1_in_the_same_order() -> None:
    requests = list(plan(CHUNKS, 2))
    ids = [r.chunk.chunk_id for r in requests]
    assert [r.ordinal for r in requests] == [0, 0, 0, 1, 1, 1]
    assert sorted(ids[:3]) == ["a-0", "a-1", "b-0"] and ids[3:] == ids[:3]
    assert list(plan(list(reversed(CHUNKS)), 2)) == requests  # the input order does not matter
    assert list(plan(CHUNKS, 2)) == requests  # nor the call: the same plan in every attempt
    assert capacity(len(CHUNKS), LocalGenerator.per_chunk) == 3 * LocalGenerator.per_chunk


def _base(files: int, chunks_per_file: int) -> list[Chunk]:
    return [
        Chunk(f"{f:02d}-{s}", f"text of file {f} part {s}.")
        for f in range(files)
        for s in range(chunks_per_file)
    ]


def test_the_plan_deals_one_chunk_of_every_file_before_a_second_of_any() -> None:
    chunks = _base(files=30, chunks_per_file=5)
    first = [r.chunk for r in plan(chunks, 1)]
    assert len({c.source for c in first[:30]}) == 30  # 30 items: 30 files, not the first 6
    assert len({c.source for c in first[30:60]}) == 30
    # Files and chunks in a seeded order, not by id: the sample is not the files' first chunks.
    assert [c.source for c in first[:30]] != sorted(c.source for c in first[:30])
    assert {c.chunk_id.rsplit("-", 1)[1] for c in first[:30]} != {"0"}
    # Files of different sizes: each gives one per round while it has chunks left.
    uneven = [c for c in chunks if int(c.chunk_id[:2]) % 3 or c.chunk_id.endswith("-0")]
    dealt = [r.chunk for r in plan(uneven, 1)]
    assert len(dealt) == len(uneven) == len(set(dealt))
    assert len({c.source for c in dealt[:30]}) == 30
    # Another seed, another sample, also spread over every file.
    other = [r.chunk for r in plan(chunks, 1, seed="x")]
    assert other != first and len({c.source for c in other[:30]}) == 30


def test_a_chunk_names_its_file_or_takes_it_from_its_id() -> None:
    assert Chunk("f1-0", "t").source == "f1" and Chunk("a-b-12", "t").source == "a-b"
    assert Chunk("x-1", "t", file_id="f9").source == "f9"


def test_the_local_generator_is_deterministic_and_asks_with_its_chunks_terms() -> None:
    requests = list(plan(CHUNKS, LocalGenerator.per_chunk))
    first, again = LocalGenerator().generate(requests), LocalGenerator().generate(requests)
    assert first == again
    assert [(i.chunk_id, i.ordinal) for i in first] == [(r.chunk.chunk_id, r.ordinal) for r in requests]
    for item, request in zip(first, requests, strict=True):
        terms = item.question.removeprefix("Which passage mentions ").removesuffix("?").split(", ")
        assert terms and all(term in request.chunk.text for term in terms)
        assert item.answer in request.chunk.text
        assert " ".join(terms) not in request.chunk.text or len(terms) == 1  # terms, not a verbatim copy
    # Different ordinals of a chunk of several sentences ask different questions.
    questions = {i.question for i in first if i.chunk_id == "b-0"}
    assert len(questions) > 1


def test_the_local_generator_asks_chinese_questions_of_chinese_text() -> None:
    chunk = Chunk("zh-0", "工作进程在执行期间必须定期续约。租约过期后，任务会被重新放回队列。")
    items = LocalGenerator().generate([ItemRequest(chunk, k) for k in range(LocalGenerator.per_chunk)])
    assert items[0].question == "哪段文字讲到工作、进程、执行、期间、必须、定期？"
    assert items[0].answer == "工作进程在执行期间必须定期续约。"
    assert items[1].answer == "租约过期后，任务会被重新放回队列。" and "租约" in items[1].question
    for item in items:
        terms = item.question.removeprefix("哪段文字讲到").removesuffix("？").split("、")
        assert all(len(t) >= 2 and t in chunk.text for t in terms)


def test_relevant_chunks_are_the_source_then_chunks_holding_the_answer_verbatim() -> None:
    [item] = LocalGenerator().generate([ItemRequest(CHUNKS[0], 0)])
    assert item.answer == "Rivers carve valleys over thousands of years."
    assert item.question == "Which passage mentions Rivers, carve, valleys, thousands, years, Floods?"
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
    # A class is instantiated, even one whose class attributes already look like a generator.
    assert isinstance(load_generator("tests.evaluation_generators:GateGenerator"), LocalGenerator)
    with pytest.raises(ValueError, match="not an ItemGenerator"):
        load_generator("domains.evaluation.generation:QUESTIONS_PER_CHUNK")
    for spec in ("domains.evaluation.generation:Chunk", "no_such_module:x", "nonsense"):
        with pytest.raises(ValueError, match="DTASK_EVAL_GENERATOR="):
            load_generator(spec)
