"""The dashboard (/ui) in a real headless Chromium (Debian's chromium, driven by playwright) through the whole
stack: the pages load with tenant A's key, a running fine-tune's loss curve grows, cancel works, and tenant B's
objects are absent. With XPUJOBS_UI_SCREENSHOTS=<dir> it saves the main pages there (docs/screenshots)."""

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import KEY_A, _wait, wait_for_job
from test_fine_tune_e2e import training_jsonl

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    executable = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    assert executable, "install Debian's chromium (apt-get install chromium); .ci/run does"
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, api_url):
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    page.goto(api_url + "/ui")
    page.fill("#key", KEY_A)
    page.click("#key-form button")
    yield page
    context.close()


def shoot(page, name: str, tmp_path: Path):
    target = Path(os.environ.get("XPUJOBS_UI_SCREENSHOTS") or tmp_path)
    target.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(target / f"{name}.png"), full_page=True)


def curve_points(page) -> int:
    locator = page.locator('#loss-chart polyline[data-series="training"]')
    return int(locator.get_attribute("data-count")) if locator.count() else 0


def test_dashboard_pages_live_curve_cancel_and_tenancy(page, client_a, client_b, tmp_path):
    hidden = client_b.files.create(file=("tenant-b-only.jsonl", training_jsonl(2)), purpose="fine-tune")
    hidden_job = client_b.fine_tuning.jobs.create(model="demo-tiny", training_file=hidden.id,
                                                  hyperparameters={"n_epochs": 1})
    # long enough to be cancelled from the page however fast the machine trains (it is, well before its end)
    upload = client_a.files.create(file=("dashboard.jsonl", training_jsonl(40)), purpose="fine-tune")
    job = client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=upload.id, suffix="ui",
                                           hyperparameters={"n_epochs": 50, "batch_size": 1},
                                           extra_body={"max_steps": 2000})
    body = "\n".join(json.dumps({"custom_id": f"u{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": "demo-tiny", "max_tokens": 3,
                                          "messages": [{"role": "user", "content": f"hi {i}"}]}}) for i in range(4))
    batch_file = client_a.files.create(file=("dashboard-batch.jsonl", body.encode()), purpose="batch")
    batch = client_a.batches.create(input_file_id=batch_file.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")

    page.goto(page.url.split("#")[0] + "#/files")
    page.wait_for_selector(f'tr[data-id="{upload.id}"]')
    assert page.locator(f'tr[data-id="{hidden.id}"]').count() == 0
    assert "tenant-b-only.jsonl" not in page.content()

    page.goto(page.url.split("#")[0] + "#/jobs")
    page.wait_for_selector(f'tr[data-id="{job.id}"]')
    assert page.locator(f'tr[data-id="{hidden_job.id}"]').count() == 0
    shoot(page, "jobs", tmp_path)

    page.goto(page.url.split("#")[0] + f"#/jobs/{job.id}")
    page.wait_for_function("() => { const l = document.querySelector('#loss-chart polyline[data-series=training]');"
                           " return l && Number(l.dataset.count) >= 2; }", timeout=240_000)
    first = curve_points(page)
    page.wait_for_function(f"() => Number(document.querySelector('#loss-chart polyline[data-series=training]')"
                           f".dataset.count) > {first}", timeout=120_000)  # the curve grows as steps arrive
    assert page.locator('#lr-chart polyline[data-series="learning rate"]').count() == 1
    assert page.locator("#eta").inner_text() != "–"
    shoot(page, "fine-tune", tmp_path)
    page.click(f'button[data-cancel="/fine_tuning/jobs/{job.id}/cancel"]')
    assert wait_for_job(client_a, job.id).status == "cancelled"
    page.wait_for_selector("#job-status .status.cancelled", timeout=30_000)

    _wait(lambda: client_a.batches.retrieve(batch.id).status == "completed", 180, "the batch")
    page.goto(page.url.split("#")[0] + f"#/batches/{batch.id}")
    page.wait_for_selector("text=4 done, 0 failed of 4")
    shoot(page, "batch", tmp_path)

    page.goto(page.url.split("#")[0] + "#/workers")
    page.wait_for_selector('div.worker[data-node^="wa@"]')
    assert page.locator('div.worker[data-node^="wb@"]').count() == 1
    assert "of" in page.locator('div.worker[data-node^="wa@"] td').nth(2).inner_text()
    shoot(page, "workers", tmp_path)

    page.goto(page.url.split("#")[0] + "#/models")
    page.wait_for_selector('tr[data-id="demo-tiny"]')
    assert wait_for_job(client_b, hidden_job.id).status in ("succeeded", "failed")
