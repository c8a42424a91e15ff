"""The web page at ``/`` and ``/jobs/{id}/report`` in a REAL headless browser: Debian's
chromium driven by its chromium-driver through selenium (``make test`` installs both with
apt-get when missing; selenium is given their paths, so selenium-manager never runs and nothing
is downloaded).

Against real servers on a shared workspace: upload the workspace and a small patchset, start a
CLs job, watch it finish, see the exclusion plot (drawn: ``naturalWidth > 0``) and one table row
per patch, without a JavaScript error in the console; the report page of a job; and with auth
on, the page asking for the token (a password field) and working once it is given.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from service_support import WORKSPACES, running_server, wait_for_job
from workspaces import read_json, workspace_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip(
        "chromium and chromedriver are not installed: `make test` installs Debian's chromium "
        "and chromium-driver with apt-get (as root); elsewhere install them to run these tests",
        allow_module_level=True,
    )

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium (the test extra)")
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

ANALYSIS = WORKSPACES / "atlas-susy-2018-31-sbottom-B"
WORKSPACE = workspace_file(ANALYSIS, "BkgOnly.json")  # .json.gz: the page reads both
PATCHES = ["sig_s0_x2", "sig_s0_x5", "sig_s0_x8", "sig_s1_x2", "sig_s1_x5", "sig_s1_x8"]
TOKEN = "page-token-5f2c9e"
JOB_TIMEOUT_S = 60


def chromium() -> webdriver.Chrome:
    """Headless chromium with its console log kept (``goog:loggingPrefs``)."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,1600",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    driver = chromium()
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def patchset_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six patches of the analysis' patchset (a 2 x 3 grid of its shape and scale values)."""
    patchset = read_json(ANALYSIS / "patchset.json")
    patchset["patches"] = [p for p in patchset["patches"] if p["metadata"]["name"] in PATCHES]
    assert len(patchset["patches"]) == len(PATCHES)
    path = tmp_path_factory.mktemp("patchset") / "six-patches.json"
    path.write_text(json.dumps(patchset))
    return path


def severe(driver: webdriver.Chrome) -> list[dict]:
    """The console's SEVERE entries since the last call (JavaScript errors, failed loads)."""
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def wait_until(driver: webdriver.Chrome, script: str, what: str, timeout_s: float = 30) -> None:
    """Wait (bounded) until ``script`` returns true in the page; fail with the page's message."""
    try:
        WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(
            lambda d: d.execute_script(script)
        )
    except TimeoutException:
        message = driver.find_element(By.ID, "message").text
        progress = driver.find_element(By.ID, "progress-text").text
        pytest.fail(f"{what} not within {timeout_s} s; message {message!r}, progress {progress!r}")


PLOT_DRAWN = """
const image = document.querySelector('#plots img[data-kind="exclusion"]');
return image !== null && image.complete && image.naturalWidth > 0;
"""


def results_rows(driver: webdriver.Chrome) -> list[list[str]]:
    """The results table's body, cell texts per row."""
    rows = driver.find_elements(By.CSS_SELECTOR, "#results-table tbody tr")
    return [[cell.text for cell in row.find_elements(By.CSS_SELECTOR, "th, td")] for row in rows]


def run_cls_job(driver: webdriver.Chrome, patchset: Path) -> None:
    """Upload the workspace and the patchset, start a CLs job and wait for its plots."""
    driver.find_element(By.ID, "workspace-file").send_keys(str(WORKSPACE))
    driver.find_element(By.ID, "patchset-file").send_keys(str(patchset))
    assert driver.find_element(By.ID, "operation").get_attribute("value") == "cls"
    driver.find_element(By.ID, "start-job").click()
    wait_until(driver, PLOT_DRAWN, "the exclusion plot", JOB_TIMEOUT_S)


