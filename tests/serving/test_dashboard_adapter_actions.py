"""Load, activate, unload and delete adapters from the dashboard, through the same actions as the API."""

import pytest
from django.test import Client

from kiln_web.adapters.models import Adapter
from kiln_web.serving import runtime
from kiln_web.serving.models import ServedAdapter

pytestmark = pytest.mark.django_db(transaction=True)


def browser(user):
    client = Client()
    client.force_login(user)
    return client


def test_lifecycle_buttons(ada, api, publish, settings, adapter_name):
    publish(adapter_name, seed=1)
    api.get("/v1/adapters")  # the adapter row exists once someone lists or acts on it
    api.post(f"/v1/adapters/{adapter_name}/load")
    api.post(f"/v1/adapters/{adapter_name}/unload")
    page = browser(ada)
    detail = page.get(f"/adapters/{adapter_name}/").content.decode()
    assert "Load</button>" in detail and "Delete files</button>" in detail

    response = page.post(f"/adapters/{adapter_name}/load/", follow=True)
    assert response.status_code == 200 and "it is served when a request names it" in response.content.decode()
    assert ServedAdapter.objects.filter(adapter__name=adapter_name).exists()
    assert "Activate</button>" in response.content.decode()

    refused = page.post(f"/adapters/{adapter_name}/delete/", follow=True).content.decode()
    assert "Deleted" not in refused and (settings.KILN_ADAPTERS_DIR / adapter_name).is_dir()

    page.post(f"/adapters/{adapter_name}/activate/")
    assert runtime.serving().loaded_here() and ServedAdapter.objects.get(adapter__name=adapter_name).active
    page.post(f"/adapters/{adapter_name}/unload/")
    assert not ServedAdapter.objects.filter(adapter__name=adapter_name).exists()

    deleted = page.post(f"/adapters/{adapter_name}/delete/", follow=True).content.decode()
    assert "Deleted the checkpoints and PEFT snapshot" in deleted
    assert not (settings.KILN_ADAPTERS_DIR / adapter_name).exists()
    assert Adapter.objects.filter(name=adapter_name).exists()  # the history its jobs refer to stays


def test_someone_elses_adapter_and_unknown_actions(ada, bob, api, publish, adapter_name):
    publish(adapter_name)
    api.post(f"/v1/adapters/{adapter_name}/load")
    theirs = browser(bob)
    response = theirs.post(f"/adapters/{adapter_name}/unload/", follow=True)
    assert ServedAdapter.objects.filter(adapter__name=adapter_name).exists()
    assert browser(ada).post(f"/adapters/{adapter_name}/explode/").status_code == 404
    assert Client().post(f"/adapters/{adapter_name}/unload/").status_code == 302  # sign-in first
    assert response.status_code in (200, 404)
