"""The fault campaign's seeded schedule and task mix, and the command's exit code when it cannot run."""

from __future__ import annotations

from typer.testing import CliRunner

from tasks_core.chaos import faults as F


def test_the_same_seed_gives_the_same_schedule_and_workload() -> None:
    assert F.build_schedule(42, 75, 4) == F.build_schedule(42, 75, 4)
    assert F.build_workload(42, 50) == F.build_workload(42, 50)
    assert F.build_schedule(42, 75, 4) != F.build_schedule(43, 75, 4)
    assert F.build_workload(42, 50) != F.build_workload(43, 50)


def test_every_fault_kind_happens_and_every_pause_outlasts_the_lease() -> None:
    for seed in range(30):
        schedule = F.build_schedule(seed, 75, 4)
        kinds = [e.kind for e in schedule]
        for kind, n in F.MINIMUM.items():
            assert kinds.count(kind) >= n, (seed, kinds)
        assert all(e.duration > 4 for e in schedule if e.kind == F.PAUSE), schedule
        # The last pause ends inside the fault phase; times only grow.
        assert all(e.at + e.duration <= 75 for e in schedule if e.kind == F.PAUSE), schedule
        assert [e.at for e in schedule] == sorted(e.at for e in schedule)
        assert all(0 <= e.pick < 1 and 0 <= e.amount < 1 for e in schedule)


def test_a_short_phase_still_gets_every_guaranteed_fault() -> None:
    kinds = [e.kind for e in F.build_schedule(1, 12, 4)]
    assert sorted(kinds) == sorted(k for k, n in F.MINIMUM.items() for _ in range(n))


def test_the_workload_mixes_every_kind_of_task() -> None:
    plans = F.build_workload(7, 400)
    types = {p.task_type for p in plans}
    assert types == {
        "diagnostics.sleep", "diagnostics.sleep_retry_safe", "diagnostics.noop", "diagnostics.fail"
    }
    keyed = [p for p in plans if p.dedupe_key]
    assert 0 < len(keyed) < len(plans) and len({(p.task_type, p.dedupe_key) for p in keyed}) < len(keyed)
    assert all(p.payload.get("effects") for p in plans if p.task_type.startswith("diagnostics.sleep"))


def test_chaos_exits_2_when_the_campaign_cannot_run(tmp_path: object) -> None:
    import typer

    from tasks_core.chaos.cli import chaos_command

    app = typer.Typer()
    app.command()(chaos_command)
    # Nothing listens on port 1: creating the temporary database fails before any process starts.
    result = CliRunner().invoke(
        app, ["--seed", "5", "--tasks", "1", "--duration", "10",
              "--admin-url", "postgresql+asyncpg://postgres@127.0.0.1:1/postgres"],
    )
    assert result.exit_code == 2, result.output
    assert "could not run (seed 5)" in result.output and "set-up failed" in result.output, result.output
