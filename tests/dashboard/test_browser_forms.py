"""The new-job form and a finished job's page in Chromium (Playwright) against `kiln up` (embedded worker, SQLite,
the real trainer on kiln-tiny), as a newcomer uses them:

- an upload with "Auto load: yes" is submitted (auto_load was once taken for a second data source and refused
  as "Give one data source, not both"), trains and is promoted, the page following without a reload;
- a refused form opens on a summary that links each field, names the file to choose again (a browser empties
  a file input) and fits a phone;
- with JavaScript off, the pages say they are not live instead of "connecting" forever, and the charts say
  how many steps they hold instead of "Waiting for the first committed step";
- with JavaScript off, deleting an adapter's files still asks first;
- the job and adapter pages fit 320 px (a small phone, or 1280 px at 400 % zoom) without sideways scrolling.
"""

import json
import re

import pytest

from .browser import DESKTOP, PHONE, chromium_browser, no_horizontal_scroll, open_page, served, sign_in

pytestmark = pytest.mark.slow

RECORDS = [{"prompt": f"Say {word}.", "completion": f" {word.upper()}!"} for word in ("kiln", "clay", "glaze")]
NARROW = {"width": 320, "height": 640}
TIMEOUT_MS = 120_000  # a wait for the worker (training, the serving canary) on a 2-core CI machine


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with served(tmp_path_factory, "kiln-forms-home") as running:  # the embedded worker is enough
        yield running


@pytest.fixture(scope="module")
def chromium(stack):
    with chromium_browser() as browser:
        yield browser


def test_an_auto_load_upload_trains_and_pages_are_honest_without_javascript(stack, chromium, tmp_path):
    dataset = tmp_path / "greetings.jsonl"
    dataset.write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    page = open_page(chromium, DESKTOP)
    sign_in(page, stack, "/jobs/new/sft/")
    page.wait_for_selector("[data-job-form]")

    # a refusal: the form comes back without the file and says so, next to the upload
    page.fill("input[name=output_name]", "auto bot")
    page.set_input_files("input[name=data]", str(dataset))
    page.click("button:has-text('Submit job')")
    page.wait_for_selector("[data-field=output_name] .field-error")
    assert "no spaces" in page.inner_text("[data-field=output_name] .field-error")
    # said at the top, where the page opens (focused), with a link to the field
    assert page.evaluate("'errorSummary' in document.activeElement.dataset")
    page.click("[data-error-summary] a[href='#id_output_name']")
    assert page.evaluate("document.activeElement.name") == "output_name"
    assert "Choose greetings.jsonl again" in page.inner_text("[data-field=data] [data-choose-again]")
    assert page.input_value("input[name=data]") == ""
    page.set_viewport_size(PHONE)
    no_horizontal_scroll(page)
    page.set_viewport_size(DESKTOP)

    # auto_load with an upload: submitted, trained, promoted by the canary, shown without a reload
    page.fill("input[name=output_name]", "auto-bot")
    page.fill("input[name=epochs]", "2")
    page.select_option("select[name=auto_load]", "true")
    page.set_input_files("input[name=data]", str(dataset))
    page.click("button:has-text('Submit job')")
    page.wait_for_url(re.compile(r"/jobs/[0-9a-f-]{36}/$"))
    job_path = page.url.removeprefix(stack.url)
    page.evaluate("window.__sameDocument = true")
    page.wait_for_selector("[data-promotion=promoted]", timeout=TIMEOUT_MS)
    assert page.evaluate("window.__sameDocument") is True
    assert page.get_attribute("[data-trained]", "data-trained") == "yes"
    job = stack.client.job(job_path.strip("/").rsplit("/", 1)[1])
    assert job["status"] == "succeeded" and job["promotion"]["auto_load"] is True, job["promotion"]
    assert page.inner_text("[data-live-indicator]") == "live"
    assert not page.errors, page.errors

    # 320 px: the effective configuration's long names and the snapshot's badge wrap instead of widening the page
    narrow = chromium.new_context(viewport=NARROW, storage_state=page.context.storage_state())
    small = narrow.new_page()
    for path in (job_path, "/adapters/auto-bot/"):
        small.goto(stack.url + path)
        small.wait_for_selector("h1")
        no_horizontal_scroll(small)
    narrow.close()

    # JavaScript off: no "connecting" that never connects, no "waiting" for steps that were committed
    still = chromium.new_context(viewport=DESKTOP, java_script_enabled=False,
                                 storage_state=page.context.storage_state())
    static = still.new_page()
    for path in ("/", job_path):
        static.goto(stack.url + path)
        assert not static.is_visible("[data-live-indicator]"), path
        assert "not live (JavaScript is off)" in static.inner_text("[data-no-script]"), path
    assert static.inner_text("[data-chart=loss] [data-plot]") == "6 committed steps; the chart is drawn by JavaScript."

    # ... and deleting an adapter's files asks first (a confirm() dialog did, which needs JavaScript)
    static.goto(stack.url + "/adapters/auto-bot/")
    static.click("button:has-text('Unload')")
    static.wait_for_selector("text=Unloaded auto-bot.")
    snapshot = stack.home / "adapters" / "auto-bot"
    static.click("[data-delete]")  # opens the confirmation only
    assert static.is_visible("[data-delete-confirm]") and snapshot.is_dir()
    static.click("[data-delete-confirm]")
    static.wait_for_selector("text=Deleted the checkpoints and PEFT snapshot of auto-bot.")
    assert not snapshot.exists()
    still.close()
    page.context.close()
