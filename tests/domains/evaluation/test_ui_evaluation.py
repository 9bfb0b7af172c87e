"""The evaluation domain's dashboard pages (domains/evaluation/routes_ui.py) against the real app, database
and Redis, with test_ui.py's signed-in clients: datasets and runs with their states, metrics and
links to their tasks, items and outcomes paged, owner rules, escaping and the CSRF-guarded resume.

Datasets and runs reach their states the way workers move them (tests/evaluation_states.py: real
tasks and claims, the store's fenced writes, the tasks' terminal hooks); no Milvus or S3 is needed.
"""

from __future__ import annotations

import re
import statistics
import time
from typing import Any

import httpx
import pytest
import test_ui
from sqlalchemy import text

from domains.evaluation.tasks import GENERATE
from tasks_core.model import Status
from tasks_core.services import build_services
from tests.conftest import make_settings
from tests.domains.knowledge.test_ui_knowledge import NO_STORES, csrf_on
from tests.evaluation_states import (
    completed_dataset,
    evaluate,
    finish,
    generate,
    new_dataset,
    new_run,
)
from tests.knowledge_states import new_base

# The dashboard tests' fixtures: ``browser`` and ``app`` run on this module's ``svc``.
app, browser = test_ui.app, test_ui.browser

DATASET_ROW = re.compile(r'<tr data-dataset="([0-9a-f]{32})" data-status="(\w+)">(.*?)</tr>', re.S)
RUN_ROW = re.compile(r'<tr data-run="([0-9a-f]{32})" data-status="(\w+)">(.*?)</tr>', re.S)
ITEM = re.compile(r'<tr data-item="(\d+)">')
OUTCOME = re.compile(r'<tr data-outcome="(\d+)" data-hit="(yes|no)">')
NEXT = re.compile(r'href="/ui/evaluation/(?:datasets|runs)/[0-9a-f]{32}\?([^"]*)" rel="next"')


@pytest.fixture
async def svc(clean_db: None) -> Any:
    # No Milvus or S3: nothing on these pages needs them.
    services = build_services(make_settings(api_keys=test_ui.KEYS, **NO_STORES), pool_size=5)
    yield services
    await services.close()


async def table(svc: Any, name: str) -> dict[str, dict[str, Any]]:
    async with svc.engine.connect() as conn:
        return {r["id"]: dict(r) for r in (await conn.execute(text(f"SELECT * FROM {name}"))).mappings()}


def shown(pattern: re.Pattern[str], page: httpx.Response) -> dict[str, tuple[str, str]]:
    return {rid: (status, html) for rid, status, html in pattern.findall(page.text)}


async def seeded(svc: Any) -> dict[str, Any]:
    """Alice: a dataset generating (3 of 10), one completed (4), one failed (2 of 6, resumable);
    a completed run of the completed dataset (ranks 1, 2, miss, 1) and a running one (1 of 4).
    Bob: a base with a generating dataset."""
    base = await new_base(svc, "alice", "manuals")
    generating, g_task = await new_dataset(svc, base, "alice", 10)
    await generate(svc, generating, g_task, 3)
    done, d_task = await completed_dataset(svc, base, "alice", 4)
    failed, f_task = await new_dataset(svc, base, "alice", 6)
    await finish(svc, f_task, await generate(svc, failed, f_task, 2), Status.FAILED, "RuntimeError: boom")
    run, r_task = await new_run(svc, done, base, "alice", 4, top_k=3)
    await finish(svc, r_task, await evaluate(svc, run, r_task, [1, 2, None, 1]), Status.SUCCESS)
    running, rr_task = await new_run(svc, done, base, "alice", 4, top_k=5)
    await evaluate(svc, running, rr_task, [1])
    bobs = await new_base(svc, "bob", "bob-notes")
    bob_ds, _ = await new_dataset(svc, bobs, "bob", 5)
    return {
        "base": base,
        "datasets": {
            "generating": (generating, g_task),
            "completed": (done, d_task),
            "failed": (failed, f_task),
        },
        "runs": {"completed": (run, r_task), "running": (running, rr_task)},
        "bob": bob_ds,
    }


# ------------------------------------------------------------------ tests


