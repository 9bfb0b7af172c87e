"""The default entity extractor and the batch counts a graph build adds, on texts checked by hand."""

from __future__ import annotations

import pytest

from domains.graph.extraction import (
    GENERIC_WORDS,
    MAX_NAME_CHARS,
    MIN_CHUNKS,
    SMALL_BASE_CHUNKS,
    BatchCounts,
    CapitalisedTermExtractor,
    count_chunks,
    load_extractor,
    min_chunks,
)
from tests.graph_extractors import GateExtractor

extract = CapitalisedTermExtractor().extract


def test_runs_of_capitalised_words_are_names_with_their_inner_connectors() -> None:
    text = "We met Marie Curie at the University of Paris and saw Ludwig van Beethoven's piano."
    assert extract(text) == ["Marie Curie", "University of Paris", "Ludwig van Beethoven"]


def test_punctuation_between_words_ends_a_name_and_trailing_connectors_are_dropped() -> None:
    assert extract("She visited Paris, Berlin (Germany) and Bank of.") == [
        "Paris",
        "Berlin",
        "Germany",
        "Bank",
    ]


def test_a_lone_capitalised_word_opening_a_sentence_is_not_a_name_but_an_acronym_is() -> None:
    text = "Yesterday it rained. NASA called. Meanwhile Otto Hahn wrote.\nRadium\nOslo is cold."
    # "Yesterday", "Meanwhile", "Radium" (a heading line) and "Oslo" open their sentences alone.
    assert extract(text) == ["NASA", "Otto Hahn"]


def test_leading_stopwords_are_stripped_so_the_rest_counts_even_at_a_sentence_start() -> None:
    assert extract("The Eiffel Tower stands. The Louvre too. In Vienna it snowed.") == [
        "Eiffel Tower",
        "Louvre",
        "Vienna",
    ]


def test_possessives_and_typographic_apostrophes_belong_to_the_name() -> None:
    assert extract("Then Curie's notes and Bohr\u2019s model met Rutherford.") == [
        "Curie",
        "Bohr",
        "Rutherford",
    ]


def test_nothing_in_lower_case_text_or_numbers() -> None:
    assert extract("all lower case, 42 numbers and 3D shapes") == []
    assert extract("") == []


def test_extraction_is_deterministic() -> None:
    text = "Then Lise Meitner and Otto Hahn met Niels Bohr in Copenhagen. " * 20
    assert extract(text) == extract(text) and len(extract(text)) == 80


def test_batch_counts_mentions_chunks_and_undirected_edges_once_per_chunk() -> None:
    counts = count_chunks(
        CapitalisedTermExtractor(),
        [
            "Then Ada met Bob and Ada again, near Cyd.",  # Ada x2, Bob, Cyd
            "Then Bob met Ada.",  # Bob, Ada
            "Then Dee sat alone.",  # Dee
        ],
    )
    assert counts.mentions == {"Ada": 3, "Bob": 2, "Cyd": 1, "Dee": 1}
    assert counts.chunks == {"Ada": 2, "Bob": 2, "Cyd": 1, "Dee": 1}
    # Ada-Bob share two chunks; every pair appears once per chunk, smaller name first.
    assert counts.edges == {("Ada", "Bob"): 2, ("Ada", "Cyd"): 1, ("Bob", "Cyd"): 1}


def test_counts_of_two_batches_add_up_to_the_counts_of_one() -> None:
    texts = [f"Then Ann{i % 3} met Bea{i % 5} and Cal." for i in range(30)]
    whole = count_chunks(CapitalisedTermExtractor(), texts)
    parts = BatchCounts()
    for part in (texts[:11], texts[11:]):
        c = count_chunks(CapitalisedTermExtractor(), part)
        parts.mentions.update(c.mentions)
        parts.chunks.update(c.chunks)
        parts.edges.update(c.edges)
    assert (parts.mentions, parts.chunks, parts.edges) == (whole.mentions, whole.chunks, whole.edges)


def test_load_extractor_by_name_or_path_and_refuses_what_is_not_one() -> None:
    assert isinstance(load_extractor("capitalised"), CapitalisedTermExtractor)
    assert isinstance(load_extractor("tests.graph_extractors:GateExtractor"), GateExtractor)
    with pytest.raises(ValueError, match="not an entity extractor"):
        load_extractor("tests.graph_helpers:NAMES")
    with pytest.raises(ValueError):
        load_extractor("nonsense")


def test_names_no_database_column_can_hold_are_dropped_whatever_the_extractor() -> None:
    counts = BatchCounts()
    counts.add_chunk(["Ada", "", " Ada", "A\x00B", "X" * (MAX_NAME_CHARS + 1), "Y" * MAX_NAME_CHARS])
    assert counts.mentions == {"Ada": 1, "Y" * MAX_NAME_CHARS: 1}
    # The default extractor never produces one from a long capitalised run either.
    assert extract("Then " + "Abc " * 100 + "ended.") == []


# ------------------------------------------------------------------------------------------------ CJK


def test_chinese_people_places_and_works_are_names() -> None:
    text = "东晋王羲之的《兰亭序》被誉为天下第一行书。秦始皇统一六国后，在北方修长城抵御匈奴。"
    assert extract(text) == ["王羲之", "兰亭序", "秦始皇", "长城"]
    assert extract("二零零八年，京津城际铁路开通，北京到上海只要四个多小时。") == ["京津", "北京", "上海"]


def test_a_latin_run_and_a_cjk_run_are_never_one_name() -> None:
    assert extract("Owner统一定义了任务。") == []  # "Owner" opens the text, alone
    assert extract("字段由Owner统一定义。") == ["Owner"]
    # Latin names inside Chinese text, in the order they occur with the Chinese ones.
    assert extract("用 Python 写脚本，上传到 Amazon S3 的北京区域。") == ["Python", "Amazon S3", "北京"]


def test_tagger_noise_is_left_out() -> None:
    # Single characters, loanwords tagged as transliterated names, generic words tagged as names.
    assert extract("他在上海上班，把比特和令牌存进索引。") == ["上海"]
    # A function character fused onto the front of a place by the tagger is taken off.
    assert extract("纤夫在于长江边的码头上工作。") == ["长江"]


def test_generic_capitalised_words_are_not_names_but_names_containing_them_are() -> None:
    assert {"string", "document", "result", "null", "true", "none"} <= GENERIC_WORDS
    text = "We return a String. The Result is NULL, None or True. Then Document Object Model loads."
    assert extract(text) == ["Document Object Model"]


def test_a_short_form_beside_exactly_one_full_name_counts_as_it() -> None:
    text = "Install the AWS CLI. Then the CLI uploads to Amazon S3, and S3 keeps it."
    assert extract(text) == ["AWS CLI", "AWS CLI", "Amazon S3", "Amazon S3"]
    # Two full names it could stand for: it stays as written.
    assert extract("Then AWS CLI and Azure CLI differ; the CLI is yours.") == ["AWS CLI", "Azure CLI", "CLI"]
    # Per text: alone in its chunk, the short form is its own name.
    assert extract("Then the CLI uploads.") == ["CLI"]


def test_an_entity_needs_two_chunks_only_in_a_base_of_some_size() -> None:
    assert min_chunks(SMALL_BASE_CHUNKS - 1) == 1 and min_chunks(0) == 1
    assert min_chunks(SMALL_BASE_CHUNKS) == MIN_CHUNKS == min_chunks(10**6)


def test_the_default_extractor_name_says_its_output_changed() -> None:
    # A build records it; a build begun by the old extractor is not finished by this one.
    assert load_extractor("capitalised").name == "capitalised-v2"