def assert_cls_results(driver: webdriver.Chrome) -> None:
    """One row per patch: its name, CLs observed and the expected median (numbers)."""
    rows = results_rows(driver)
    assert sorted(row[0] for row in rows) == sorted(PATCHES)
    for row in rows:
        assert 0 < float(row[1]) < 1 and 0 < float(row[2]) < 1, row
    heads = [h.text for h in driver.find_elements(By.CSS_SELECTOR, "#results-table thead th")]
    assert heads[:3] == ["Patch", "CLs observed", "CLs expected (median)"]
    assert driver.find_element(By.ID, "doubtful").get_attribute("hidden")  # all converged
    status = driver.find_element(By.ID, "progress-text")
    assert status.text == f"Job succeeded: {len(PATCHES)} of {len(PATCHES)} hypotheses"
    assert status.get_attribute("aria-live") == "polite"


def test_page_runs_a_cls_job_and_shows_its_plots(browser, server, patchset_file) -> None:
    started = time.monotonic()
    browser.get(server.url + "/")
    assert browser.title == "pyhf-gpu"
    assert not browser.find_element(By.ID, "new-job").get_attribute("hidden")
    assert browser.find_element(By.ID, "token-section").get_attribute("hidden")
    unlabelled = browser.execute_script(
        "return [...document.querySelectorAll('input, select')]"
        ".filter(e => e.type !== 'hidden' && e.labels.length === 0).map(e => e.id)"
    )
    assert unlabelled == [], "form controls without a label element"
    run_cls_job(browser, patchset_file)
    assert_cls_results(browser)
    image = browser.find_element(By.CSS_SELECTOR, '#plots img[data-kind="exclusion"]')
    assert image.get_attribute("src").startswith("blob:")  # fetched with the headers
    assert "exclusion plot" in image.get_attribute("alt")
    # the job is listed, linked to its report page
    link = browser.find_element(By.ID, "report-link").get_attribute("href")
    job_id = link.split("/jobs/")[1].split("/")[0]
    wait_until(
        browser,
        f"return document.querySelector('#jobs-table a[href$=\"{job_id}/report\"]') !== null",
        "the job in the recent jobs",
    )
    assert severe(browser) == []
    assert time.monotonic() - started < JOB_TIMEOUT_S


def test_report_page_shows_one_job(browser, server, patchset_file) -> None:
    patchset = json.loads(patchset_file.read_text())
    with server.client() as client:
        workspace = read_json(WORKSPACE)
        body = {"operation": "cls", "workspace": workspace, "patchset": patchset}
        job_id = client.post("/jobs", json=body).json()["id"]
        assert wait_for_job(client, job_id)["status"] == "succeeded"
    browser.get(f"{server.url}/jobs/{job_id}/report")
    wait_until(browser, PLOT_DRAWN, "the exclusion plot of the report")
    assert job_id in browser.find_element(By.ID, "job-heading").text
    assert browser.find_element(By.ID, "new-job").get_attribute("hidden")  # one job only
    assert_cls_results(browser)
    assert severe(browser) == []


def store_finished_job(server, job_id: str, operation: str, result: Any, rows: int) -> None:
    """A succeeded job of ``operation`` with ``result``, written straight into the server's
    real SQLite file (as the job runner leaves one)."""
    now = time.time()
    request = json.dumps({"workspace_id": "0" * 64})
    with sqlite3.connect(server.data_dir / "jobs.sqlite3") as db:
        db.execute(
            "INSERT INTO jobs (id, operation, status, request, done, total, result, "
            "created_at, started_at, finished_at) "
            "VALUES (?, ?, 'succeeded', ?, ?, ?, ?, ?, ?, ?)",
            (job_id, operation, request, rows, rows, json.dumps(result), now, now, now),
        )


SLICES = {
    60.0: [
        "sbottom_600_205_60",
        "sbottom_600_400_60",
        "sbottom_800_205_60",
        "sbottom_800_450_60",
        "sbottom_900_250_60",
    ],
    200.0: ["sbottom_900_330_200", "sbottom_1000_330_200", "sbottom_1100_330_200"],
}


