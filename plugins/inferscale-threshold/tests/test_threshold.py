import pytest

pytest.importorskip("inferscale_threshold", reason="pip install ./plugins/inferscale-threshold")

from inferscale import BackendSpec, ConfigError, build  # noqa: E402
from inferscale.retrieval.base import Hit  # noqa: E402


def test_selectable_by_name_through_the_entry_point():
    composer = build("composer", BackendSpec("threshold", {"min_score": 0.5}))
    assert type(composer).__module__ == "inferscale_threshold.composer"


def test_keeps_facts_above_threshold_most_relevant_last():
    composer = build("composer", BackendSpec("threshold", {"min_score": 0.5, "max_facts": 2}))
    hits = [Hit("a", 0.9), Hit("b", 0.4), Hit("c", 0.7), Hit("d", 0.6)]
    assert composer.order(hits) == ["c", "a"]


def test_bad_option_is_a_config_error():
    with pytest.raises(ConfigError, match="max_facts"):
        build("composer", BackendSpec("threshold", {"max_facts": -1}))
