"""`dtask chaos`: run a fault campaign and report every invariant (exit 1 on any violation, or when no
late write was rejected, i.e. fencing was not exercised; 2 when the campaign itself could not run).

Wire it into the `dtask` app with ``cli.command("chaos")(chaos_command)``; ``python -m
tasks_core.devkit.chaos.cli`` runs the same command on its own.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Annotated

import typer

from tasks_core.devkit.chaos import faults as F
from tasks_core.devkit.rabbitmq import DEFAULT_URL as DEFAULT_RABBITMQ_URL
from tasks_core.devkit.rabbitmq import is_amqp

# The heartbeat renews every lease/3, so a running task has between 2/3 of a lease and a lease left
# when PostgreSQL goes down; with 6 s that is 4-6 s, more than a 1-3 s restart plus the workers'
# 1 s retry gap, and the restart promise is tested on nearly every task it catches.
OWN_POSTGRES_LEASE = 6.0


def chaos_command(
    seed: Annotated[
        int | None, typer.Option(help="seed of the fault schedule and the task mix (default: random)")
    ] = None,
    workers: Annotated[int, typer.Option(min=2, help="celery worker processes")] = 3,
    tasks: Annotated[int, typer.Option(min=1, help="diagnostics tasks to submit")] = 400,
    duration: Annotated[float, typer.Option(min=10, help="seconds of faults")] = 90.0,
    capacity: Annotated[int, typer.Option(min=1, help="DTASK_CAPACITY of the cluster")] = 4,
    concurrency: Annotated[
        int | None, typer.Option(min=1, help="pool processes per worker (default: capacity + 2)")
    ] = None,
    lease: Annotated[
        float | None,
        typer.Option(min=1, help=f"DTASK_LEASE_SECONDS (default 4; {OWN_POSTGRES_LEASE:g} with "
                     "--own-postgres, so that a 1-3 s restart fits inside a lease)"),
    ] = None,
    reconcile: Annotated[float, typer.Option(min=0.2, help="DTASK_RECONCILE_SECONDS")] = 1.0,
    publish: Annotated[float, typer.Option(min=0.2, help="DTASK_PUBLISH_SECONDS")] = 2.0,
    margin: Annotated[float, typer.Option(min=0, help="slack added to every time bound")] = 5.0,
    skew: Annotated[
        float, typer.Option(help="wall-clock skew of one worker in seconds, via libfaketime (0: none)")
    ] = -3600.0,
    without: Annotated[
        list[str] | None,
        typer.Option("--without",
                     help="leave a fault kind out (repeatable): " + ", ".join((*F.ALL_KINDS, F.RABBITMQ))),
    ] = None,
    own_postgres: Annotated[
        bool,
        typer.Option(
            "--own-postgres",
            help="start an embedded PostgreSQL of the campaign's own and add its faults: "
            + ", ".join(F.PG_KINDS),
        ),
    ] = False,
    broker: Annotated[
        str,
        typer.Option(help="redis (an embedded Redis of the campaign's own), rabbitmq (a vhost of its own on "
                     f"{DEFAULT_RABBITMQ_URL}) or the amqp:// URL of a local RabbitMQ; on RabbitMQ "
                     f"the broker fault is {F.RABBITMQ} (the vhost's permissions and connections, "
                     "never a server restart)"),
    ] = "redis",
    admin_url: Annotated[
        str | None, typer.Option(help="PostgreSQL server for the temporary database (default: local)")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="write the full result as JSON here")] = None,
    keep: Annotated[bool, typer.Option("--keep", help="keep the temporary database and the logs")] = False,
) -> None:
    """Fault campaign: real workers, beat, Redis and PostgreSQL under seeded faults; checks I1-I7
    (and, with --own-postgres, that a short PostgreSQL restart ends no running task)."""
    import logging

    from tasks_core.devkit.chaos.campaign import CampaignConfig, CampaignError, run_campaign

    # The campaign's own publishes fail while Redis is down: say so in one line, not a traceback.
    logging.basicConfig(level=logging.WARNING, format="[chaos] %(name)s: %(message)s")

    known = (*F.ALL_KINDS, F.RABBITMQ)
    unknown = sorted(set(without or ()) - set(known))
    if unknown:
        typer.echo(f"unknown fault kind(s) {', '.join(unknown)}; known: {', '.join(known)}", err=True)
        raise typer.Exit(2)
    if broker not in ("redis", "rabbitmq") and not is_amqp(broker):
        typer.echo(f"--broker takes redis, rabbitmq or an amqp:// URL, not {broker!r}", err=True)
        raise typer.Exit(2)
    if own_postgres and admin_url:
        typer.echo("--own-postgres starts its own server: it takes no --admin-url", err=True)
        raise typer.Exit(2)
    cfg = CampaignConfig(
        seed=seed if seed is not None else random.SystemRandom().randrange(1, 2**31),
        workers=workers, tasks=tasks, fault_seconds=duration, capacity=capacity, concurrency=concurrency,
        lease_seconds=lease or (OWN_POSTGRES_LEASE if own_postgres else 4.0),
        reconcile_seconds=reconcile, publish_seconds=publish, margin_seconds=margin,
        skew_seconds=skew, admin_url=admin_url, keep=keep, exclude=tuple(without or ()),
        own_postgres=own_postgres, broker=broker,
    )
    try:
        result = asyncio.run(run_campaign(cfg, out=lambda line: typer.echo(line)))
    except CampaignError as exc:
        typer.echo(f"chaos: the campaign could not run (seed {cfg.seed}): {exc}", err=True)
        raise typer.Exit(2) from exc
    if out is not None:
        out.write_text(json.dumps(result.to_json(), indent=2))
    typer.echo("")
    typer.echo(f"seed {cfg.seed} · {result.submitted} tasks · {len(result.faults)} fault log entries · "
               f"{result.seconds:.0f} s")
    typer.echo(result.report.table())
    for note in result.notes:
        typer.echo(f"note: {note}")
    if not result.ok:
        typer.echo(f"replay: {cfg.replay_command()}")
    raise typer.Exit(0 if result.ok else 1)


if __name__ == "__main__":
    typer.run(chaos_command)
