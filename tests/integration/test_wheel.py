"""The built wheel is the product (the image runs `pip install .`): it must carry every file the
api reads at run time, and the api installed from it alone must serve every domain's pages.

The wheel is built from this checkout and installed into a fresh venv outside it. The venv gets the
test environment's dependencies through a .pth line naming their site-packages (a .pth inside that
directory is not processed, so the checkout's editable install stays out), and every process is
started outside the checkout without PYTHONPATH, so `app`, `domains`, `tasks_core` and `migrations`
come from the wheel alone.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from tasks_core.domain import load_domains
from tasks_core.registry import import_path
from tasks_core.services import build_services
from tests.conftest import make_settings
from tests.graph_helpers import make_base
from tests.live_api import api_process

ROOT = Path(__file__).resolve().parents[2]
# What the image's build stage copies before `pip install .`.
SOURCES = ("pyproject.toml", "README.md", "celeryconfig.py", "tasks_core", "app", "domains", "migrations")
SECRET = "alice-secret-0123456"
KEYS = f"alice:{SECRET}"
# Settings that would point the api at the checkout or at stores: not for this api.
DROPPED = ("PYTHONPATH", "DTASK_MILVUS_URI", "DTASK_MINIO_ENDPOINT", "DTASK_MINIO_ACCESS_KEY",
           "DTASK_MINIO_SECRET_KEY")


def _run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, f"{cmd}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DROPPED}
    return {**env, **extra}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from what docker/Dockerfile copies, in a directory of its own: a build in the checkout
    would reuse the files an earlier build left in build/ and *.egg-info, and hide a lost one."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    _run(sys.executable, "-m", "pip", "wheel", source, "--no-deps", "-q", "-w", out, cwd=out)
    (built,) = out.glob("durable_tasks-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path) -> Iterator[Path]:
    # Not under pytest's tmp_path: that may be inside the checkout's tree on some setups.
    with tempfile.TemporaryDirectory(prefix="dtask-wheel-") as where:
        home = Path(where) / "venv"
        _run(sys.executable, "-m", "venv", "--without-pip", home, cwd=Path(where))
        python = home / "bin" / "python"
        site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                         cwd=Path(where)).strip())
        (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q",
             wheel, cwd=Path(where))
        yield home


def _checkout_files(directory: Path) -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_the_wheel_carries_every_domains_templates_and_migrations_and_the_apis_files(wheel: Path) -> None:
    inside = set(zipfile.ZipFile(wheel).namelist())
    ui = ROOT / "app" / "ui"
    wanted = _checkout_files(ui / "templates") | _checkout_files(ui / "static")
    wanted |= {"migrations/script.py.mako", "migrations/env.py"}
    wanted |= _checkout_files(ROOT / "migrations" / "versions")
    for domain in load_domains():
        shipped = (domain.templates, domain.migrations, domain.root / "static", domain.root / "prompts")
        for directory in shipped:
            if directory is not None and directory.is_dir():
                wanted |= _checkout_files(directory)
    missing = sorted(wanted - inside)
    assert not missing, f"not in {wheel.name}: {missing}"


def test_the_venv_sees_the_wheel_not_the_checkout(venv: Path) -> None:
    code = "import app, domains, migrations, tasks_core; print(app.__file__, domains.__file__, " \
           "migrations.__file__, tasks_core.__file__)"
    found = _run(venv / "bin" / "python", "-c", code, cwd=venv, env=_clean_env()).split()
    assert len(found) == 4 and all(Path(f).is_relative_to(venv) for f in found), found


def _cookies(response: httpx.Response) -> dict[str, str]:
    found = {}
    for header in response.headers.get_list("set-cookie"):
        name, _, rest = header.partition("=")
        found[name.strip()] = rest.split(";", 1)[0]
    return found


async def _sign_in(client: httpx.AsyncClient) -> dict[str, str]:
    """The session cookie, as a header: the cookies are Secure, so a client over plain http would
    not send them back by itself."""
    form = await client.get("/ui/sign-in")
    token = re.search(r'name="token" value="([^"]+)"', form.text)
    assert form.status_code == 200 and token, form.text
    jar = _cookies(form)
    r = await client.post(
        "/ui/sign-in",
        data={"key": SECRET, "token": token[1], "next": "/ui"},
        headers={"Cookie": "; ".join(f"{k}={v}" for k, v in jar.items())},
    )
    assert r.status_code == 303, r.text
    session = _cookies(r)
    assert session.get("dtask_ui"), r.headers
    return {"Cookie": f"dtask_ui={session['dtask_ui']}"}


async def _objects() -> dict[str, str]:
    """One object of each kind a domain page is about, alice's: a knowledge base (which the graph
    pages show too), an evaluation dataset and a run of it."""
    svc = build_services(make_settings(), pool_size=1)
    try:
        base_id, _ = await make_base(svc, [["Then Ada met Bob near Cyd."]])
        dataset_id, run_id = uuid.uuid4().hex, uuid.uuid4().hex
        async with svc.engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO evaluation_datasets (id, owner, base_id, target)"
                    " VALUES (:id, 'alice', :b, 5)"
                ),
                {"id": dataset_id, "b": base_id},
            )
            await conn.execute(
                text(
                    """INSERT INTO evaluation_runs (id, owner, dataset_id, base_id, top_k, items_total)
                    VALUES (:id, 'alice', :d, :b, 3, 0)"""
                ),
                {"id": run_id, "d": dataset_id, "b": base_id},
            )
    finally:
        await svc.close()
    return {"base_id": base_id, "dataset_id": dataset_id, "run_id": run_id}


def _pages(ids: dict[str, str]) -> list[str]:
    """Every GET page of every domain's dashboard extension, its path parameters filled in."""
    pages = []
    for domain in load_domains():
        if domain.ui is None:
            continue
        for route in import_path(domain.ui).router.routes:
            if "GET" not in getattr(route, "methods", ()):
                continue
            path: str = route.path
            names = re.findall(r"{(\w+)}", path)
            assert set(names) <= set(ids), f"{domain.name}: no object for {path}"
            pages.append(path.format(**ids))
    return pages


@pytest.fixture
def api_from_wheel(venv: Path, clean_db: None) -> Iterator[str]:
    with tempfile.TemporaryFile() as log:
        with api_process(dtask=[venv / "bin" / "dtask"], cwd=venv, environ=_clean_env(DTASK_API_KEYS=KEYS),
                         start_seconds=60, log=log) as (url, _):
            yield url
        log.seek(0)
        output = log.read().decode(errors="replace")
    assert "TemplateNotFound" not in output and "Traceback" not in output, output[-4000:]


async def test_the_api_installed_from_the_wheel_renders_every_domains_pages(api_from_wheel: str) -> None:
    ids = await _objects()
    pages = _pages(ids)
    assert {"/ui/knowledge", "/ui/evaluation", "/ui/graph"} <= set(pages), pages
    answers = {}
    async with httpx.AsyncClient(base_url=api_from_wheel, timeout=10) as client:
        cookie = await _sign_in(client)
        for page in ["/ui", *pages]:
            r = await client.get(page, headers=cookie)
            answers[page] = (r.status_code, r.headers.get("content-type", "").split(";")[0])
    wrong = {page: answer for page, answer in answers.items() if answer != (200, "text/html")}
    assert not wrong, wrong
