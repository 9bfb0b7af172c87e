"""docker/compose.yaml and docker/Dockerfile agree with the code: every app command is a real `dtask`
subcommand with real options, dependencies and health checks are wired, and only api and flower
publish ports. No Docker engine is needed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"
ENV_EXAMPLE = DOCKER / ".env.example"

EXPECTED_APP_COMMANDS = {"migrate", "api", "worker", "beat", "flower"}
HEALTHCHECKED = {"postgres", "redis", "minio", "milvus", "api", "worker", "worker-dense", "beat"}
MAY_PUBLISH_PORTS = {"api", "flower"}
# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR?err}
_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


@cache
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]  # type: ignore[no-any-return]


def app_services() -> dict[str, dict[str, Any]]:
    """Services that run this project's image (built from docker/Dockerfile)."""
    images = {s.get("image") for s in services().values() if "build" in s}
    assert images, "no service builds the app image"
    return {name: s for name, s in services().items() if "build" in s or s.get("image") in images}


@cache
def cli_commands() -> dict[str, Any]:
    from tasks_core.ops.cli import cli

    # Typer may vendor its own click, so duck-type the group rather than isinstance-check it.
    return dict(typer.main.get_command(cli).commands)  # type: ignore[attr-defined]


def with_defaults(value: str) -> str:
    """Interpolate like compose with an empty environment: defaults only."""
    return _VAR.sub(lambda m: m["arg"] if m["op"] in (":-", "-") else "", value)


def seconds(duration: str | int | float) -> float:
    if isinstance(duration, int | float):
        return float(duration)
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"bad duration {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def command_of(name: str) -> str:
    """The dtask subcommand a service runs (extra workers are named worker-<kind>)."""
    return name.split("-", 1)[0]


def test_required_services_exist() -> None:
    assert {"postgres", "redis", "milvus", "minio", *EXPECTED_APP_COMMANDS} <= set(services())
    assert {command_of(name) for name in app_services()} == EXPECTED_APP_COMMANDS


def test_the_cli_has_every_command_the_deployment_runs() -> None:
    # Fails until `dtask api` and `dtask flower` are wired into tasks_core/ops/cli.py.
    missing = EXPECTED_APP_COMMANDS - set(cli_commands())
    assert not missing, f"dtask lacks subcommands the deployment runs: {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(EXPECTED_APP_COMMANDS | {"worker-dense"}))
def test_app_service_command_is_a_real_dtask_invocation(name: str) -> None:
    service = app_services()[name]
    command = service.get("command")
    assert isinstance(command, list) and command, f"{name}: command must be an exec-form list"
    sub, *args = command
    assert sub == command_of(name), f"service {name} runs `dtask {sub}`"
    assert sub in cli_commands(), f"{name}: `dtask {sub}` does not exist"
    options = {opt for p in cli_commands()[sub].params for opt in p.opts if opt.startswith("-")}
    unknown = [a.split("=", 1)[0] for a in args if a.startswith("-") and a.split("=", 1)[0] not in options]
    assert not unknown, f"{name}: `dtask {sub}` has no option(s) {unknown}"


def test_every_dependency_exists_and_its_condition_can_be_met() -> None:
    all_services = services()
    for name, service in all_services.items():
        for target, condition in depends_on(service).items():
            assert target in all_services, f"{name} depends on unknown service {target}"
            if condition == "service_healthy":
                assert "healthcheck" in all_services[target], f"{name} waits for {target} healthy: no check"
            elif condition == "service_completed_successfully":
                assert all_services[target].get("restart", "no") == "no", f"{target} must be one-shot"
            else:
                assert condition == "service_started", f"{name}: unknown condition {condition}"


def test_migrate_runs_once_and_every_app_process_waits_for_it() -> None:
    migrate = services()["migrate"]
    assert migrate["command"] == ["migrate"]
    assert migrate.get("restart") == "no"
    assert depends_on(migrate).get("postgres") == "service_healthy"
    for name in EXPECTED_APP_COMMANDS - {"migrate"}:
        assert depends_on(services()[name]).get("migrate") == "service_completed_successfully", name


@pytest.mark.parametrize("name", sorted(HEALTHCHECKED))
def test_health_checks(name: str) -> None:
    check = services()[name].get("healthcheck") or {}
    assert not check.get("disable"), name
    assert check.get("test"), f"{name} has no health check"
    if name == "api":
        assert "/healthz" in " ".join(check["test"])
    if name == "milvus":
        assert ":9091/healthz" in " ".join(check["test"])


def test_only_api_and_flower_publish_ports() -> None:
    published = {name for name, s in services().items() if s.get("ports")}
    unexpected = sorted(published - MAY_PUBLISH_PORTS)
    assert not unexpected, f"unexpected published ports: {unexpected}"
    assert "api" in published
    for name, service in services().items():
        assert service.get("network_mode") != "host", f"{name} would expose every port on the host"


def test_app_environment_points_at_the_compose_services() -> None:
    for name, service in app_services().items():
        env = {k: with_defaults(str(v)) for k, v in service["environment"].items()}
        assert env["DTASK_DATABASE_URL"].startswith("postgresql+asyncpg://"), name
        assert "@postgres:5432/" in env["DTASK_DATABASE_URL"], name
        assert env["DTASK_BROKER_URL"].startswith("redis://:@redis:6379/"), name  # with its password
        assert env["DTASK_MILVUS_URI"] and env["DTASK_MINIO_ENDPOINT"].startswith("minio:"), name
        assert "DTASK_FLOWER_BASIC_AUTH" in service["environment"], name


