"""PostgreSQL for the tests: the server `GPTOSS_MAX_TEST_PG` names, or one started here.

`.ci/run` always sets `GPTOSS_MAX_TEST_PG` (it installs PostgreSQL and starts a server); a
server it names that does not answer fails the tests. Without the variable, a throwaway
server is started from the installed PostgreSQL; without one installed the tests are
skipped, outside CI only (`CI` set: they fail).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from urllib.parse import urlsplit, urlunsplit

import pytest

import pg_server

PG_ENV = "GPTOSS_MAX_TEST_PG"


def _with_db(url: str, dbname: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{dbname}"))


@pytest.fixture(scope="session")
def pg_server_url():
    """A PostgreSQL server's URL (its `postgres` database), for the whole session."""
    import psycopg

    url = os.environ.get(PG_ENV)
    if url:
        try:
            psycopg.connect(url, connect_timeout=10).close()
        except psycopg.Error as exc:
            pytest.fail(f"{PG_ENV} names a PostgreSQL server that does not answer: {exc}")
        yield url
        return
    if pg_server.bindir() is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI without PostgreSQL: set {PG_ENV} (.ci/run does) or install postgresql")
        pytest.skip(f"no PostgreSQL here: set {PG_ENV} or install postgresql (.ci/run does both)")
    root = tempfile.mkdtemp(prefix="gptoss-pg-")
    try:
        yield pg_server.start(root)
    finally:
        pg_server.stop(root)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def pg_url(pg_server_url):
    """A fresh, empty database on that server, dropped afterwards."""
    import psycopg

    name = f"gptoss_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield _with_db(pg_server_url, name)
    with psycopg.connect(pg_server_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
