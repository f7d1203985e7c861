"""The planner checks a server-made request's salt before it reads the store: a forged request is
refused the same way whether its user, its facts or neither exist."""

from __future__ import annotations

import pytest

from inferscale.compose.request import make_params, parse_params
from inferscale.compose.salt import CacheSalts
from inferscale.inject.planner import plan_request
from inferscale.inject.report import Fallback

SALTS = CacheSalts(b"k" * 32)


class NoReads:
    """A store whose every read is a fault: the planner must not reach one."""

    def __getattr__(self, name):
        raise AssertionError(f"the planner read the store ({name}) before checking the salt")


@pytest.mark.parametrize("salt", [None, "inferscale-" + "0" * 32, "x"])
def test_a_forged_salt_is_refused_before_any_lookup(salt):
    params = make_params("nobody", ["f-0123456789abcdef"], epoch="e1", segment_tokens=3)
    plan = plan_request(NoReads(), SALTS, [1, 2, 3, 4, 5], params, salt, 0)
    assert plan.fallback is Fallback.MISSING_CACHE_SALT and plan.num_external == 0


def test_the_salt_of_the_prompts_head_is_the_servers_salt():
    request = parse_params(make_params("ann", ["f1"], epoch="e1", segment_tokens=3))
    assert request.salt_of_head(SALTS, [7, 8, 9, 10]) == SALTS.segment("ann", "e1", [7, 8, 9])


@pytest.mark.parametrize("body", [{"epoch": "e1"}, {"segment_tokens": 3}, {"epoch": 5, "segment_tokens": 3},
                                  {"epoch": "e" * 65, "segment_tokens": 3}, {"epoch": "e1", "segment_tokens": 0}])
def test_epoch_and_segment_length_come_together_and_well_formed(body):
    from inferscale.compose.request import InvalidParams

    with pytest.raises(InvalidParams):
        parse_params({"inferscale": {"user_id": "ann", "fact_ids": ["f1"], **body}})


@pytest.mark.parametrize("name", [".", ".."])
def test_dot_names_are_not_ids(name):
    from inferscale.compose.request import InvalidParams

    with pytest.raises(InvalidParams, match="usable name"):
        parse_params({"inferscale": {"user_id": name, "fact_ids": ["f1"]}})
    with pytest.raises(InvalidParams, match="usable name"):
        parse_params({"inferscale": {"user_id": "ann", "fact_ids": ["f1", name]}})