def test_no_secret_has_a_default_and_ports_bind_loopback_by_default() -> None:
    text = COMPOSE.read_text()
    for name in ("POSTGRES_PASSWORD", "REDIS_PASSWORD", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD",
                 "DTASK_API_KEYS", "DTASK_FLOWER_BASIC_AUTH"):
        uses = [m for m in _VAR.finditer(text) if m["name"] == name]
        assert uses and all(m["op"] == ":?" for m in uses), f"{name} must be required (${{{name}:?...}})"
    assert "--requirepass" in services()["redis"]["command"]
    for name in MAY_PUBLISH_PORTS:
        for port in services()[name]["ports"]:
            bound = with_defaults(str(port))
            assert bound.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


def test_flower_listens_for_the_published_port_with_auth_from_the_environment() -> None:
    flower = services()["flower"]
    assert flower["command"][flower["command"].index("--address") + 1] == "0.0.0.0"
    # No default password baked into the compose file.
    assert with_defaults(str(flower["environment"]["DTASK_FLOWER_BASIC_AUTH"])) == ""


def test_worker_stop_grace_outlasts_the_shutdown_grace() -> None:
    worker = services()["worker"]
    stop = seconds(worker["stop_grace_period"])
    grace = float(with_defaults(str(worker["environment"]["DTASK_SHUTDOWN_GRACE_SECONDS"])))
    example = env_example().get("DTASK_SHUTDOWN_GRACE_SECONDS")
    # Margin for the terminal transaction, hooks and Celery's own shutdown after the grace ends.
    for value in filter(None, (grace, float(example) if example else None)):
        assert stop >= value + 10, f"stop_grace_period {stop}s does not outlast the grace {value}s"


def env_example() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def test_env_example_documents_every_variable_without_a_default() -> None:
    documented = set(env_example())
    for m in _VAR.finditer(COMPOSE.read_text()):
        if m["op"] not in (":-", "-"):
            assert m["name"] in documented, f"${{{m['name']}}} has no default and is not in .env.example"
    for secret in ("POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD", "DTASK_API_KEYS", "DTASK_FLOWER_BASIC_AUTH"):
        assert secret in documented, secret


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())  # join continuation lines
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


def test_dockerfile_runs_dtask_as_non_root_on_python_311_slim() -> None:
    instructions = dockerfile_instructions()
    froms = [arg for op, arg in instructions if op == "FROM"]
    assert froms and froms[-1].split()[0] == "python:3.11-slim"
    final_stage = instructions[max(i for i, (op, _) in enumerate(instructions) if op == "FROM"):]
    entry = [arg for op, arg in final_stage if op == "ENTRYPOINT"]
    assert entry, "no ENTRYPOINT in the final stage"
    assert json.loads(entry[-1]) == ["dtask"]  # exec form: dtask is PID 1's child of tini, gets SIGTERM
    users = [arg for op, arg in final_stage if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must not run as root"
    assert any(op == "RUN" and "pip install" in arg for op, arg in instructions)


def test_compose_file_is_valid_for_docker_compose(tmp_path: Path) -> None:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("docker CLI not installed")
    probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        reason = (probe.stderr or probe.stdout).strip().splitlines()[:1]
        pytest.skip(f"docker compose plugin not installed ({' '.join(reason)})")
    # `config` only parses and interpolates; it needs no engine. The example env stands in for .env.
    done = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE), "--env-file", str(ENV_EXAMPLE), "config", "-q"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr


def test_the_rabbitmq_override_moves_every_app_process_to_rabbitmq() -> None:
    override = yaml.safe_load((DOCKER / "compose.rabbitmq.yaml").read_text())
    rabbit = override["services"]["rabbitmq"]
    assert rabbit["healthcheck"]["test"] and not rabbit.get("ports")
    for name in ("api", "worker", "beat", "flower"):
        service = override["services"][name]
        assert service["environment"]["DTASK_BROKER_URL"].startswith("amqp://dtask:${RABBITMQ_PASSWORD:?")
        assert service["depends_on"]["rabbitmq"]["condition"] == "service_healthy"
    assert set(override["services"]) - {"rabbitmq"} <= set(services())  # overrides, nothing new


def test_the_examples_placeholders_are_refused_at_start_up() -> None:
    """Copying docker/.env.example without setting real secrets must not start a deployment."""
    from pydantic import ValidationError

    from tasks_core.settings import Settings

    example = env_example()
    api = services()["api"]["environment"]
    for var in ("DTASK_API_KEYS", "DTASK_FLOWER_BASIC_AUTH", "DTASK_MINIO_SECRET_KEY"):
        # What compose gives the app for this setting, with the example's values filled in.
        value = _VAR.sub(lambda m: example.get(m["name"], ""), str(api[var]))
        with pytest.raises(ValidationError, match="placeholder"):
            Settings(_env_file=None, **{var.removeprefix("DTASK_").lower(): value})  # type: ignore[call-arg]