async def test_every_evaluation_page_needs_a_session(browser: Any) -> None:
    client = await browser()
    some = "0" * 32
    for path in (
        "/ui/evaluation",
        "/ui/evaluation/runs",
        "/ui/evaluation/fragments/datasets",
        "/ui/evaluation/fragments/runs",
        f"/ui/evaluation/datasets/{some}",
        f"/ui/evaluation/datasets/{some}/live",
        f"/ui/evaluation/runs/{some}",
        f"/ui/evaluation/runs/{some}/live",
    ):
        r = await client.get(path)
        assert r.status_code == 303 and r.headers["location"].startswith(
            "/ui/sign-in?next=%2Fui%2Fevaluation"
        )
        r = await client.get(path, headers={"HX-Request": "true"})
        assert (r.status_code, r.headers["hx-redirect"]) == (401, "/ui/sign-in")
    assert (
        await client.post(f"/ui/evaluation/datasets/{some}/resume", data={"csrf": "x"})
    ).status_code == 401


async def test_datasets_and_runs_show_their_states_metrics_and_tasks(svc: Any, browser: Any) -> None:
    s = await seeded(svc)
    alice = await browser("alice")
    page = await alice.get("/ui/evaluation")
    assert page.status_code == 200
    assert '<a href="/ui/evaluation" aria-current="page">Evaluation</a>' in page.text  # the nav entry
    datasets, truth = shown(DATASET_ROW, page), await table(svc, "evaluation_datasets")
    assert set(datasets) == {d for d, _ in s["datasets"].values()}  # not bob's
    for name, (dataset_id, task_id) in s["datasets"].items():
        status, html = datasets[dataset_id]
        row = truth[dataset_id]
        assert status == row["status"] == name
        assert f"{row['item_count']} / {row['target']}" in html
        assert (
            f'<a href="/ui/tasks/{task_id}"' in html
            and f'href="/ui/evaluation/datasets/{dataset_id}"' in html
        )
        task_status = (await svc.repo.get(task_id))["status"]
        assert f'class="status s-{task_status}">{task_status}<' in html  # the task's own state
    failed_html = datasets[s["datasets"]["failed"][0]][1]
    assert truth[s["datasets"]["failed"][0]]["error_message"] in failed_html  # why it stopped
    assert "RuntimeError: boom" in failed_html

    runs_page = await alice.get("/ui/evaluation/runs")
    assert '<a href="/ui/evaluation" aria-current="page">Evaluation</a>' in runs_page.text
    assert 'hx-get="/ui/evaluation/fragments/runs?"' in runs_page.text  # the table refreshes itself
    runs, run_truth = shown(RUN_ROW, runs_page), await table(svc, "evaluation_runs")
    assert set(runs) == {r for r, _ in s["runs"].values()}
    done_id, done_task = s["runs"]["completed"]
    status, html = runs[done_id]
    m = run_truth[done_id]["metrics"]
    assert status == "completed" and (m["hit_rate"], m["recall"], m["mrr"]) == (0.75, 0.75, 0.625)
    for key in ("hit_rate", "recall", "mrr"):
        assert f'data-metric="{key}">{m[key]:.3f}<' in html
    assert f'<a href="/ui/tasks/{done_task}"' in html and "4 / 4" in html
    running_id, running_task = s["runs"]["running"]
    status, html = runs[running_id]
    assert status == "running" and "1 / 4" in html and 'data-metric="mrr">\u2013<' in html
    assert f'<a href="/ui/tasks/{running_task}"' in html

    # A generating dataset's page polls its state; the fragment shows what PostgreSQL says now.
    gen_id, gen_task = s["datasets"]["generating"]
    ds = await alice.get(f"/ui/evaluation/datasets/{gen_id}")
    assert ds.status_code == 200 and f'hx-get="/ui/evaluation/datasets/{gen_id}/live"' in ds.text
    assert 'data-items="3"' in ds.text and len(ITEM.findall(ds.text)) == 3
    assert ">Resume</button>" not in ds.text  # its task is active
    # The task page the link leads to is this key's.
    task_page = await alice.get(f"/ui/tasks/{gen_task}")
    assert task_page.status_code == 200 and GENERATE in task_page.text
    done_ds = await alice.get(f"/ui/evaluation/datasets/{s['datasets']['completed'][0]}")
    assert "/live" not in done_ds.text  # nothing left to poll
    assert set(shown(RUN_ROW, done_ds)) == {done_id, running_id}  # its runs

    # A run's page: metrics, outcomes in order, polling only while running.
    run_page = await alice.get(f"/ui/evaluation/runs/{done_id}")
    assert run_page.status_code == 200 and f"/ui/evaluation/runs/{done_id}/live" not in run_page.text
    assert OUTCOME.findall(run_page.text) == [("0", "yes"), ("1", "yes"), ("2", "no"), ("3", "yes")]
    assert "<dt>hit@3</dt>" in run_page.text and 'data-metric="mrr">0.625<' in run_page.text
    live = await alice.get(f"/ui/evaluation/runs/{running_id}")
    assert f'hx-get="/ui/evaluation/runs/{running_id}/live"' in live.text and 'data-done="1"' in live.text
    assert "1 of 4 items" in live.text


