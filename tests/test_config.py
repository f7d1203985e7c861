import dataclasses
import warnings

import pytest

from inferscale import BackendSpec, Config, ConfigError, ModelSpec, UnknownBackendError
from inferscale.config import Tuning


def test_defaults_round_trip_through_dict():
    config = Config()
    assert Config.from_dict(config.to_dict()) == config


def test_from_dict_accepts_names_and_tables():
    config = Config.from_dict({"retriever": "faiss", "kv_store": {"name": "disk", "options": {"root": "/x"}}})
    assert config.retriever == BackendSpec("faiss")
    assert config.kv_store.options["root"] == "/x"


def test_unknown_key_lists_known_keys():
    with pytest.raises(ConfigError, match="retreiver.*known"):
        Config.from_dict({"retreiver": "exact"})


def test_backend_table_rejects_extra_keys():
    with pytest.raises(ConfigError, match="takes 'name' and 'options'"):
        Config.from_dict({"retriever": {"name": "exact", "k": 3}})


def test_config_is_frozen():
    config = Config()
    with pytest.raises(AttributeError):
        config.top_k = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.retriever.options["x"] = 1  # type: ignore[index]


def test_from_toml(tmp_path):
    path = tmp_path / "inferscale.toml"
    path.write_text(
        'top_k = 20\ndata_dir = "/srv/mem"\n[model]\npath = "/models/q"\ndtype = "bfloat16"\n'
        '[retriever]\nname = "faiss"\noptions = { kind = "hnsw" }\n'
    )
    config = Config.from_toml(path)
    assert config.top_k == 20 and config.model == ModelSpec(path="/models/q", dtype="bfloat16")
    assert config.retriever == BackendSpec("faiss", {"kind": "hnsw"})


def test_bad_toml_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("top_k = = 3")
    with pytest.raises(ConfigError, match="bad.toml"):
        Config.from_toml(path)


def test_from_env_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("top_k = 7\n")
    env = {"INFERSCALE_CONFIG": str(path), "INFERSCALE_RETRIEVER": "faiss", "INFERSCALE_DATA_DIR": "/d"}
    config = Config.from_env(env)
    assert (config.top_k, config.retriever.name, config.data_dir) == (7, "faiss", "/d")
    with pytest.raises(ConfigError, match="INFERSCALE_TOP_K"):
        Config.from_env({"INFERSCALE_TOP_K": "many"})


@pytest.mark.parametrize("bad", [{"top_k": 0}, {"model": {"dtype": "int8"}}, {"retriever": 3}, {"model": {"file": "x"}},
                                 {"tuning": 3}, {"tuning": {"fused": True}}])
def test_invalid_values(bad):
    with pytest.raises(ConfigError):
        Config.from_dict(bad)


BAD_TUNING = [{"pinned_reads": "zero-copy"}, {"fused_write": "yes"}, {"write_graphs": 1}, {"pinned_read_graphs": "on"},
              {"pinned_read_programs": -1}, {"pinned_read_programs": True},
              {"pinned_read_launches": 0}, {"pinned_read_launches": 2.5},
              {"pinned_copy_below_mib": -1}, {"pinned_copy_below_mib": "32"},
              {"pinned_copy_below_mib": float("nan")}, {"pinned_copy_below_mib": True},
              {"pinned_copy_above_mib": -1}, {"pinned_copy_above_mib": float("inf")}, {"pinned_copy_above_mib": "1g"},
              {"user_read_threads": 0}, {"user_read_threads": "4"}, {"user_read_threads": True}]


@pytest.mark.parametrize("bad", BAD_TUNING)
def test_invalid_tuning(bad):
    with pytest.raises(ConfigError, match="tuning"):
        Tuning(**bad)
    with pytest.raises(ConfigError, match="tuning"):
        Config.from_dict({"tuning": bad})


def test_tuning_is_its_own_table(tmp_path):
    path = tmp_path / "inferscale.toml"
    path.write_text('top_k = 4\n[tuning]\npinned_reads = "copy"\npinned_read_launches = 2\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = Config.from_toml(path)
    assert config.tuning == Tuning(pinned_reads="copy", pinned_read_launches=2)
    assert config.to_dict()["tuning"]["pinned_reads"] == "copy"
    assert Config.from_dict(config.to_dict()) == config
    assert Config(tuning={"write_graphs": False}).tuning == Tuning(write_graphs=False)
    assert "fused_write" not in Config().to_dict()  # the user's settings stay apart from the knobs


def test_flat_tuning_keys_still_load_with_a_deprecation_warning(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text('top_k = 4\nfused_write = false\npinned_copy_below_mib = 0\n')
    with pytest.warns(DeprecationWarning, match=r"old.toml: top-level key\(s\) fused_write, pinned_copy_below_mib.*\[tuning\]") as caught:
        config = Config.from_toml(path)
    assert len(caught) == 1 and caught[0].filename == __file__
    assert config.tuning == Tuning(fused_write=False, pinned_copy_below_mib=0)
    with pytest.warns(DeprecationWarning, match="pinned_reads"):
        assert Config.from_dict({"pinned_reads": "copy", "tuning": {"write_graphs": False}}).tuning == Tuning(
            pinned_reads="copy", write_graphs=False)
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="both"):
        Config.from_dict({"fused_write": False, "tuning": {"fused_write": True}})
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="tuning pinned_reads"):
        Config.from_dict({"pinned_reads": "zero-copy"})


def test_flat_tuning_keyword_arguments_still_work_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="keyword.*write_graphs") as caught:
        config = Config(top_k=3, write_graphs=False)
    assert caught[0].filename == __file__  # the warning points at the caller
    assert config.tuning == Tuning(write_graphs=False) and config.top_k == 3
    with pytest.warns(DeprecationWarning):
        assert Config(tuning=Tuning(pinned_reads="copy"), fused_write=False).tuning == Tuning(
            pinned_reads="copy", fused_write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dataclasses.replace(config, top_k=5).tuning == config.tuning


def test_a_misspelled_backend_in_toml_is_refused_on_load(tmp_path):
    path = tmp_path / "inferscale.toml"
    path.write_text('[kv_store]\nname = "pinnned"\n[retriever]\nname = "faiss"\n')
    with pytest.raises(UnknownBackendError, match=r"kv_store 'pinnned' is not registered — known: disk, hbm, ") as err:
        Config.from_toml(path)
    assert {"disk", "hbm", "pinned"} <= set(err.value.known)  # and any an installed plugin adds
    path.write_text('composer = "relevence"\n')
    with pytest.raises(ConfigError, match="relevence.*relevance"):
        Config.from_toml(path)


@pytest.mark.parametrize("kind", ["retriever", "kv_store", "window", "composer", "embedder"])
def test_every_backend_section_is_checked_on_load(kind):
    with pytest.raises(UnknownBackendError) as err:
        Config.from_dict({kind: "no-such-backend"})
    assert err.value.kind == kind and err.value.known
    with pytest.raises(UnknownBackendError):
        Config.from_env({f"INFERSCALE_{kind.upper()}": "no-such-backend"})
