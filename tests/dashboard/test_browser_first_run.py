"""A newcomer's first page in Chromium (Playwright) against `kiln up` (embedded worker, SQLite): the empty jobs
page shows the first-run card (the default base, the sample dataset to download, the command that trains on it)
at 1280x800 and 390x844 without horizontal scrolling; the sample downloads; the API docs fit a phone; once a
job exists the card is gone."""

import json

import pytest

from controlplane.services import ROOT

from .browser import DESKTOP, PHONE, chromium_browser, no_horizontal_scroll, open_page, served, shot, sign_in

pytestmark = pytest.mark.slow

SAMPLE = ROOT / "static" / "samples" / "arithmetic.jsonl"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with served(tmp_path_factory, "kiln-first-run-home") as running:
        yield running


def test_the_empty_jobs_page_shows_a_first_run_that_fits(stack):
    with chromium_browser() as browser:
        page = open_page(browser, DESKTOP)
        sign_in(page, stack)
        card = page.wait_for_selector("[data-first-run]")
        text = card.inner_text()
        assert "kiln-tiny" in text  # the default base of a test stack (KILN_DEFAULT_BASE=kiln-tiny)
        assert "kiln train sft --file arithmetic.jsonl --adapter first-admin --auto-load --wait" in text
        assert "kiln token create --user admin" in text
        link = page.get_attribute("[data-first-run] a[download]", "href")
        sample = page.request.get(stack.url + link)
        assert sample.status == 200 and sample.body() == SAMPLE.read_bytes()
        assert all("prompt" in json.loads(line) for line in sample.text().splitlines())
        for size_name, size in (("desktop", DESKTOP), ("phone", PHONE)):
            page.set_viewport_size(size)
            page.goto(stack.url + "/")
            page.wait_for_selector("[data-first-run]")
            shot(page, f"first-run-{size_name}")
            no_horizontal_scroll(page)
        # the API reference on a phone (mobile layout: without a viewport line Chromium lays a page out 980 px
        # wide and shrinks it), signed in by the session's cookie
        phone = browser.new_context(viewport=PHONE, is_mobile=True, has_touch=True,
                                    storage_state=page.context.storage_state())
        docs = phone.new_page()
        docs.goto(stack.url + "/v1/docs")
        docs.wait_for_selector(".swagger-ui .info")
        shot(docs, "api-docs-phone")
        assert docs.evaluate("window.innerWidth") == PHONE["width"]
        no_horizontal_scroll(docs)
        phone.close()

        stack.client.submit_sft({"data": [{"prompt": "q", "completion": " a"}],
                                 "config": {"output_name": "first-run-gone", "epochs": 1}})
        page.goto(stack.url + "/")
        page.wait_for_selector("[data-jobs-table] tr[data-job]")
        assert page.locator("[data-first-run]").count() == 0
        assert page.errors == []