async def test_another_key_sees_none_of_it_and_admin_sees_all(svc: Any, browser: Any) -> None:
    s = await seeded(svc)
    bob = await browser("bob")
    listing = await bob.get("/ui/evaluation")
    assert set(shown(DATASET_ROW, listing)) == {s["bob"]}
    assert not shown(RUN_ROW, await bob.get("/ui/evaluation/runs"))
    assert "manuals" not in listing.text and "<th>Owner</th>" not in listing.text
    failed_id, _ = s["datasets"]["failed"]
    for path in (
        f"/ui/evaluation/datasets/{failed_id}",
        f"/ui/evaluation/datasets/{failed_id}/live",
        f"/ui/evaluation/runs/{s['runs']['completed'][0]}",
        f"/ui/evaluation/runs/{s['runs']['running'][0]}/live",
        "/ui/evaluation/datasets/not-an-id",
        "/ui/evaluation/runs/" + "f" * 32,
    ):
        r = await bob.get(path)
        assert r.status_code == 404 and "RuntimeError" not in r.text, path
    # Bob's valid token on alice's failed dataset: 404, nothing resumed.
    before, tasks = await table(svc, "evaluation_datasets"), await table(svc, "tasks")
    r = await bob.post(
        f"/ui/evaluation/datasets/{failed_id}/resume", data={"csrf": await csrf_on(bob, "/ui/evaluation")}
    )
    assert r.status_code == 404
    assert await table(svc, "evaluation_datasets") == before and await table(svc, "tasks") == tasks

    root = await browser("root")
    everything = await root.get("/ui/evaluation")
    assert len(shown(DATASET_ROW, everything)) == 4
    assert len(shown(RUN_ROW, await root.get("/ui/evaluation/runs"))) == 2
    assert "<th>Owner</th>" in everything.text and "<td>bob</td>" in everything.text
    page = await root.get(f"/ui/evaluation/datasets/{failed_id}")
    assert page.status_code == 200 and "<dt>Owner</dt><dd>alice</dd>" in page.text


async def test_hostile_names_questions_and_errors_are_escaped(svc: Any, browser: Any) -> None:
    base = await new_base(svc, "alice", "<script>alert('base')</script>")
    dataset_id, task_id = await new_dataset(svc, base, "alice", 3)
    token = await generate(svc, dataset_id, task_id, 1, questions=('"><img src=x onerror=alert(1)>',))
    await finish(svc, task_id, token, Status.FAILED, "<iframe src=javascript:alert(2)>")
    alice = await browser("alice")
    for path in ("/ui/evaluation", f"/ui/evaluation/datasets/{dataset_id}"):
        page = (await alice.get(path)).text
        assert "<script>alert" not in page and "&lt;script&gt;alert(&#39;base&#39;)&lt;/script&gt;" in page
        assert "<iframe" not in page and "&lt;iframe src=javascript:alert(2)&gt;" in page
    page = (await alice.get(f"/ui/evaluation/datasets/{dataset_id}")).text
    assert "<img src=x" not in page and "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;" in page


async def test_items_and_outcomes_are_paged_in_order(svc: Any, browser: Any) -> None:
    base = await new_base(svc, "alice", "big")
    dataset_id, _ = await completed_dataset(svc, base, "alice", 120)
    run_id, run_task = await new_run(svc, dataset_id, base, "alice", 120)
    await evaluate(svc, run_id, run_task, [1 + i % 3 if i % 4 else None for i in range(120)])
    alice = await browser("alice")
    for path, pattern in (
        (f"/ui/evaluation/datasets/{dataset_id}", ITEM),
        (f"/ui/evaluation/runs/{run_id}", OUTCOME),
    ):
        seen: list[str] = []
        query, pages = "", 0
        while True:
            page = await alice.get(f"{path}?{query}")
            assert page.status_code == 200
            seen += [m if isinstance(m, str) else m[0] for m in pattern.findall(page.text)]
            pages += 1
            more = NEXT.search(page.text)
            if more is None:
                break
            query = more[1].replace("&amp;", "&")
        assert pages == 3 and seen == [str(i) for i in range(120)], path
        assert len(pattern.findall((await alice.get(f"{path}?limit=200")).text)) == 120
        assert len(pattern.findall((await alice.get(f"{path}?limit=7")).text)) == 50  # offered sizes only
        assert len(pattern.findall((await alice.get(f"{path}?cursor=100")).text)) == 19
        for bad in ("cursor=-1", "cursor=%3Cx%3E", "cursor=1e3", "cursor=99999999999"):
            assert (await alice.get(f"{path}?{bad}")).status_code == 400, bad


