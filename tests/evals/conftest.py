"""Evaluation and promotion fixtures: those of the serving tests."""

from serving.conftest import (ApiClient, ada, adapter_name, api, bob, fresh_pool, make_user,  # noqa: F401
                              publish, publishing_runner)
