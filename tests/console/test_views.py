"""Console pages and chart endpoints through Django's test client (no browser)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client

from api.models import (
    ApiKey,
    DeploymentMetric,
    FinetuneJob,
    GpuHost,
    HostStatus,
    JobStatus,
    User,
    UserRole,
)
from tests.console.seed import (
    DEPLOYMENT_OLD_POINTS,
    DEPLOYMENT_POINTS,
    HOST_A_POINTS,
    HOST_B_POINTS,
    JOB_STEPS,
    TPOT_SLO_MS,
    Seeded,
)

PAGES = [
    "/console/",
    "/console/deployments/chat-tiny/",
    "/console/deployments/chat-idle/",
    "/console/jobs/",
    "/console/tenants/",
    "/console/tenants/acme/",
    "/console/models/",
    "/console/hosts/",
    "/console/hosts/gpu-a/",
    "/console/hosts/gpu-c/",
    "/console/predictors/",
]


def _json(client: Client, url: str) -> Any:
    response = client.get(url)
    assert response["Content-Type"] == "application/json", url
    return response.status_code, response.json()


@pytest.mark.django_db
def test_logged_out_pages_redirect_to_login() -> None:
    response = Client().get("/console/jobs/?status=running")
    assert response.status_code == 302
    assert response["Location"] == "/console/login/?next=/console/jobs/%3Fstatus%3Drunning"
    assert Client().get("/").headers["Location"] == "/console/"


@pytest.mark.django_db
def test_logged_out_chart_data_is_401_json() -> None:
    status, body = _json(Client(), "/console/charts/fleet/memory")
    assert status == 401
    assert body["error"]["type"] == "authentication_error"


def test_a_tenant_api_key_opens_nothing(seeded: Seeded) -> None:
    headers = {"Authorization": f"Bearer {seeded.tenant_key}"}
    page = Client().get("/console/", headers=headers)
    assert page.status_code == 302 and page["Location"].startswith("/console/login/")
    chart = Client().get("/console/charts/fleet/finetune", headers=headers)
    assert chart.status_code == 401


def test_a_tenant_user_cannot_sign_in_or_use_a_session(seeded: Seeded) -> None:
    user = User.objects.get(username="tenant.acme")
    user.set_password("tenant-password")
    user.save()
    client = Client()
    response = client.post(
        "/console/login/", {"username": "tenant.acme", "password": "tenant-password"}
    )
    assert response.status_code == 200
    assert "not an operator" in response.content.decode()
    assert "_auth_user_id" not in client.session
    client.force_login(user)  # even with a session, a tenant user is refused
    assert client.get("/console/").status_code == 403
    assert client.get("/console/charts/fleet/memory").status_code == 403


def test_operator_signs_in_and_lands_on_the_fleet(seeded: Seeded) -> None:
    client = Client(enforce_csrf_checks=True)
    login_page = client.get("/console/login/")
    token = login_page.cookies["csrftoken"].value
    refused = Client(enforce_csrf_checks=True).post(
        "/console/login/", {"username": "ops", "password": "ops-password-1"}
    )
    assert refused.status_code == 403  # no CSRF token
    response = client.post(
        "/console/login/",
        {"username": "ops", "password": "ops-password-1", "csrfmiddlewaretoken": token},
    )
    assert response.status_code == 302 and response["Location"] == "/console/"


def test_sign_out_is_a_post(operator_client: Client) -> None:
    assert operator_client.get("/console/logout/").status_code == 405
    response = operator_client.post("/console/logout/")
    assert response.status_code == 302 and response["Location"] == "/console/login/"
    assert operator_client.get("/console/").status_code == 302


@pytest.mark.parametrize("url", PAGES)
def test_every_page_renders_for_an_operator(operator_client: Client, url: str) -> None:
    response = operator_client.get(url)
    assert response.status_code == 200, url
    assert b"csrfmiddlewaretoken" in response.content  # at least the sign-out form


def test_unknown_objects_are_404_pages(operator_client: Client) -> None:
    assert operator_client.get("/console/deployments/nope/").status_code == 404
    assert operator_client.get("/console/jobs/ftjob-nope/").status_code == 404


def test_deployment_charts_have_every_point_and_the_slo(operator_client: Client) -> None:
    base = "/console/charts/deployments/chat-tiny/"
    status, body = _json(operator_client, base + "tpot?range=1h")
    assert status == 200 and body["empty"] is False
    assert body["points"] == {"TPOT p50": DEPLOYMENT_POINTS, "TPOT p99": DEPLOYMENT_POINTS}
    assert body["figure"]["layout"]["shapes"][0]["y0"] == TPOT_SLO_MS
    _, wide = _json(operator_client, base + "tpot?range=6h")
    assert wide["points"]["TPOT p50"] == DEPLOYMENT_POINTS + DEPLOYMENT_OLD_POINTS
    for chart in ("attainment", "goodput", "iteration"):
        status, body = _json(operator_client, base + chart)
        assert status == 200 and set(body["points"].values()) == {DEPLOYMENT_POINTS}, chart


def test_empty_and_error_states_of_chart_data(operator_client: Client) -> None:
    status, body = _json(operator_client, "/console/charts/deployments/chat-idle/tpot")
    assert status == 200 and body["empty"] is True and body["figure"] is None
    assert "No metrics" in body["message"]
    status, body = _json(operator_client, "/console/charts/deployments/chat-tiny/tpot?range=2d")
    assert status == 400 and "Unknown time range" in body["error"]["message"]
    assert _json(operator_client, "/console/charts/fleet/nope")[0] == 404
    assert _json(operator_client, "/console/charts/deployments/nope/tpot")[0] == 404
    assert _json(operator_client, "/console/charts/jobs/ftjob-nope/loss")[0] == 404


def test_fleet_charts(operator_client: Client) -> None:
    _, memory = _json(operator_client, "/console/charts/fleet/memory")
    assert memory["figure"]["data"][0]["y"] == ["gpu-a", "gpu-b"]
    _, finetune = _json(operator_client, "/console/charts/fleet/finetune?range=15m")
    assert finetune["points"] == {"gpu-a": HOST_A_POINTS, "gpu-b": HOST_B_POINTS}
    _, attainment = _json(operator_client, "/console/charts/fleet/attainment")
    assert attainment["points"] == {"chat-tiny": DEPLOYMENT_POINTS}


def test_host_charts(operator_client: Client) -> None:
    _, memory = _json(operator_client, "/console/charts/hosts/gpu-a/memory")
    assert memory["points"] == {
        "Weights": HOST_A_POINTS,
        "KV cache in use": HOST_A_POINTS,
        "Lent to finetuning": HOST_A_POINTS,
        "Free": HOST_A_POINTS,
    }
    assert memory["figure"]["data"][2]["y"][0] == 20.0  # GiB lent
    _, finetune = _json(operator_client, "/console/charts/hosts/gpu-b/finetune?range=15m")
    assert finetune["points"] == {"finetune tokens/s": HOST_B_POINTS}
    _, idle = _json(operator_client, "/console/charts/hosts/gpu-c/memory")
    assert idle["empty"] is True
    assert _json(operator_client, "/console/charts/hosts/nope/memory")[0] == 404
    assert operator_client.get("/console/hosts/nope/").status_code == 404


def test_job_and_predictor_charts(operator_client: Client, seeded: Seeded) -> None:
    job = seeded.running_job.pk
    _, loss = _json(operator_client, f"/console/charts/jobs/{job}/loss")
    assert loss["points"] == {"train loss": JOB_STEPS, "validation loss": JOB_STEPS // 5}
    _, scatter = _json(operator_client, "/console/charts/predictors/scatter")
    assert scatter["points"] == {
        "gpu-a (v1)": DEPLOYMENT_POINTS // 2,
        "gpu-b (v2)": DEPLOYMENT_POINTS // 2,
    }


def test_live_parts_match_the_page_and_change_with_the_data(
    operator_client: Client, seeded: Seeded
) -> None:
    page = operator_client.get("/console/").content.decode()
    status, body = _json(operator_client, "/console/live/fleet")
    assert status == 200 and set(body["parts"]) == {"kpis", "hosts", "deployments"}
    kpis = body["parts"]["kpis"]
    assert f'data-version="{kpis["version"]}"' in page  # unchanged data: same version
    GpuHost.objects.filter(name="gpu-c").update(status=HostStatus.ONLINE)
    _, after = _json(operator_client, "/console/live/fleet")
    assert after["parts"]["kpis"]["version"] != kpis["version"]
    assert "3 / 3" in after["parts"]["kpis"]["html"]
    assert "csrfmiddlewaretoken" not in "".join(p["html"] for p in after["parts"].values())

    _, job_parts = _json(operator_client, f"/console/live/jobs/{seeded.running_job.pk}")
    assert set(job_parts["parts"]) == {"status", "progress", "placements", "events", "checkpoints"}
    assert "Running" in job_parts["parts"]["status"]["html"]
    assert _json(operator_client, "/console/live/jobs/ftjob-nope")[0] == 404
    _, jobs = _json(operator_client, "/console/live/jobs?tenant=globex")
    assert seeded.queued_job.pk in jobs["parts"]["table"]["html"]
    assert seeded.running_job.pk not in jobs["parts"]["table"]["html"]
    _, deployment = _json(operator_client, "/console/live/deployments/chat-tiny?range=1h")
    assert "99.25%" in deployment["parts"]["kpis"]["html"]
    assert _json(operator_client, "/console/live/deployments/nope")[0] == 404
    assert _json(Client(), "/console/live/fleet")[0] == 401


def test_host_reported_text_is_escaped_in_plot_labels(operator_client: Client) -> None:
    DeploymentMetric.objects.filter(host__name="gpu-a").update(
        predictor_version='<a href="javascript:alert(1)">x</a>'
    )
    _, scatter = _json(operator_client, "/console/charts/predictors/scatter")
    names = set(scatter["points"])
    assert "gpu-a (&lt;a href=&quot;javascript:alert(1)&quot;&gt;x&lt;/a&gt;)" in names
    page = operator_client.get("/console/predictors/").content.decode()
    assert "javascript:alert(1)&quot;" in page and '<a href="javascript' not in page


def test_job_list_filters_and_progress(operator_client: Client, seeded: Seeded) -> None:
    page = operator_client.get("/console/jobs/?host=gpu-a").content.decode()
    assert seeded.running_job.pk in page and seeded.queued_job.pk not in page
    assert 'aria-valuenow="50"' in page and "ETA 2m 30s" in page
    page = operator_client.get("/console/jobs/?tenant=globex&status=queued").content.decode()
    assert seeded.queued_job.pk in page and seeded.running_job.pk not in page


def test_job_actions_go_through_the_services(operator_client: Client, seeded: Seeded) -> None:
    job = seeded.running_job
    detail = operator_client.get(f"/console/jobs/{job.pk}/").content.decode()
    assert 'data-action="pause"' in detail and 'data-action="resume"' not in detail
    response = operator_client.post(f"/console/jobs/{job.pk}/pause/")
    assert response.status_code == 302
    job.refresh_from_db()
    assert job.status == JobStatus.PAUSED
    assert job.events.filter(message="Job paused").exists()
    assert not job.placements.filter(state="active").exists()  # released by the service
    operator_client.post(f"/console/jobs/{job.pk}/resume/")
    job.refresh_from_db()
    assert job.status == JobStatus.QUEUED
    operator_client.post(f"/console/jobs/{job.pk}/cancel/")
    job.refresh_from_db()
    assert job.status == JobStatus.CANCELLED
    again = operator_client.post(f"/console/jobs/{job.pk}/cancel/", follow=True)
    assert "is cancelled; it cannot cancel" in again.content.decode()
    assert operator_client.get(f"/console/jobs/{job.pk}/cancel/").status_code == 405


def test_issue_shows_the_key_once_and_revoke_works(operator_client: Client, seeded: Seeded) -> None:
    response = operator_client.post("/console/tenants/acme/keys/", {"name": "laptop"})
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    page = response.content.decode()
    key = ApiKey.objects.get(name="laptop")
    start = page.index('id="issued-key-value">') + len('id="issued-key-value">')
    clear = page[start : page.index("</pre>", start)]
    assert clear.startswith(key.prefix) and len(clear) == 43
    assert clear not in operator_client.get("/console/tenants/").content.decode()
    operator_client.post(f"/console/keys/{key.pk}/revoke/")
    key.refresh_from_db()
    assert key.revoked_at is not None


def test_tenants_page_counts_active_keys_and_jobs_apart(
    operator_client: Client, seeded: Seeded
) -> None:
    """acme has two jobs and, after this, two keys of which one is revoked: 1 active key, 2
    jobs (keys and jobs joined and counted without distinct show 2 active keys)."""
    from api.services.apikeys import api_key_issue_for_tenant, api_key_revoke

    revoked = api_key_issue_for_tenant(tenant=seeded.tenant, name="old").api_key
    api_key_revoke(prefix_or_id=str(revoked.pk))
    assert FinetuneJob.objects.filter(tenant=seeded.tenant).count() == 2
    page = operator_client.get("/console/tenants/").content.decode()
    row = page[page.index('<tr data-tenant="acme">') :]
    row = row[: row.index("</tr>")]
    cells = re.findall(r'<td class="num">(?:<a [^>]*>)?(\d+)', row)
    assert cells == ["1", "2"], row


def test_tenant_creation_and_its_errors(operator_client: Client) -> None:
    assert operator_client.post("/console/tenants/", {"name": "initech"}).status_code == 302
    assert User.objects.filter(username="tenant.initech", role=UserRole.TENANT).exists()
    taken = operator_client.post("/console/tenants/", {"name": "initech"})
    assert taken.status_code == 400 and "already exists" in taken.content.decode()
    bad = operator_client.post("/console/tenants/", {"name": "Bad Name"})
    assert bad.status_code == 400 and "Invalid tenant name" in bad.content.decode()


def test_drain_a_host_and_return_it_to_service(operator_client: Client, seeded: Seeded) -> None:
    from tests.api.services.conftest import heartbeat

    heartbeat("gpu-a")
    page = operator_client.get("/console/hosts/").content.decode()
    assert "/console/hosts/gpu-a/drain/" in page and "/console/hosts/gpu-a/undrain/" not in page
    assert operator_client.post("/console/hosts/gpu-a/drain/").status_code == 302
    assert GpuHost.objects.get(name="gpu-a").status == HostStatus.DRAINING
    page = operator_client.get("/console/hosts/").content.decode()
    assert "/console/hosts/gpu-a/undrain/" in page and "/console/hosts/gpu-a/drain/" not in page
    back = operator_client.post("/console/hosts/gpu-a/undrain/", follow=True)
    assert back.status_code == 200
    assert "Host gpu-a is online: it takes new jobs again." in back.content.decode()
    assert GpuHost.objects.get(name="gpu-a").status == HostStatus.ONLINE
    assert operator_client.post("/console/hosts/nope/undrain/").status_code == 404


def test_host_page_shows_its_predictor_and_harvest_estimate(
    operator_client: Client, seeded: Seeded
) -> None:
    from tests.api.services.conftest import heartbeat

    before = operator_client.get("/console/hosts/gpu-a/").content.decode()
    assert "no heartbeat yet" in before
    harvest = {"source": "predictor", "finetune_fraction": 0.75, "mode": "spatial 0.75",
               "solo_tokens_per_s": 12000.0, "solo_source": "prior"}  # fmt: skip
    applied = heartbeat(
        "gpu-a", harvestable_tokens_per_s=9000.0, harvest=harvest,
        predictor_version="v20261130T095333Z", predictor_mape=0.032,
    )  # fmt: skip
    assert applied == "applied"
    page = operator_client.get("/console/hosts/gpu-a/").content.decode()
    assert "v20261130T095333Z · held-out MAPE 3.2%" in page
    assert ">9,000<" in page
    assert "75.0% of the device (spatial 0.75) × solo rate 12,000 tokens/s (prior)" in page
    listing = operator_client.get("/console/hosts/").content.decode()
    assert "v20261130T095333Z" in listing and "3.2%" in listing


def test_forms_need_the_csrf_token(seeded: Seeded) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(User.objects.get(username="ops"))
    response = client.post(f"/console/jobs/{seeded.running_job.pk}/cancel/")
    assert response.status_code == 403
    seeded.running_job.refresh_from_db()
    assert seeded.running_job.status == JobStatus.RUNNING


def test_empty_fleet_shows_empty_states(db: None) -> None:
    from api.services.tenants import operator_create

    operator_create(username="solo", password="pw-solo-1")
    client = Client()
    client.login(username="solo", password="pw-solo-1")
    fleet = client.get("/console/").content.decode()
    assert 'id="empty-hosts"' in fleet and "No deployments yet" in fleet
    assert 'id="empty-jobs"' in client.get("/console/jobs/").content.decode()
    status, body = _json(client, "/console/charts/fleet/memory")
    assert status == 200 and body["empty"] and body["message"] == "No hosts registered yet."


def test_a_stalled_job_shows_stalled_not_running(operator_client: Client, seeded: Seeded) -> None:
    """Reconciliation's stall flag replaces the Running badge on the list and the job page,
    and goes once the flag is cleared."""
    job = seeded.running_job
    stalled = FinetuneJob.objects.filter(pk=job.pk)
    stalled.update(stalled_at=seeded.now)
    listing = operator_client.get("/console/jobs/?host=gpu-a").content.decode()
    row = listing[listing.index(f'data-job="{job.pk}"') :]
    row = row[: row.index("</tr>")]
    assert 'class="badge badge-stalled"' in row and ">Stalled</span>" in row
    assert "badge-running" not in row
    detail = operator_client.get(f"/console/jobs/{job.pk}/").content.decode()
    status = detail[detail.index('id="job-status"') :]
    assert status[: status.index("</span>")].endswith(">Stalled")
    assert "badge-stalled" in status[:200]
    stalled.update(stalled_at=None)
    listing = operator_client.get("/console/jobs/?host=gpu-a").content.decode()
    assert "badge-stalled" not in listing and "badge-running" in listing


def test_job_page_shows_what_auto_settings_became(operator_client: Client, seeded: Seeded) -> None:
    """The settings card shows a host's resolved value beside "auto", as the API does."""
    job = seeded.running_job
    FinetuneJob.objects.filter(pk=job.pk).update(
        hyperparameters={"n_epochs": 3, "batch_size": "auto", "learning_rate_multiplier": "auto"},
        resolved_hyperparameters=None,
    )

    def settings() -> str:
        page = operator_client.get(f"/console/jobs/{job.pk}/").content.decode()
        card = page[page.index("<h2>Settings</h2>") :]
        return card[: card.index("</dl>")]

    before = settings()
    assert "<dt>Epochs</dt><dd>3</dd>" in before
    assert "<dt>Batch size</dt><dd>auto</dd>" in before  # no host has resolved it yet
    FinetuneJob.objects.filter(pk=job.pk).update(
        resolved_hyperparameters={"n_epochs": 3, "batch_size": 4, "learning_rate_multiplier": 2.0}
    )
    after = settings()
    assert "<dt>Batch size</dt><dd>4 (auto)</dd>" in after
    assert "<dt>LR multiplier</dt><dd>2.0 (auto)</dd>" in after