async def test_dataset_and_run_lists_are_paged_newest_first(svc: Any, browser: Any) -> None:
    base = await new_base(svc, "alice", "big")
    dataset_id, _ = await completed_dataset(svc, base, "alice", 1)
    async with svc.engine.begin() as conn:  # 119 more of each, every other one failed
        await conn.execute(
            text(
                """INSERT INTO evaluation_datasets (id, owner, base_id, target, status, created_at)
                SELECT md5('d' || i), 'alice', :kb, 5, (ARRAY['generating', 'failed'])[1 + i % 2],
                       clock_timestamp() - make_interval(secs => i)
                FROM generate_series(1, 119) AS i"""
            ),
            {"kb": base},
        )
        await conn.execute(
            text(
                """INSERT INTO evaluation_runs (id, owner, dataset_id, base_id, top_k, status, items_total,
                     created_at)
                SELECT md5('r' || i), 'alice', :ds, :kb, 5, (ARRAY['running', 'failed'])[1 + i % 2], 1,
                       clock_timestamp() - make_interval(secs => i)
                FROM generate_series(1, 120) AS i"""
            ),
            {"kb": base, "ds": dataset_id},
        )
    alice = await browser("alice")
    for path, pattern, name in (
        ("/ui/evaluation", DATASET_ROW, "evaluation_datasets"),
        ("/ui/evaluation/runs", RUN_ROW, "evaluation_runs"),
    ):
        seen: list[str] = []
        query, pages = "", 0
        while True:
            page = await alice.get(f"{path}?{query}")
            assert page.status_code == 200
            seen += list(shown(pattern, page))
            pages += 1
            older = re.search(r'href="' + path + r'\?([^"]*)" rel="next"', page.text)
            if older is None:
                break
            query = older[1].replace("&amp;", "&")
        assert pages == 3 and len(seen) == len(set(seen)) == 120, path
        async with svc.engine.connect() as conn:
            newest_first = await conn.execute(
                text(f"SELECT id FROM {name} ORDER BY created_at DESC, id DESC")
            )
            assert seen == [r[0] for r in newest_first], path
        failed = shown(pattern, await alice.get(f"{path}?status=failed&limit=200"))
        truth = {i for i, r in (await table(svc, name)).items() if r["status"] == "failed"}
        assert set(failed) == truth and {st for st, _ in failed.values()} == {"failed"}, path
        for bad in ("status=exploded", "cursor=not-a-cursor", "cursor=%3Cx%3E"):
            assert (await alice.get(f"{path}?{bad}")).status_code == 400, (path, bad)


async def test_resume_form_needs_its_token_and_hands_the_dataset_to_one_new_task(
    svc: Any, browser: Any
) -> None:
    base = await new_base(svc, "alice", "manuals")
    dataset_id, old_task = await new_dataset(svc, base, "alice", 6)
    await finish(svc, old_task, await generate(svc, dataset_id, old_task, 2), Status.CANCELLED, "")
    alice, bob = await browser("alice"), await browser("bob")
    path = f"/ui/evaluation/datasets/{dataset_id}"
    assert ">Resume</button>" in (await alice.get(path)).text
    right, bobs = await csrf_on(alice, path), await csrf_on(bob, "/ui/evaluation")
    before = await table(svc, "evaluation_datasets")
    for data, headers in (
        ({}, {}),
        ({"csrf": "0" * 64}, {}),
        ({"csrf": bobs}, {}),  # another session's token
        ({"csrf": right}, {"Sec-Fetch-Site": "cross-site"}),
    ):
        r = await alice.post(f"{path}/resume", data=data, headers=headers)
        assert r.status_code == 403 and "expired" in r.text, (data, headers)
    assert await table(svc, "evaluation_datasets") == before

    r = await alice.post(f"{path}/resume", data={"csrf": right})
    assert (r.status_code, r.headers["location"]) == (303, f"{path}?notice=resumed")
    row = (await table(svc, "evaluation_datasets"))[dataset_id]
    new_task = row["task_id"]
    assert new_task != old_task and (row["status"], row["item_count"], row["error_message"]) == (
        "generating",
        2,
        None,
    )
    task = await svc.repo.get(new_task)
    assert (task["task_type"], task["status"], task["payload"]) == (
        GENERATE,
        "pending",
        {"dataset_id": dataset_id},
    )
    page = await alice.get(r.headers["location"])
    assert "Resume submitted" in page.text and f'href="/ui/tasks/{new_task}"' in page.text
    assert ">Resume</button>" not in page.text and f"{path}/live" in page.text  # generating again: polled
    # Once more while that task is pending: the API's one-at-a-time rule, no second task.
    r = await alice.post(f"{path}/resume", data={"csrf": right})
    assert r.headers["location"] == f"{path}?notice=active"
    async with svc.engine.connect() as conn:
        count = "SELECT count(*) FROM tasks WHERE task_type = :t"
        assert (await conn.execute(text(count), {"t": GENERATE})).scalar() == 2  # the old one and the new


