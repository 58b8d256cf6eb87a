"""The tenant page: its rate limits (and the form that sets them), its usage charts and table,
its API keys."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import plotly.graph_objects as go
import pytest
from django.test import Client

from api.models import ApiKey, Tenant, User
from api.services.tenants import tenant_limits_set
from api.services.usage import UsageRow, usage_record_batch
from console import figures
from console.figures import TimeSeries
from tests.console.seed import Seeded

pytestmark = pytest.mark.django_db
FT = "ft:tiny:acme:support:ftjob-x"


def this_minute() -> datetime:
    return datetime.now(tz=UTC).replace(second=0, microsecond=0)


@pytest.fixture
def usage(seeded: Seeded) -> datetime:
    """acme: tiny now and two minutes ago, the fine-tuned model 3 hours ago, tiny 3 days ago;
    globex: tiny now. Returns the current minute."""
    now = this_minute()
    globex = Tenant.objects.get(name="globex")

    def row(tenant: Tenant, model: str, ago: timedelta, n: int, p: int, c: int) -> UsageRow:
        return UsageRow(
            tenant_id=tenant.pk,
            model=model,
            minute=now - ago,
            requests=n,
            prompt_tokens=p,
            completion_tokens=c,
        )

    usage_record_batch(
        rows=[
            row(seeded.tenant, "tiny", timedelta(0), 2, 1000, 100),
            row(seeded.tenant, "tiny", timedelta(minutes=2), 1, 500, 50),
            row(seeded.tenant, FT, timedelta(hours=3), 4, 4000, 400),
            row(seeded.tenant, "tiny", timedelta(days=3), 7, 7000, 700),
            row(globex, "tiny", timedelta(0), 9, 9999, 999),
        ]
    )
    return now


def cells(html: str, model: str) -> list[str]:
    row = re.search(rf'<tr data-model="{re.escape(model)}">(.*?)</tr>', html, re.S)
    assert row is not None, f"no usage row for {model}"
    return [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row[1])]


def test_the_tenants_list_links_each_tenant_page(operator_client: Client) -> None:
    html = operator_client.get("/console/tenants/").content.decode()
    assert 'href="/console/tenants/acme/"' in html and 'href="/console/tenants/globex/"' in html


def test_the_page_shows_limits_usage_per_model_and_keys(
    operator_client: Client, seeded: Seeded, usage: datetime
) -> None:
    tenant_limits_set(tenant=seeded.tenant, requests_per_minute=60, tokens_per_minute=150_000)
    response = operator_client.get("/console/tenants/acme/")
    assert response.status_code == 200
    html = response.content.decode()
    assert re.search(r'id="kpi-rpm">60<', html) and re.search(r'id="kpi-tpm">150,000<', html)
    assert re.search(r'id="kpi-day-requests">7<', html)
    assert re.search(r'id="kpi-day-tokens">5,500 \+ 550<', html)
    # Busiest first; the 30-day columns include the call 3 days ago.
    assert html.index(f'data-model="{FT}"') > html.index('data-model="tiny"')
    assert cells(html, "tiny") == ["tiny", "3", "1,500", "150", "10", "8,500", "850"]
    assert cells(html, FT) == [FT, "4", "4,000", "400", "4", "4,000", "400"]
    assert "9,999" not in html  # globex's usage is globex's
    key = ApiKey.objects.get(user__tenant=seeded.tenant)
    assert f'data-key="{key.prefix}"' in html
    assert 'value="60"' in html and 'value="150000"' in html
    for chart in ("tokens-per-hour", "tokens-per-minute"):
        assert f'data-chart-url="/console/charts/tenants/acme/{chart}"' in html
        assert 'data-ranged="false"' in html


def test_a_tenant_without_usage_shows_empty_states(operator_client: Client) -> None:
    html = operator_client.get("/console/tenants/globex/").content.decode()
    assert 'id="empty-usage"' in html and 'id="kpi-rpm">unlimited<' in html
    payload = operator_client.get("/console/charts/tenants/globex/tokens-per-hour").json()
    assert payload["empty"] is True and "No inference calls" in payload["message"]


def test_the_usage_charts_have_a_bar_per_bucket(operator_client: Client, usage: datetime) -> None:
    hourly = operator_client.get("/console/charts/tenants/acme/tokens-per-hour").json()
    assert hourly["empty"] is False
    assert hourly["points"] in (
        {"prompt tokens": 24, "completion tokens": 24},
        {"prompt tokens": 25, "completion tokens": 25},  # the window starts inside an hour
    )
    prompt = hourly["figure"]["data"][0]
    assert prompt["name"] == "prompt tokens" and prompt["type"] == "bar"
    assert sum(prompt["y"]) == 5500  # the last 24 hours: 1000 + 500 + 4000
    assert hourly["figure"]["layout"]["barmode"] == "stack"
    minutely = operator_client.get("/console/charts/tenants/acme/tokens-per-minute").json()
    completion = minutely["figure"]["data"][1]
    assert minutely["points"]["completion tokens"] == len(completion["x"]) in (1440, 1441)
    # (Found by time: the request may fall in the minute after the fixture's.)
    index = completion["x"].index(figures.iso_utc(usage))
    assert completion["y"][index - 2 : index + 1] == [50, 0, 100]


def test_unknown_tenants_and_charts_are_404s(operator_client: Client) -> None:
    assert operator_client.get("/console/tenants/nobody/").status_code == 404
    assert operator_client.post("/console/tenants/nobody/limits/", {}).status_code == 404
    missing = operator_client.get("/console/charts/tenants/nobody/tokens-per-hour")
    assert missing.status_code == 404 and "nobody" in missing.json()["error"]["message"]
    assert operator_client.get("/console/charts/tenants/acme/loss").status_code == 404


def test_the_limits_form_sets_and_clears_limits(operator_client: Client, seeded: Seeded) -> None:
    response = operator_client.post(
        "/console/tenants/acme/limits/", {"requests_per_minute": "30", "tokens_per_minute": ""}
    )
    assert response.status_code == 302 and response["Location"] == "/console/tenants/acme/"
    seeded.tenant.refresh_from_db()
    assert (seeded.tenant.requests_per_minute, seeded.tenant.tokens_per_minute) == (30, None)
    page = operator_client.get(response["Location"]).content.decode()
    assert "Rate limits of acme saved." in page
    operator_client.post(
        "/console/tenants/acme/limits/", {"requests_per_minute": "", "tokens_per_minute": ""}
    )
    seeded.tenant.refresh_from_db()
    assert (seeded.tenant.requests_per_minute, seeded.tenant.tokens_per_minute) == (None, None)


@pytest.mark.parametrize(
    ("posted", "message"),
    [
        ({"requests_per_minute": "0"}, "requests_per_minute must be an integer from 1"),
        ({"tokens_per_minute": "-4"}, "tokens_per_minute must be an integer from 1"),
        ({"tokens_per_minute": "lots"}, "Enter a whole number."),
    ],
)
def test_bad_limits_are_shown_and_nothing_is_written(
    operator_client: Client, seeded: Seeded, posted: dict[str, str], message: str
) -> None:
    tenant_limits_set(tenant=seeded.tenant, requests_per_minute=5, tokens_per_minute=500)
    response = operator_client.post("/console/tenants/acme/limits/", posted)
    assert response.status_code == 400
    assert message in response.content.decode()
    seeded.tenant.refresh_from_db()
    assert (seeded.tenant.requests_per_minute, seeded.tenant.tokens_per_minute) == (5, 500)


def test_the_limits_form_needs_csrf_and_an_operator(seeded: Seeded) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(User.objects.get(username="ops"))
    assert (
        client.post("/console/tenants/acme/limits/", {"requests_per_minute": "1"}).status_code
        == 403
    )
    tenant_user = Client()
    tenant_user.force_login(User.objects.get(username="tenant.acme"))
    assert tenant_user.get("/console/tenants/acme/").status_code == 403
    assert (
        tenant_user.post("/console/tenants/acme/limits/", {"requests_per_minute": "1"}).status_code
        == 403
    )
    assert tenant_user.get("/console/charts/tenants/acme/tokens-per-hour").status_code == 403
    seeded.tenant.refresh_from_db()
    assert seeded.tenant.requests_per_minute is None


def test_revoking_from_the_tenant_page_returns_to_it(
    operator_client: Client, seeded: Seeded
) -> None:
    key = ApiKey.objects.get(user__tenant=seeded.tenant)
    response = operator_client.post(f"/console/keys/{key.pk}/revoke/", {"back": "tenant"})
    assert response.status_code == 302 and response["Location"] == "/console/tenants/acme/"
    key.refresh_from_db()
    assert not key.is_active


def test_token_usage_figure_stacks_prompt_and_completion() -> None:
    t0 = datetime(2026, 11, 30, 7, 0, tzinfo=UTC)
    ts = [t0, t0 + timedelta(hours=1)]
    fig = figures.token_usage_figure(
        prompt=TimeSeries(name="prompt tokens", ts=ts, values=[10.0, 0.0]),
        completion=TimeSeries(name="completion tokens", ts=ts, values=[1.0, 0.0]),
        per="hour",
    )
    assert figures.point_counts(fig) == {"prompt tokens": 2, "completion tokens": 2}
    assert fig["layout"]["barmode"] == "stack"
    assert fig["layout"]["yaxis"]["title"]["text"] == "tokens per hour"
    assert fig["data"][0]["x"] == ["2026-11-30T07:00:00.000", "2026-11-30T08:00:00.000"]
    go.Figure(fig)


def test_the_page_shows_each_quota_with_its_use_and_the_form_sets_them(
    operator_client: Client, seeded: Seeded, settings: Any
) -> None:
    settings.HARLI_QUOTA_RUNNING_JOBS = 6
    page = operator_client.get("/console/tenants/acme/").content.decode()
    table = page[page.index('id="quota-table"') :]
    for name in ("running_jobs", "queued_jobs", "stored_bytes", "trained_tokens_per_month"):
        assert f'data-quota="{name}"' in table
    running = table[table.index('data-quota="running_jobs"') :]
    assert 'data-limit="6"' in running[: running.index("</tr>")]
    response = operator_client.post(
        "/console/tenants/acme/limits/",
        {
            "requests_per_minute": "",
            "tokens_per_minute": "",
            "queued_jobs": "2",
            "running_jobs": "",
        },
    )
    assert response.status_code == 302
    page = operator_client.get("/console/tenants/acme/").content.decode()
    queued = page[page.index('data-quota="queued_jobs"') :]
    assert 'data-limit="2"' in queued[: queued.index("</tr>")]
    assert 'name="queued_jobs" id="id_queued_jobs" value="2"' in page
    refused = operator_client.post(
        "/console/tenants/acme/limits/",
        {"requests_per_minute": "", "tokens_per_minute": "", "queued_jobs": "-4"},
    )
    assert refused.status_code == 400
    assert "quotas.queued_jobs must be an integer from 0" in refused.content.decode()
