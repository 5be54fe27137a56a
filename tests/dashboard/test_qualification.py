"""The Qualification page and the jobs page's summary: the latest `kiln qualify` receipt per backend from
$KILN_HOME/qualification/latest-*.json (passed or failed, routes, envelope, created time)."""

import json
import re

import pytest

from trainer import qualify as qualification

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def real_receipt(tmp_path_factory) -> dict:
    """A receipt as `kiln qualify` writes it (the SFT route only, to keep it quick)."""
    output = tmp_path_factory.mktemp("receipt") / "latest-cpu.json"
    qualification.qualify(routes=["sft"], output=output, progress=lambda line: None)
    return json.loads(output.read_text())


@pytest.fixture
def home(settings, tmp_path):
    settings.KILN_HOME = tmp_path
    (tmp_path / "qualification").mkdir()
    return tmp_path / "qualification"


def text(response) -> str:
    return re.sub(r"\s+", " ", response.content.decode())


def section(page: str, backend: str) -> str:
    start = page.index(f'data-receipt="{backend}"')
    end = page.find("</section>", start)
    return page[start:end]


def test_the_page_needs_a_signed_in_user(client):
    response = client.get("/qualification/")
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")


def test_without_receipts_the_page_says_how_to_make_one(signed_in, home):
    page = text(signed_in.get("/qualification/"))
    assert "No qualification receipt yet" in page and "kiln qualify" in page
    jobs = text(signed_in.get("/"))
    assert "Qualification" in jobs and "no receipt yet" in jobs
    assert 'href="/qualification/"' in jobs  # the nav and the jobs-page summary link to it


def test_the_latest_receipt_per_backend_with_routes_envelope_and_time(signed_in, home, real_receipt):
    (home / "latest-cpu.json").write_text(json.dumps(real_receipt))
    (home / f"receipt-cpu-{real_receipt['created'].replace(':', '')}.json").write_text(json.dumps(real_receipt))
    failed = json.loads(json.dumps(real_receipt))
    failed.update(backend="cuda", passed=False, created="2031-02-03T04:05:06Z")
    failed["routes"][0].update(passed=False, mismatches=["resumed.checkpoint_files", "repeat.loss_history_sha256"])
    failed["envelope"]["execution"].update(backend="cuda", driver="565.57.01", runtime="cuda 12.8")
    (home / "latest-cuda.json").write_text(json.dumps(failed))
    (home / "latest-rocm.json").write_text("{not json")

    page = text(signed_in.get("/qualification/"))
    assert page.index('data-receipt="cpu"') < page.index('data-receipt="cuda"')
    cpu = section(page, "cpu")
    assert 'data-field="result">passed<' in cpu
    assert 'data-route="sft"' in cpu and "none" in cpu  # no mismatches
    assert real_receipt["created"][:10] in cpu and "1 stamped receipt beside it" in cpu
    execution = real_receipt["envelope"]["execution"]
    model = real_receipt["envelope"]["model"]
    for expected in (f"kiln-tiny (identity {model['identity'][:16]}", ">backend<", ">cpu<", ">precision<",
                     f">{execution['precision']}<", ">kernel contract<", execution["kernel_contract"],
                     ">native builds<", ">blas<", ">tokenizer.json<", ">chat template<"):
        assert expected in cpu, expected
    assert real_receipt["note"] in cpu
    # the worker-side identity reads as words, not JSON: BLAS with its threads, the CPU, the code digest
    blas = execution["blas"]
    assert f"{blas['library']} {blas['version']}" in cpu and f"{blas['threads']} threads" in cpu
    assert execution["device"]["machine"] in cpu and "{&quot;" not in cpu
    assert f"sha256 {execution['code']['sha256'][:16]}" in cpu
    assert ">libraries<" in cpu and f"tokenizers {execution['libraries']['tokenizers']}" in cpu

    cuda = section(page, "cuda")
    assert 'data-field="result">failed<' in cuda and "2031-02-03 04:05 UTC" in cuda
    assert "resumed.checkpoint_files" in cuda and "repeat.loss_history_sha256" in cuda
    assert ">driver<" in cuda and "565.57.01" in cuda and "cuda 12.8" in cuda

    rocm = section(page, "rocm")
    assert 'data-field="result">unreadable<' in rocm and "unreadable:" in rocm

    jobs = text(signed_in.get("/"))
    panel = jobs[jobs.index("data-qualification"):]
    panel = panel[:panel.index("</p>")]
    assert re.search(r'data-receipt="cpu">cpu <span class="badge ok">passed</span>', panel)
    assert re.search(r'data-receipt="cuda">cuda <span class="badge bad">failed</span>', panel)


def test_a_file_that_is_not_a_receipt_is_reported(signed_in, home):
    (home / "latest-cpu.json").write_text(json.dumps({"schema": "something.else", "passed": True}))
    cpu = section(text(signed_in.get("/qualification/")), "cpu")
    assert "not a kiln.qualification-receipt.v1 receipt" in cpu and ">passed<" not in cpu


def test_each_precisions_receipt_is_its_own_section_with_its_own_stamped_copies(signed_in, home, real_receipt):
    """`kiln qualify --precision bfloat16` writes latest-cpu-bfloat16.json and receipt-cpu-bfloat16-TIME.json: its own
    section, and its stamped copies are not counted beside float32's receipt (nor float32's beside it)."""
    stamp = real_receipt["created"].replace(":", "")
    bf16 = {**real_receipt, "precision": "bfloat16"}
    (home / "latest-cpu.json").write_text(json.dumps(real_receipt))
    (home / "latest-cpu-bfloat16.json").write_text(json.dumps(bf16))
    for name in (f"receipt-cpu-{stamp}.json", f"receipt-cpu-bfloat16-{stamp}.json",
                 "receipt-cpu-bfloat16-20311231T000000Z.json"):
        (home / name).write_text(json.dumps(real_receipt))
    page = text(signed_in.get("/qualification/"))
    assert "1 stamped receipt beside it" in section(page, "cpu")
    assert "2 stamped receipts beside it" in section(page, "cpu-bfloat16")
