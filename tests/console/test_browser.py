"""The console in a real browser: Debian's Chromium driven by Playwright against a live server.

Charts are checked from what plotly.js rendered (the plot div's `.data` and `.layout`), against
the counts the seed wrote. Screenshots of every page go to `test-artifacts/console/`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from api.models import DeploymentMetric, FinetuneJob, GpuHost, HostStatus, JobStatus
from tests.console.seed import (
    DEPLOYMENT_OLD_POINTS,
    DEPLOYMENT_POINTS,
    HOST_A_POINTS,
    HOST_B_POINTS,
    JOB_STEPS,
    OPERATOR,
    TPOT_SLO_MS,
    Seeded,
    seed_console,
)

pytestmark = [pytest.mark.browser]

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "console"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 15_000

# Reads what plotly.js drew: trace names with point counts, and horizontal shapes' y values.
PLOT_STATE = """id => {
  const el = document.getElementById(id);
  if (!el || !el.data) return null;
  return {
    points: Object.fromEntries(el.data.map(t => [t.name, (t.x || []).length])),
    hlines: (el.layout.shapes || []).filter(s => s.y0 === s.y1).map(s => s.y0),
    rendered: el.querySelectorAll('.main-svg').length > 0,
  };
}"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.fail(
            "Debian's Chromium is missing: run `bash scripts/setup.sh --browser` "
            "(or apt-get install chromium)."
        )
    if not (ROOT / "frontend" / "dist" / "console" / "plotly.min.js").exists():
        pytest.fail("The console's assets are not built: run `cd frontend && npm run build`.")
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop in this thread while the browser lives; the
    # tests' own ORM calls (and the database flush after each test) are still synchronous code.
    with pytest.MonkeyPatch.context() as patch, sync_playwright() as playwright:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        yield chromium
        chromium.close()


@pytest.fixture
def fleet(transactional_db: None, browser: Any) -> Seeded:
    return seed_console()