def test_report_page_draws_the_exclusion_slice_chosen(browser, server) -> None:
    """A published patchset's points span three masses: the exclusion plot draws the most
    populated slice of m_neutralino1, and the page offers the others (the server lists them
    in GET /jobs/{id}/plots) and draws the one chosen."""
    published = read_json(ANALYSIS / "patchset.hepdata.json")
    wanted = {name for names in SLICES.values() for name in names}
    published["patches"] = [p for p in published["patches"] if p["metadata"]["name"] in wanted]
    assert len(published["patches"]) == len(wanted)
    with server.client() as client:
        body = {"operation": "cls", "workspace": read_json(WORKSPACE), "patchset": published}
        job_id = client.post("/jobs", json=body).json()["id"]
        assert wait_for_job(client, job_id)["status"] == "succeeded"
        (link,) = client.get(f"/jobs/{job_id}/plots").json()["plots"]
    assert [(s["values"], s["points"], s["label"]) for s in link["slices"]] == [
        ([60.0], 5, "m_neutralino1 = 60 GeV"),
        ([200.0], 3, "m_neutralino1 = 200 GeV"),
    ]
    browser.get(f"{server.url}/jobs/{job_id}/report")
    drawn = PLOT_DRAWN.replace(
        "return ", "return image !== null && image.dataset.slice === '{}' && "
    )
    wait_until(browser, drawn.format("60"), "the exclusion plot of the slice m_neutralino1 = 60")
    select = Select(browser.find_element(By.ID, "slice-exclusion"))
    assert [o.text for o in select.options] == [
        "m_neutralino1 = 60 GeV (5 points)",
        "m_neutralino1 = 200 GeV (3 points)",
    ]
    label = browser.find_element(By.CSS_SELECTOR, "label[for='slice-exclusion']")
    assert label.text.strip() == "Slice"
    select.select_by_value("200")
    wait_until(browser, drawn.format("200"), "the exclusion plot of the slice m_neutralino1 = 200")
    assert browser.find_elements(By.CSS_SELECTOR, "#plots .message") == []
    assert severe(browser) == []


def test_report_page_flags_a_doubtful_result(browser, server) -> None:
    """A result whose fits the server flagged in its meta (a job row written into the server's
    real SQLite file, as a finished job would be) is said above the table, in an alert."""
    job_id = "d0" * 16
    result = {
        "p0_obs": 0.21,
        "p0_exp": 0.12,
        "z_obs": 0.81,
        "z_exp": 1.17,
        "meta": {"converged": False, "starts_agreed": False},
    }
    store_finished_job(server, job_id, "significance", result, rows=1)
    browser.get(f"{server.url}/jobs/{job_id}/report")
    wait_until(browser, "return !document.getElementById('doubtful').hidden", "the flag")
    flag = browser.find_element(By.ID, "doubtful")
    assert flag.get_attribute("role") == "alert"
    assert "The result: its fits did not converge" in flag.text
    assert "reached different minima" in flag.text
    assert results_rows(browser)[0][1] == "0.21"  # the numbers are still shown
    assert severe(browser) == []


def test_report_page_marks_a_result_past_its_model_limits(browser, server) -> None:
    """A patch whose answer the server flagged in ``meta.flags`` (an expected limit past the
    POI's bound, where pyhf raises): the alert says the server's words, naming the patch, and
    its row in the table is marked; the other patch's is not."""
    job_id = "d1" * 16
    detail = (
        "limits past the upper bound 10 of the POI 'mu_SIG': expected +2 sigma 13.49 (CLs at "
        "the bound above the level 0.05, where pyhf's upper_limit raises ValueError)"
    )
    flag = {"kind": "limit_beyond_bounds", "detail": detail}
    inside = [2.5, 3.6, 5.5, 8.6, 9.9]
    result = {
        "sbottom_1000_850_60": {
            "upper_limit_obs": 5.18,
            "upper_limit_exp": [*inside[:4], 13.49],
            "level": 0.05,
            "meta": {"converged": True, "starts_agreed": True, "flags": [flag]},
        },
        "sbottom_1000_750_60": {
            "upper_limit_obs": 5.23,
            "upper_limit_exp": inside,
            "level": 0.05,
            "meta": {"converged": True, "starts_agreed": True, "flags": []},
        },
    }
    store_finished_job(server, job_id, "upper-limit", result, rows=2)
    browser.get(f"{server.url}/jobs/{job_id}/report")
    wait_until(browser, "return !document.getElementById('doubtful').hidden", "the flag")
    alert = browser.find_element(By.ID, "doubtful")
    assert alert.get_attribute("role") == "alert"
    items = [li.text for li in alert.find_elements(By.CSS_SELECTOR, "li")]
    assert items == [f"Patch sbottom_1000_850_60: {detail}"]
    wait_until(
        browser,
        "return document.querySelectorAll('#results-table tbody tr').length == 2",
        "the table",
    )
    rows = {row[0]: row for row in results_rows(browser)}
    assert set(rows) == {"sbottom_1000_850_60 ⚠", "sbottom_1000_750_60"}
    assert rows["sbottom_1000_850_60 ⚠"][1] == "5.18"  # the numbers are still shown
    assert severe(browser) == []


