"""The front's allow-list of engine routes (:mod:`inferscale.server.engine.allowed_routes`), both sides:
what it passes on (each route with its method, however the path is written) and what it refuses.
The live front is probed in tests/test_server_exposure.py."""

from __future__ import annotations

from urllib.parse import quote

import pytest

from inferscale.server.engine.allowed_routes import allowed_route, normalized

#: the engine's routes a client reaches through the front, with the one method each takes
PASSED = [("/v1/models", "GET"), ("/v1/completions", "POST"), ("/v1/embeddings", "POST"), ("/tokenize", "POST"),
          ("/detokenize", "POST"), ("/version", "GET")]
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH")


@pytest.mark.parametrize("route, method", PASSED)
def test_each_listed_route_passes_with_its_method_only(route, method):
    assert allowed_route(route, method) == route
    for other in set(METHODS) - {method}:
        assert allowed_route(route, other) is None, other
    assert allowed_route(route, method.lower()) is None  # methods are matched as HTTP spells them


@pytest.mark.parametrize("written, route", [
    ("/v1/./models", "/v1/models"), ("/v1//models", "/v1/models"), ("//tokenize", "/tokenize"),
    ("/v1/completions/", "/v1/completions"), ("/%76%31/embeddings", "/v1/embeddings"),
    ("/v1/x/../embeddings", "/v1/embeddings"), ("/../../version", "/version"), ("/detokenize/.", "/detokenize")])
def test_a_route_written_another_way_passes_as_the_listed_path(written, route):
    method = dict(PASSED)[route]
    assert allowed_route(written, method) == route  # forwarded as the listed path, not as written


@pytest.mark.parametrize("path", ["/load", "/v1/../load", "/v1/%2e%2e/load", "/v1/..%2Fload", "/v1/%252e%252e/load",
                                  "/v1", "/", "", "/v1/models/x", "/v1/modelsx", "/tokenize%00", "/v1%5C..%5Cload",
                                  "/v1/chat/completions", "/metrics", "/health"])
def test_anything_else_is_refused_whatever_the_method(path):
    assert all(allowed_route(path, method) is None for method in METHODS)


def test_a_path_is_decoded_until_it_no_longer_changes_within_the_rounds_allowed():
    """Encoded three times: three rounds decode it and a fourth sees it unchanged. Encoded four
    times: still changing after the fourth round, so refused as obfuscated."""
    thrice = quote(quote(quote("/v1/models", safe=""), safe=""), safe="")
    assert normalized(thrice) == "/v1/models" and allowed_route(thrice, "GET") == "/v1/models"
    four_times = quote(thrice, safe="")
    assert normalized(four_times) is None and allowed_route(four_times, "GET") is None


@pytest.mark.parametrize("path", ["/v1\\models", "/v1%5cmodels", "/v1/models\x00", "/v1/models%00", "/v1/%2500",
                                  "v1/models", "%2e%2e/v1/models", "%76%31/models"])
def test_a_backslash_a_nul_or_a_relative_path_is_not_a_route(path):
    assert normalized(path) is None


def test_dot_segments_resolve_and_never_climb_above_the_root():
    assert normalized("/v1/../load") == "/load"
    assert normalized("/v1/%2e%2e/%2e%2e/%2e%2e/load") == "/load"
    assert normalized("//v1/./x/..//models") == "/v1/models"
    assert normalized("/%2Fv1/models") == "/v1/models"


def test_bytes_that_are_not_utf_8_are_refused():
    with pytest.raises(UnicodeDecodeError):
        normalized("/v1/%ff")
    assert allowed_route("/v1/%ff", "GET") is None and allowed_route("/v1/models%c3", "GET") is None
