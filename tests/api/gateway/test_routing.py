"""The routing order over hosts' reports: exact rankings and reasons."""

from __future__ import annotations

from api.gateway.routing import HostCandidate, rank_hosts

BASE = "tiny"
ADAPTER = "ft:tiny:acme::job-1"


def host(name: str, **fields: object) -> HostCandidate:
    values: dict[str, object] = {
        "base_model": BASE, "server_url": f"http://{name}/v1", "kv_free_pages": 50,
        "kv_total_pages": 64, "attainment_target": 0.99, "tpot_slo_ms": 50.0,
    }  # fmt: skip
    values.update(fields)
    return HostCandidate(name=name, **values)  # type: ignore[arg-type]


def order(hosts: list[HostCandidate], model: str = BASE, **kwargs: object) -> list[str]:
    ranked = rank_hosts(hosts, base_model=BASE, model=model,
                        open_requests=kwargs.pop("open", {}), **kwargs)  # type: ignore[arg-type]  # fmt: skip
    return [c.host.name for c in ranked]


def test_only_hosts_of_the_base_model_are_candidates() -> None:
    assert order([host("a", base_model="other"), host("b")]) == ["b"]
    assert order([host("a", base_model="other")]) == []


def test_least_loaded_first_by_running_and_waiting() -> None:
    hosts = [host("a", running=5), host("b", running=2), host("c", running=3)]
    assert order(hosts) == ["b", "c", "a"]


def test_the_gateways_own_open_requests_count_when_they_exceed_the_report() -> None:
    hosts = [host("a", running=1), host("b", running=2)]
    assert order(hosts, open={"a": 4}) == ["b", "a"]
    assert order(hosts, open={"a": 1}) == ["a", "b"]


def test_resident_adapter_is_preferred_over_a_less_loaded_host() -> None:
    hosts = [
        host("a", running=0, adapters=frozenset({ADAPTER})),
        host("b", running=6, adapters=frozenset({ADAPTER}), resident_adapters=frozenset({ADAPTER})),
    ]
    assert order(hosts, model=ADAPTER) == ["b", "a"]


def test_a_host_that_serves_the_adapter_beats_one_that_does_not_report_it() -> None:
    hosts = [host("a", running=0), host("b", running=9, adapters=frozenset({ADAPTER}))]
    assert order(hosts, model=ADAPTER) == ["b", "a"]


def test_saturated_hosts_come_after_hosts_with_room_even_when_resident() -> None:
    served = frozenset({ADAPTER})
    hosts = [
        host("a", waiting=3, adapters=served, resident_adapters=served),
        host("b", running=4, adapters=served),
        host("c", kv_free_pages=0, adapters=served, resident_adapters=served),
    ]
    assert order(hosts, model=ADAPTER) == ["b", "c", "a"]  # then by load (c: 0, a: 3)


def test_a_host_under_its_attainment_target_gets_requests_only_when_no_other_can() -> None:
    hosts = [host("a", slo_attainment=0.95), host("b", running=30, slo_attainment=0.999)]
    assert order(hosts) == ["b", "a"]
    assert order([host("a", slo_attainment=0.95)]) == ["a"]


def test_ejected_hosts_rank_last_then_ties_break_by_free_kv_tpot_and_name() -> None:
    hosts = [host("a"), host("b", kv_free_pages=10), host("c", tpot_p50_ms=40.0), host("d")]
    assert order(hosts) == ["a", "d", "c", "b"]
    assert order(hosts, ejected=frozenset({"a"})) == ["d", "c", "b", "a"]


def test_reasons_name_what_decided() -> None:
    served = frozenset({ADAPTER})
    ranked = rank_hosts(
        [host("a", running=2, adapters=served, resident_adapters=served, tpot_p50_ms=12.5),
         host("b", slo_attainment=0.5)],
        base_model=BASE, model=ADAPTER, open_requests={},
    )  # fmt: skip
    assert [c.reason for c in ranked] == [
        "model resident; load 2; kv free 50/64; tpot p50 12.5 ms",
        "attainment 0.500 under target 0.990; does not report the model; load 0; kv free 50/64",
    ]
