"""The fault campaign's seeded schedule and task mix, and the command's exit code when it cannot run."""

from __future__ import annotations

from typer.testing import CliRunner

from tasks_core.devkit.chaos import faults as F


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


# build_schedule(42, 30, 4) as it was before the PostgreSQL faults existed: replaying an old seed
# without --own-postgres must give exactly the faults it gave then.
SEED_42_30S = [
    F.FaultEvent(2.556, "pause_worker", 6.102, 0.3084763442185984, 0.006974859968382985),
    F.FaultEvent(5.111, "pause_claimer", 14.333, 0.06308283255595726, 0.05309501412225737),
    F.FaultEvent(7.667, "kill_worker", 0.442, 0.2718931356419446, 0.9144997392585918),
    F.FaultEvent(10.222, "redis_restart", 2.005, 0.22278857007500885, 0.6262758901149016),
    F.FaultEvent(12.778, "pause_worker", 5.215, 0.12219892260330312, 0.11813218884236609),
    F.FaultEvent(15.333, "cancel", 0.0, 0.32646125244325097, 0.839126922307093),
    F.FaultEvent(17.889, "pg_terminate", 0.0, 0.1599916060092873, 0.134767995389802),
    F.FaultEvent(20.444, "duplicate_publish", 0.0, 0.357659589744058, 0.6445621339104766),
]


def test_old_seeds_keep_their_schedules_without_own_postgres() -> None:
    assert F.build_schedule(42, 30, 4) == SEED_42_30S
    assert F.build_schedule(42, 30, 4, own_postgres=False) == SEED_42_30S
    for seed in range(50):
        kinds = {e.kind for e in F.build_schedule(seed, 90, 4)}
        assert not kinds & set(F.PG_KINDS), (seed, kinds)


