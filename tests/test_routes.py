"""The public port's routes: path tricks aimed at the engine's administrative routes are
refused (or read as a refused route), every serving route is still forwarded, and the
path checked is the path sent."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from yarl import URL

from supervisor.front.routes import ADMIN, SERVING, PathRefused, Routes, read_target, route_problem

ROUTES = Routes.serving()


def verdict(raw: str, routes: Routes = ROUTES) -> tuple[int, str]:
    """(status, reason) as the proxy would answer before forwarding; 0 = forwarded."""
    try:
        target = read_target(raw)
        routes.check(target.path)
    except PathRefused as exc:
        return exc.status, exc.reason
    return 0, target.upstream_path_qs


# The tricks and their relatives, each aimed at /sleep.
TRICKS = {
    "/v1/../sleep": (400, "bad_path"),
    "/v1/./../sleep": (400, "bad_path"),
    "/v1/%2e%2e/sleep": (400, "bad_path"),
    "/v1/%2E%2E/sleep": (400, "bad_path"),
    "/v1/.%2e/sleep": (400, "bad_path"),
    "/v1%2F..%2Fsleep": (400, "bad_path"),
    "/v1%2f..%2fsleep": (400, "bad_path"),
    "/v1/..%2Fsleep": (400, "bad_path"),
    "//sleep": (400, "bad_path"),
    "/v1//../sleep": (400, "bad_path"),
    "/v1\\..\\sleep": (400, "bad_path"),
    "/v1/..%5Csleep": (400, "bad_path"),
    "/%76%31/../sleep": (400, "bad_path"),
    "/v1/%252e%252e/sleep": (400, "bad_path"),
    "/V1/../SLEEP": (400, "bad_path"),
    "/SLEEP": (403, "admin_route"),
    "/Sleep?level=1": (403, "admin_route"),
    "/v1/sleep": (403, "admin_route"),
    "/%73leep": (403, "admin_route"),
    "/sleep/.": (400, "bad_path"),
    "/v1/completions/.": (400, "bad_path"),
    "/v1/completions/..": (400, "bad_path"),
    "/sleep%00": (400, "bad_path"),
    "/sleep%": (400, "bad_path"),
    "/sleep%zz": (400, "bad_path"),
    "/v1/completions#/../../sleep": (400, "bad_path"),
    "http://127.0.0.1:8100/sleep": (400, "bad_path"),
    "*": (400, "bad_path"),
    "/v1/%ff": (400, "bad_path"),
}


@pytest.mark.parametrize(("raw", "expected"), TRICKS.items())
def test_a_path_trick_is_refused(raw, expected):
    assert verdict(raw) == expected


@pytest.mark.parametrize("admin", ["/sleep", "/wake_up", "/reset_prefix_cache",
                                   "/server_info", "/collective_rpc", "/scale_elastic_ep",
                                   "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
                                   "/abort_requests", "/inference/v1/abort_requests",
                                   "/start_profile", "/update_weights", "/is_sleeping"])
def test_the_engines_administrative_routes_are_403_and_their_tricks_400(admin):
    assert verdict(admin) == (403, "admin_route")
    name = admin.rsplit("/", 1)[1]
    for trick in (f"/v1/../{name}", f"/v1/%2e%2e/{name}", f"/v1%2F..%2F{name}",
                  f"//{name}", f"/v1\\..\\{name}", f"/{name}/."):
        assert verdict(trick) == (400, "bad_path"), trick


@pytest.mark.parametrize("route", SERVING)
def test_every_serving_route_is_still_forwarded_as_it_is(route):
    path = route.replace("*", "resp_0123abc")
    assert verdict(path) == (0, path)
    assert verdict(path + "?a=1&b=/../sleep") == (0, path + "?a=1&b=/../sleep")


@pytest.mark.parametrize("raw", ["/metrics", "/docs", "/openapi.json", "/load",
                                 "/tokenizer_info", "/v1", "/v1/", "/v1/completions/",
                                 "/V1/completions", "/v1/Completions", "/", "/v1/responses//cancel",
                                 "/v1/completions;x", "/v1/models/x"])
def test_anything_else_is_not_forwarded(raw):
    status, reason = verdict(raw)
    assert (status, reason) in ((404, "not_allowed"), (400, "bad_path")), raw


def test_a_percent_encoded_serving_route_is_decoded_once_and_sent_canonical():
    assert verdict("/v1/%63ompletions") == (0, "/v1/completions")
    assert verdict("/v1/responses/r%20x") == (0, "/v1/responses/r%20x")
    assert verdict("/v1/responses/caf%C3%A9") == (0, "/v1/responses/caf%C3%A9")


def test_the_query_is_forwarded_as_received_and_never_part_of_the_route():
    assert verdict("/v1/models?x=%2e%2e/sleep") == (0, "/v1/models?x=%2e%2e/sleep")
    assert verdict("/v1/models?") == (0, "/v1/models")  # an empty query is none
    assert verdict("/sleep?x=/v1/models") == (403, "admin_route")
    assert verdict("/v1/models?a b") == (400, "bad_path")


def test_extra_routes_are_exact_routes_with_one_segment_wildcards():
    routes = Routes.serving(["/custom/run", "/jobs/*/status"])
    assert verdict("/custom/run", routes) == (0, "/custom/run")
    assert verdict("/jobs/42/status", routes) == (0, "/jobs/42/status")
    assert verdict("/custom/run/more", routes) == (404, "not_allowed")
    assert verdict("/custom/run/../../sleep", routes) == (400, "bad_path")
    assert verdict("/jobs//status", routes) == (400, "bad_path")


@pytest.mark.parametrize(("route", "why"), [
    ("custom", "starts with /"),
    ("/custom/", "not a prefix"),
    ("/v1/../sleep", "dot segments"),
    ("/a//b", "empty path segments"),
    ("/a?b=1", "no query string"),
    ("/a%2Fb", "slashes"),
    ("/caf%C3%A9", "without percent-encoding"),
    ("/jobs/x*", "whole segment"),
    ("/v1/load_lora_adapter", "administrative"),
    ("/a b", "must be percent-encoded"),
])
def test_a_bad_extra_route_names_what_is_wrong(route, why):
    problem = route_problem(route)
    assert problem is not None and why in problem


def test_good_extra_routes_pass():
    assert route_problem("/custom/run") is None
    assert route_problem("/jobs/*/status") is None


def test_the_admin_names_are_lower_case_route_names():
    assert all(name == name.lower() and "/" not in name for name in ADMIN)


PIECES = [*"/.%\\25eEfF2cC?#v1 x\u00e9", "sleep", "%2e", "%2E", "%2F", "%5C", "%25", "//"]


@given(st.lists(st.sampled_from(PIECES), max_size=16).map(lambda p: "/" + "".join(p)))
def test_what_is_accepted_reads_the_same_to_a_normalising_server(raw):
    """For any target the proxy accepts, the path it sends reads back to the path it
    checked, both to this module and to a URL library that resolves dot segments and
    decodes percent-escapes (as many servers do): no second reading can differ."""
    try:
        target = read_target(raw)
    except PathRefused:
        return
    sent = target.upstream_path_qs
    assert read_target(sent).path == target.path
    assert URL("http://engine" + sent).path == target.path
    assert URL("http://engine" + sent, encoded=True).raw_path_qs == sent