def test_page_asks_for_the_token_with_auth_on(browser, patchset_file, tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    args = ["--api-token-file", str(token_file)]
    (tmp_path / "data").mkdir()
    with running_server(tmp_path / "data", args) as server:
        # the page and its files hold no data: open; everything else needs the token
        for path in ("/", "/static/app.js", "/static/style.css", "/jobs/abc/report"):
            assert httpx.get(server.url + path).status_code == 200, path
        assert httpx.get(server.url + "/jobs/abc/plots/brazil.png").status_code == 401
        browser.get(server.url + "/")
        field = browser.find_element(By.ID, "token")
        assert field.get_attribute("type") == "password"
        assert browser.find_element(By.CSS_SELECTOR, "label[for=token]").text == "API token"
        assert browser.find_element(By.ID, "new-job").get_attribute("hidden")
        # a wrong token is refused (the console notes the 401 of that check, nothing else)
        field.send_keys("not-the-token")
        browser.find_element(By.CSS_SELECTOR, "#token-form button").click()
        wait_until(
            browser,
            "return document.getElementById('token-status').textContent.includes('not accepted')",
            "the refusal of a wrong token",
        )
        assert all("401" in entry["message"] for entry in severe(browser))
        # the right one opens the page, kept for the tab only
        field.send_keys(TOKEN)
        browser.find_element(By.CSS_SELECTOR, "#token-form button").click()
        wait_until(
            browser,
            "return !document.getElementById('new-job').hidden",
            "the page after the token",
        )
        stored = browser.execute_script("return sessionStorage.getItem('pyhf-gpu-token')")
        assert stored == TOKEN
        run_cls_job(browser, patchset_file)
        assert_cls_results(browser)
        # the report page of the job, in the same tab: the token goes along
        browser.get(browser.find_element(By.ID, "report-link").get_attribute("href"))
        wait_until(browser, PLOT_DRAWN, "the exclusion plot of the report, with auth on")
        assert_cls_results(browser)
        assert severe(browser) == []


SCAN_PLOT_DRAWN = PLOT_DRAWN.replace('"exclusion"', '"scan"')


def test_page_runs_a_scan_on_the_default_grid(browser, server, patchset_file) -> None:
    """A scan job with no range given: each patch's best fit +- 3 uncertainties (within the
    POI's bounds), 5 points, drawn and tabulated."""
    browser.get(server.url + "/")
    browser.find_element(By.ID, "workspace-file").send_keys(str(WORKSPACE))
    browser.find_element(By.ID, "patchset-file").send_keys(str(patchset_file))
    Select(browser.find_element(By.ID, "operation")).select_by_value("scan")
    assert browser.find_element(By.ID, "scan-low").get_attribute("value") == ""
    steps = browser.find_element(By.ID, "scan-steps")
    steps.clear()
    steps.send_keys("5")
    browser.find_element(By.ID, "start-job").click()
    wait_until(browser, SCAN_PLOT_DRAWN, "the scan plot", JOB_TIMEOUT_S)
    assert len(results_rows(browser)) == 5
    job_id = browser.find_element(By.ID, "report-link").get_attribute("href").split("/jobs/")[1]
    with server.client() as client:
        result = client.get(f"/jobs/{job_id.split('/')[0]}").json()["result"]
    for name in PATCHES:
        scan = result[name]
        low = max(0.0, scan["bestfit"] - 3 * scan["uncertainty"])
        high = min(10.0, scan["bestfit"] + 3 * scan["uncertainty"])
        expected = [low + (high - low) * i / 4 for i in range(5)]
        assert scan["parameter_values"] == pytest.approx(expected, abs=1e-12), name
    assert severe(browser) == []
