"""kv_transfer_params parsing: valid shapes pass, everything else is rejected with a reason."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.compose.request import MAX_FACTS, InvalidParams, SegmentRequest, make_params, parse_params

ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,30}", fullmatch=True)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@given(user=ids, facts=st.lists(ids, unique=True, max_size=50))
@settings(max_examples=200, deadline=None)
def test_valid_params_round_trip(user, facts):
    assert parse_params(make_params(user, facts)) == SegmentRequest(user, tuple(facts))


@given(value=json_values)
@settings(max_examples=300, deadline=None)
def test_arbitrary_values_never_crash(value):
    for params in (value, {"inferscale": value}, {"inferscale": {"user_id": value, "fact_ids": ["a"]}},
                   {"inferscale": {"user_id": "u", "fact_ids": value}}):
        try:
            result = parse_params(params)
        except InvalidParams as exc:
            assert str(exc)
        else:
            assert result is None or isinstance(result, SegmentRequest)


@pytest.mark.parametrize(
    "params, reason",
    [
        ("alice", "must be a dict"),
        ({"inferscale": ["alice"]}, "must be a dict"),
        ({"inferscale": {"user_id": "alice"}}, "fact_ids must be a list"),
        ({"inferscale": {"user_id": "alice", "fact_ids": "f-1"}}, "fact_ids must be a list"),
        ({"inferscale": {"user_id": 7, "fact_ids": []}}, "user_id"),
        ({"inferscale": {"user_id": "alice\n", "fact_ids": []}}, "user_id"),
        ({"inferscale": {"user_id": "_system", "fact_ids": []}}, "reserved"),
        ({"inferscale": {"user_id": "a", "fact_ids": ["x", "x"]}}, "duplicates"),
        ({"inferscale": {"user_id": "a", "fact_ids": [1]}}, "fact_id"),
        ({"inferscale": {"user_id": "a", "fact_ids": ["ok", "f1\n"]}}, "fact_id.*'f1\\\\n'"),
        ({"inferscale": {"user_id": "a", "fact_ids": ["ok", "f 1"]}}, "fact_id"),
        ({"inferscale": {"user_id": "a", "fact_ids": ["ok"], "k": 3}}, "unknown key"),
        ({"inferscale": {"user_id": "a", "fact_ids": [f"f{i}" for i in range(MAX_FACTS + 1)]}}, "at most"),
    ],
)
def test_malformed_params_give_a_reason(params, reason):
    with pytest.raises(InvalidParams, match=reason):
        parse_params(params)


def test_requests_without_memory():
    assert parse_params(None) is None
    assert parse_params({}) is None
    assert parse_params({"other_connector": {"x": 1}}) is None


@given(st.lists(st.text(alphabet="ab_ .\n:-/é", max_size=6) | st.integers(), max_size=6))
@settings(max_examples=400, deadline=None)
def test_checking_ids_together_agrees_with_checking_each(values):
    """The scheduler checks a request's fact ids in one pass; it refuses exactly what checking
    them one by one refuses, and names the first bad one."""
    from inferscale.facts import check_id, check_id_list

    bad = []
    for value in values:
        try:
            check_id(value, "fact_id")
        except ValueError as exc:
            bad.append(str(exc))
    if bad:
        with pytest.raises(ValueError) as caught:
            check_id_list(values, "fact_id")
        assert str(caught.value) == bad[0]
    else:
        check_id_list(values, "fact_id")