async def test_hundreds_of_datasets_and_runs_render(svc: Any, browser: Any, record_property: Any) -> None:
    base = await new_base(svc, "alice", "big")
    dataset_id, _ = await completed_dataset(svc, base, "alice", 500)
    run_id, run_task = await new_run(svc, dataset_id, base, "alice", 500)
    await finish(
        svc, run_task, await evaluate(svc, run_id, run_task, [1 + i % 4 for i in range(500)]), Status.SUCCESS
    )
    async with svc.engine.begin() as conn:  # 300 more datasets and runs in two statements
        await conn.execute(
            text(
                """INSERT INTO evaluation_datasets (id, owner, base_id, target, item_count, status,
                     error_message)
                SELECT md5('d' || i), 'alice', :kb, 10, i % 10,
                       (ARRAY['generating', 'failed', 'cancelled'])[1 + i % 3],
                       CASE WHEN i % 3 = 1 THEN 'stopped at ' || i END
                FROM generate_series(1, 300) AS i"""
            ),
            {"kb": base},
        )
        await conn.execute(
            text(
                """INSERT INTO evaluation_runs (id, owner, dataset_id, base_id, top_k, status, items_total,
                     items_done, metrics)
                SELECT md5('r' || i), 'alice', :ds, :kb, 5, 'completed', 500, 500,
                       jsonb_build_object('hit_rate', 0.9, 'recall', 0.8, 'mrr', 0.7)
                FROM generate_series(1, 300) AS i"""
            ),
            {"kb": base, "ds": dataset_id},
        )
    alice = await browser("alice")

    async def timed(path: str, n: int = 5) -> tuple[float, httpx.Response]:
        took = []
        for _ in range(n):
            started = time.perf_counter()
            r = await alice.get(path)
            took.append(time.perf_counter() - started)
            assert r.status_code == 200, r.text
        return statistics.median(took) * 1000, r

    figures = {}
    figures["datasets page, 200 newest of 301"], listing = await timed("/ui/evaluation?limit=200")
    assert len(shown(DATASET_ROW, listing)) == 200 and "<b>301</b> datasets" in listing.text
    figures["datasets fragment (the 2 s poll), 50"], _ = await timed("/ui/evaluation/fragments/datasets")
    figures["runs page, 200 newest of 301"], listing = await timed("/ui/evaluation/runs?limit=200")
    assert len(shown(RUN_ROW, listing)) == 200 and "<b>301</b> runs" in listing.text
    figures["dataset page (200 runs, 50 items)"], ds = await timed(f"/ui/evaluation/datasets/{dataset_id}")
    assert len(ITEM.findall(ds.text)) == 50
    figures["dataset page, 200 items from #300"], ds = await timed(
        f"/ui/evaluation/datasets/{dataset_id}?cursor=299&limit=200"
    )
    assert ITEM.findall(ds.text)[0] == "300" and len(ITEM.findall(ds.text)) == 200
    figures["run page, 200 outcomes"], rp = await timed(f"/ui/evaluation/runs/{run_id}?limit=200")
    assert len(OUTCOME.findall(rp.text)) == 200
    print("\nevaluation pages; median render times (ms):")
    for name, ms in figures.items():
        print(f"  {name:42s} {ms:7.1f}")
        record_property(name, round(ms, 1))


@pytest.mark.parametrize("status", ["failed", "cancelled"])
async def test_the_dataset_page_says_why_a_dataset_stopped(svc: Any, browser: Any, status: str) -> None:
    base = await new_base(svc, "alice", "manuals")
    dataset_id, task_id = await new_dataset(svc, base, "alice", 6)
    await finish(
        svc, task_id, await generate(svc, dataset_id, task_id, 2), Status(status), "ValueError: no chunks"
    )
    row = (await table(svc, "evaluation_datasets"))[dataset_id]
    assert row["status"] == status
    page = await (await browser("alice")).get(f"/ui/evaluation/datasets/{dataset_id}")
    assert (
        f'data-status="{status}"' in page.text and f'<dd class="err">{row["error_message"]}</dd>' in page.text
    )
    assert "2 of 6 items" in page.text and ">Resume</button>" in page.text