def test_postgres_faults_come_only_with_own_postgres_and_leave_the_others_drawn_as_before() -> None:
    for seed in range(50):
        for seconds in (12, 60, 75, 90, 200):
            plain = F.build_schedule(seed, seconds, 4)
            owned = F.build_schedule(seed, seconds, 4, own_postgres=True)
            assert owned == F.build_schedule(seed, seconds, 4, own_postgres=True)  # pure
            pg = [e for e in owned if e.kind in F.PG_KINDS]
            for kind, n in F.PG_MINIMUM.items():
                assert sum(e.kind == kind for e in pg) >= n, (seed, seconds, owned)
            assert len(pg) == sum(F.PG_MINIMUM.values()) + int(seconds // F.PG_EXTRA_EVERY)
            # Every other fault keeps its kind, order and draws; only its instant moves later.
            others = [e for e in owned if e.kind not in F.PG_KINDS]
            assert [(e.kind, e.duration, e.pick, e.amount) for e in others] == [
                (e.kind, e.duration, e.pick, e.amount) for e in plain
            ]
            assert all(o.at >= p.at for o, p in zip(others, plain, strict=True))
            assert [e.at for e in owned] == sorted(e.at for e in owned)
            assert owned[0].kind not in F.PG_KINDS


def test_postgres_faults_have_their_lengths_and_overlap_no_other_fault() -> None:
    lease = 4.0
    for seed in range(50):
        owned = F.build_schedule(seed, 75, lease, own_postgres=True)
        for i, event in enumerate(owned):
            if event.kind == F.PG_PAUSE:
                assert lease + 1 <= event.duration <= lease + 3, event  # past the lease: it must lapse
            if event.kind == F.PG_RESTART:
                assert F.PG_RESTART_DOWN[0] <= event.duration <= F.PG_RESTART_DOWN[1], event
            if event.kind not in F.PG_KINDS:
                continue
            # Paused workers have resumed and killed ones are restarting before the database goes
            # down, and the next fault waits until it is back.
            assert all(e.at + e.duration + F.PG_SETTLE_SECONDS <= event.at + 0.002
                       for e in owned[:i] if e.kind in (F.PAUSE, F.KILL)), event
            if i + 1 < len(owned):
                assert owned[i + 1].at >= event.at + event.duration + F.PG_SETTLE_SECONDS - 0.002
        last = owned[-1].at
        assert F.phase_seconds(owned, 75, lease) == max(75, last + lease + 3)
        assert F.phase_seconds(F.build_schedule(seed, 75, lease), 75, lease) == 75


def test_excluding_a_postgres_fault_keeps_the_rest() -> None:
    owned = F.build_schedule(3, 75, 4, own_postgres=True)
    without = F.build_schedule(3, 75, 4, own_postgres=True, exclude=(F.PG_PAUSE,))
    assert without == [e for e in owned if e.kind != F.PG_PAUSE]


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

    from tasks_core.devkit.chaos.cli import chaos_command

    app = typer.Typer()
    app.command()(chaos_command)
    # Nothing listens on port 1: creating the temporary database fails before any process starts.
    result = CliRunner().invoke(
        app, ["--seed", "5", "--tasks", "1", "--duration", "10",
              "--admin-url", "postgresql+asyncpg://postgres@127.0.0.1:1/postgres"],
    )
    assert result.exit_code == 2, result.output
    assert "could not run (seed 5)" in result.output and "set-up failed" in result.output, result.output


def test_own_postgres_takes_no_admin_url_and_new_kinds_are_known() -> None:
    import typer

    from tasks_core.devkit.chaos.cli import chaos_command

    app = typer.Typer()
    app.command()(chaos_command)
    both = CliRunner().invoke(app, ["--own-postgres", "--admin-url", "postgresql+asyncpg://x@127.0.0.1:1/p"])
    assert both.exit_code == 2 and "takes no --admin-url" in both.output, both.output
    unknown = CliRunner().invoke(app, ["--without", "pg_nap"])
    assert unknown.exit_code == 2 and "pg_restart" in unknown.output, unknown.output


def test_the_replay_command_names_own_postgres() -> None:
    from tasks_core.devkit.chaos.campaign import CampaignConfig

    assert "--own-postgres" in CampaignConfig(seed=9, own_postgres=True).replay_command()
    assert "--own-postgres" not in CampaignConfig(seed=9).replay_command()


def test_on_rabbitmq_the_broker_fault_is_the_vhost_outage_in_the_redis_restarts_place() -> None:
    from tasks_core.devkit.chaos.campaign import CampaignConfig

    on_redis = CampaignConfig(seed=21, fault_seconds=60).schedule()
    on_rabbitmq = CampaignConfig(seed=21, fault_seconds=60, broker="rabbitmq").schedule()
    assert any(e.kind == F.REDIS for e in on_redis)
    assert [(e.at, e.duration, e.kind) for e in on_rabbitmq] == [
        (e.at, e.duration, F.RABBITMQ if e.kind == F.REDIS else e.kind) for e in on_redis
    ]
    without = CampaignConfig(seed=21, fault_seconds=60, broker="rabbitmq", exclude=(F.RABBITMQ,)).schedule()
    assert [e for e in on_rabbitmq if e.kind != F.RABBITMQ] == without


def test_the_broker_option_takes_redis_rabbitmq_or_a_url_and_the_replay_names_it() -> None:
    import typer

    from tasks_core.devkit.chaos.campaign import CampaignConfig
    from tasks_core.devkit.chaos.cli import chaos_command

    app = typer.Typer()
    app.command()(chaos_command)
    bad = CliRunner().invoke(app, ["--broker", "kafka://127.0.0.1"])
    assert bad.exit_code == 2 and "--broker takes redis, rabbitmq or an amqp:// URL" in bad.output, bad.output
    assert "--broker rabbitmq" in CampaignConfig(seed=9, broker="rabbitmq").replay_command()
    url = CampaignConfig(seed=9, broker="amqp://me:secret@127.0.0.1:5672/").replay_command()
    assert "--broker amqp://me:***@127.0.0.1:5672/" in url and "secret" not in url
    assert "--broker" not in CampaignConfig(seed=9).replay_command()
