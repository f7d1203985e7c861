import pytest

from inferscale import BackendSpec, Config, ConfigError, ModelSpec


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
                                 {"pinned_reads": "zero-copy"}, {"fused_write": "yes"}, {"write_graphs": 1},
                                 {"pinned_read_graphs": "on"},
                                 {"pinned_read_programs": -1}, {"pinned_read_programs": True},
                                 {"pinned_read_launches": 0}, {"pinned_read_launches": 2.5},
                                 {"pinned_copy_below_mib": -1}, {"pinned_copy_below_mib": "32"},
                                 {"pinned_copy_below_mib": float("nan")}, {"pinned_copy_below_mib": True}])
def test_invalid_values(bad):
    with pytest.raises(ConfigError):
        Config.from_dict(bad)
