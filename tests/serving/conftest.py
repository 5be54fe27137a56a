"""Serving fixtures: the control plane's users and clients, a fresh serving pool per test, published
kiln-tiny adapters, and the fake SFT runner that publishes a final adapter."""

import pytest

from controlplane.conftest import ApiClient, ada, adapter_name, api, bob, make_user  # noqa: F401 (fixtures)
from kiln_web.serving import runtime

from .helpers import publish_adapter

PUBLISHING_RUNNER = "serving.publishing_sft"


@pytest.fixture(autouse=True)
def fresh_pool():
    """Each test starts and ends without this process's serving pool (it is created from the settings)."""
    runtime.close_serving()
    yield
    runtime.close_serving()


@pytest.fixture
def publish(settings):
    """publish(name, seed=0): a kiln-tiny PEFT snapshot in the adapter registry."""
    def publish_one(name: str, seed: int = 0) -> dict:
        return publish_adapter(settings.KILN_HOME, settings.KILN_ADAPTERS_DIR, name, seed=seed)

    return publish_one


@pytest.fixture
def publishing_runner(settings):
    settings.KILN_SFT_RUNNER = PUBLISHING_RUNNER
    settings.KILN_HEARTBEAT_SECONDS = 3600  # no heartbeat thread touches the test database
    settings.KILN_EMBEDDED_WORKER = True
    return settings