@pytest.fixture
def page(django_db_setup: None, browser: Any, live_server: Any) -> Iterator[Any]:
    """A fresh browser tab on the live server. The test database is set up before the live
    server starts, so the server (and its connections) stop before the database is dropped."""
    context = browser.new_context(base_url=live_server.url, viewport={"width": 1400, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    yield tab
    context.close()
    assert errors == [], f"JavaScript errors: {errors}"


def shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def login(page: Any) -> None:
    page.goto("/console/login/")
    page.fill("#id_username", OPERATOR[0])
    page.fill("#id_password", OPERATOR[1])
    page.click("button[type=submit]")
    page.wait_for_url("**/console/")


def plot(page: Any, chart_id: str, state: str = "ready") -> dict[str, Any]:
    page.wait_for_selector(f"#{chart_id}[data-state={state}]", state="attached")
    result: dict[str, Any] = page.evaluate(PLOT_STATE, chart_id)
    return result


def test_operator_tour_of_every_page(page: Any, fleet: Seeded) -> None:
    page.goto("/console/jobs/")
    assert "/console/login/" in page.url  # logged out: sent to the login page
    shot(page, "login")
    login(page)

    memory = plot(page, "chart-memory")
    assert memory["rendered"]
    assert memory["points"] == {
        "Weights": 2,
        "KV cache in use": 2,
        "Lent to finetuning": 2,
        "Free": 2,
    }
    assert plot(page, "chart-finetune")["points"] == {
        "gpu-a": HOST_A_POINTS,
        "gpu-b": HOST_B_POINTS,
    }
    attainment = plot(page, "chart-attainment")
    assert attainment["points"] == {"chat-tiny": DEPLOYMENT_POINTS}
    assert attainment["hlines"] == [99.0]
    assert page.inner_text("#kpi-hosts") == "2 / 3"
    shot(page, "fleet")

    page.click("#deployments-table >> text=chat-tiny")
    page.wait_for_url("**/console/deployments/chat-tiny/")
    tpot = plot(page, "chart-tpot")
    assert tpot["points"] == {"TPOT p50": DEPLOYMENT_POINTS, "TPOT p99": DEPLOYMENT_POINTS}
    assert tpot["hlines"] == [TPOT_SLO_MS]
    assert plot(page, "chart-attainment")["hlines"] == [fleet.deployment.slo_attainment_target_pct]
    for chart in ("chart-goodput", "chart-iteration"):
        assert set(plot(page, chart)["points"].values()) == {DEPLOYMENT_POINTS}, chart
    shot(page, "deployment")
    # The time range refetches every chart in place.
    page.evaluate("window.__stillHere = true")
    page.click(".range-selector [data-range='6h']")
    page.wait_for_function(
        "n => document.getElementById('chart-tpot').data[0].x.length === n",
        arg=DEPLOYMENT_POINTS + DEPLOYMENT_OLD_POINTS,
    )
    assert page.evaluate("window.__stillHere") is True
    assert "range=6h" in page.url

    page.goto("/console/deployments/chat-idle/")
    page.wait_for_selector("#chart-tpot[data-state=empty]", state="attached")
    assert "No metrics" in page.inner_text(".chart-card:has(#chart-tpot) .chart-message")

    page.goto("/console/jobs/")
    assert page.locator("#jobs-table tbody tr").count() == 3
    running_row = page.locator(f"tr[data-job='{fleet.running_job.pk}']")
    assert running_row.locator("[role=progressbar]").get_attribute("aria-valuenow") == "50"
    assert "ETA" in running_row.inner_text()
    shot(page, "jobs")
    page.select_option("select[name=tenant]", "globex")
    page.click("form.filters button[type=submit]")
    page.wait_for_url(re.compile(r".*tenant=globex.*"))
    assert page.locator("#jobs-table tbody tr").count() == 1

    page.goto("/console/jobs/")
    page.click(f"tr[data-job='{fleet.running_job.pk}'] a")
    loss = plot(page, "chart-loss")
    assert loss["points"] == {"train loss": JOB_STEPS, "validation loss": JOB_STEPS // 5}
    assert plot(page, "chart-job-throughput")["points"] == {"tokens/s": JOB_STEPS}
    assert page.inner_text("#job-status") == "Running"
    assert page.locator("#checkpoints-table tbody tr").count() == 1
    assert page.locator("#events li").count() >= 2  # created, started
    assert page.inner_text("#metric-events").startswith(f"{JOB_STEPS + 1} progress")
    shot(page, "job")
    for other in (fleet.queued_job, fleet.cancelled_job):
        page.goto(f"/console/jobs/{other.pk}/")
        assert page.inner_text("#job-status") == other.get_status_display()
        assert page.locator("#events li").count() >= 1
    page.goto(f"/console/jobs/{fleet.running_job.pk}/")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("button[data-action=cancel]")
    page.wait_for_selector("#job-status >> text=Cancelled")
    assert FinetuneJob.objects.get(pk=fleet.running_job.pk).status == JobStatus.CANCELLED
    assert page.locator("#events li", has_text="Job cancelled").count() == 1

    page.goto("/console/tenants/")
    page.fill("tr[data-tenant=acme] input[name=name]", "browser")
    page.click("tr[data-tenant=acme] button[data-action=issue]")
    key = page.inner_text("#issued-key-value").strip()
    assert key.startswith("hk-") and len(key) == 43
    shot(page, "tenants")

    page.goto("/console/models/")
    assert page.locator("#models-table tbody tr").count() == 1
    shot(page, "models")
    page.goto("/console/hosts/")
    assert page.locator("#hosts-table tbody tr").count() == 3
    shot(page, "hosts")
    page.click("#hosts-table >> text=gpu-a")
    host_memory = plot(page, "chart-host-memory")
    assert set(host_memory["points"].values()) == {HOST_A_POINTS}
    assert plot(page, "chart-host-finetune")["points"] == {"finetune tokens/s": HOST_A_POINTS}
    assert page.locator("#host-placements-table tbody tr").count() == 1
    shot(page, "host")
    page.goto("/console/predictors/")
    scatter = plot(page, "chart-predictor-scatter")
    assert scatter["points"] == {
        "gpu-a (v1)": DEPLOYMENT_POINTS // 2,
        "gpu-b (v2)": DEPLOYMENT_POINTS // 2,
    }
    assert page.locator("#accuracy-table tbody tr").count() == 2
    shot(page, "predictors")


def test_live_refresh_and_inline_errors(page: Any, fleet: Seeded, settings: Any) -> None:
    settings.HARLI_CONSOLE_REFRESH_MS = 1000
    login(page)
    page.goto("/console/deployments/chat-tiny/?range=15m")
    assert plot(page, "chart-tpot")["points"]["TPOT p50"] == DEPLOYMENT_POINTS
    page.evaluate("window.__stillHere = true")
    DeploymentMetric.objects.create(
        deployment=fleet.deployment,
        ts=fleet.now + timedelta(seconds=10),  # the next 10 s bucket: a new point
        tpot_p50_ms=25.0,
        tpot_p99_ms=41.0,
        slo_attainment=1.0,
        goodput_tokens_per_s=6000.0,
        request_rate=14.0,
    )
    # The next timed refresh (every second here) brings the new point without a page reload.
    page.wait_for_function(
        "n => document.getElementById('chart-tpot').data[0].x.length === n",
        arg=DEPLOYMENT_POINTS + 1,
    )
    assert page.evaluate("window.__stillHere") is True

    # Figures outside the charts (KPIs, host table) refresh in place too.
    page.goto("/console/")
    assert page.inner_text("#kpi-hosts") == "2 / 3"
    page.evaluate("window.__stillHere = true")
    GpuHost.objects.filter(name="gpu-c").update(status=HostStatus.ONLINE)
    page.wait_for_function("() => document.getElementById('kpi-hosts').textContent === '3 / 3'")
    assert page.evaluate("window.__stillHere") is True

    # A failing data endpoint is reported inline on the chart, which keeps its last plot, and
    # a failing live-parts endpoint above the page.
    assert plot(page, "chart-finetune")["points"]["gpu-a"] == HOST_A_POINTS
    page.route(
        re.compile(r".*/console/(charts|live)/.*"),
        lambda route: route.fulfill(
            status=500,
            content_type="application/json",
            body='{"error": {"message": "metrics store unavailable"}}',
        ),
    )
    page.evaluate("window.harliConsole.refreshAll()")
    page.wait_for_selector("#chart-finetune[data-state=error]", state="attached")
    message = page.inner_text(".chart-card:has(#chart-finetune) .chart-message")
    assert "metrics store unavailable" in message
    assert page.evaluate(PLOT_STATE, "chart-finetune")["points"]["gpu-a"] == HOST_A_POINTS
    page.wait_for_selector("main[data-live-state=error]", state="attached")
    assert "metrics store unavailable" in page.inner_text(".live-note")
    shot(page, "errors")


def test_tenant_key_is_refused(page: Any, fleet: Seeded) -> None:
    page.context.set_extra_http_headers({"Authorization": f"Bearer {fleet.tenant_key}"})
    page.goto("/console/")
    assert "/console/login/" in page.url
    response = page.request.get("/console/charts/fleet/memory")
    assert response.status == 401
    # Nor can a tenant account sign in with a password.
    page.fill("#id_username", "tenant.acme")
    page.fill("#id_password", "anything")
    page.click("button[type=submit]")
    assert page.locator(".form-error").count() == 1
    assert "/console/login/" in page.url
