"""One deployment for every fault test: `kiln up` and a separate Celery worker on a throwaway Redis and a
throwaway PostgreSQL cluster, with the adapter registry on a small tmpfs, in a temporary KILN_HOME; and the
final checkpoint bytes of one uninterrupted run, which every interrupted run must end with."""

import itertools
import shutil
import tempfile
from pathlib import Path

import pytest

from controlplane.services import sft_request

from private_services import PrivatePostgres, PrivateRedis

from .harness import FaultStack, SmallVolume, check_registry

EPOCHS = 40  # 160 steps of kiln-tiny, a checkpoint every 5: long enough to land a fault mid-run
REGISTRY_BYTES = 192 << 20
_names = itertools.count()


def request(adapter: str) -> dict:
    return sft_request(adapter, epochs=EPOCHS)


def adapter() -> str:
    return f"fault-{next(_names)}"


@pytest.fixture(scope="session")
def services(tmp_path_factory):
    """(redis, postgres or None and why, volume or None and why)."""
    try:
        redis = PrivateRedis(tmp_path_factory.mktemp("redis"))
    except RuntimeError as exc:
        pytest.skip(str(exc))
    postgres, postgres_missing = None, None
    try:
        postgres = PrivatePostgres()
    except (RuntimeError, OSError) as exc:
        postgres_missing = str(exc)
    home = Path(tempfile.mkdtemp(prefix="kiln-faults-home-"))
    volume, volume_missing = None, None
    try:
        volume = SmallVolume(home / "adapters", REGISTRY_BYTES)
    except (RuntimeError, OSError) as exc:
        volume_missing = str(exc)
    yield {"redis": redis, "postgres": postgres, "postgres_missing": postgres_missing, "home": home,
           "volume": volume, "volume_missing": volume_missing}
    redis.stop()
    if postgres is not None:
        postgres.destroy()
    if volume is not None:
        volume.unmount()
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def stack(services):
    env = {"DATABASE_URL": services["postgres"].url()} if services["postgres"] is not None else {}
    running = FaultStack(services["home"], redis_url=services["redis"].url(), **env)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def reference(stack) -> dict:
    """The final checkpoint's state files of an uninterrupted run of `request`."""
    from .harness import final_bytes

    job = stack.submit(request(adapter()))
    job = stack.wait(job["id"], lambda j: j["status"] in {"succeeded", "failed", "cancelled", "lost"})
    assert job["status"] == "succeeded", (job["error"], stack.worker.output[-3000:])
    assert job["progress"]["committed_step"] == EPOCHS * 4
    return final_bytes(stack, job)


@pytest.fixture(autouse=True)
def healthy_stack(request, services):
    """Each fault test starts with every service up, no earlier test's job active and the registry intact,
    and leaves them so."""
    if "stack" in request.fixturenames:
        request.getfixturevalue("stack").settle()
    yield
    if "stack" not in request.fixturenames:
        return
    stack = request.getfixturevalue("stack")
    if services["volume"] is not None:
        services["volume"].unfill()
    stack.ensure_running()
    check_registry(stack.registry)
