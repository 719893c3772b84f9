"""Typed config: defaults, presets, every bound, cross-field checks, unknown keys, overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from lockserve.configs import (
    CacheConfig,
    ConfigError,
    SchedulerConfig,
    ServeConfig,
    default_config_path,
    load_config,
    parse_override,
)

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def write_yaml(tmp_path: Path, data, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_packaged_defaults_equal_schema_defaults():
    # serve.yaml ships the schema's defaults: a drift between the two would be a silent surprise.
    assert default_config_path().is_file(), default_config_path()
    assert load_config() == ServeConfig(), "configs/serve.yaml differs from the schema defaults"


def test_default_values_are_the_design_values():
    cfg = load_config()
    assert (cfg.cache.page_size, cfg.cache.rank, cfg.cache.basis_bits) == (16, 8, 4)
    assert cfg.cache.budget_tokens == 512 and cfg.cache.attention == "locks"
    assert cfg.server.host == "127.0.0.1" and cfg.server.api_key is None
    assert cfg.model.source == "default" and cfg.ray.address is None


def test_every_shipped_yaml_loads():
    files = sorted(REPO_CONFIGS.glob("serve*.yaml"))
    assert len(files) >= 2, files
    for path in files:
        assert isinstance(load_config(path), ServeConfig), path


def test_cpu_preset_is_cpu_only():
    cfg = load_config(REPO_CONFIGS / "serve-cpu.yaml")
    assert cfg.ray.cpu_only and cfg.model.device == "cpu"
    assert cfg.cache.hot_cache_slots(on_gpu=False) == 0, "a hot cache on CPU only copies host memory"


def test_every_field_has_a_description():
    for section in ServeConfig.model_fields.values():
        model = section.annotation
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_the_kernel_choices_are_the_engines():
    from typing import get_args

    from lockserve.configs.schema import KERNELS, Kernels
    from lockserve.workers.engine.attention import KERNEL_CHOICES

    assert KERNELS == get_args(Kernels) == KERNEL_CHOICES, "model.kernels must offer the engine's choices"


def test_the_kernel_knobs_offer_the_kernels_choices():
    from typing import get_args

    from lockserve.configs.schema import (
        CACHE_COMMITS,
        RADIX_BITS,
        SUMMARY_EIGH,
        CacheCommit,
        CacheConfig,
        RadixBits,
        SummaryEigh,
    )
    from lockserve.kernels.summary import DEFAULT_EIGH, EIGH_SOLVERS
    from lockserve.kernels.triton.select import DEFAULT_RADIX_BITS, RADIX_BITS_CHOICES
    from lockserve.offload.cache import COMMITS

    assert SUMMARY_EIGH == get_args(SummaryEigh) == EIGH_SOLVERS
    assert RADIX_BITS == get_args(RadixBits) == RADIX_BITS_CHOICES
    assert CACHE_COMMITS == get_args(CacheCommit) == COMMITS
    cc = CacheConfig()
    assert (cc.summary_eigh, cc.select_radix_bits) == (DEFAULT_EIGH, DEFAULT_RADIX_BITS)


# (dotted key, bad value, text the error must contain besides key and value)
BAD_VALUES = [
    ("cache.page_size", 0, ">= 2"),
    ("cache.page_size", 1024, "<= 256"),
    ("cache.rank", 0, ">= 1"),
    ("cache.basis_bits", 1, ">= 2"),
    ("cache.summary_eigh", "lapack", "jacobi"),
    ("cache.select_radix_bits", 3, "2"),
    ("cache.hot_cache_commit", "later", "inline"),
    ("cache.budget_tokens", -3, ">= 2"),
    ("cache.attention", "sparse", "'locks', 'dense'"),
    ("cache.basis_bits", 3, "must be one of 16, 8, 4, 2"),
    ("cache.group_rule", "max", "'share_average', 'group_max' or 'group_mass'"),
    ("cache.tier", "ssd", "'hbm', 'host' or 'host+nvme'"),
    ("cache.host_capacity_gib", 0, "must be 'auto' or a number of GiB in (0, 65536]"),
    ("cache.host_capacity_gib", "lots", "must be 'auto' or a number"),
    ("cache.hot_cache_pages", -1, "must be 'auto' or an integer in [0, 67108864]"),
    ("cache.hot_cache_pages", "many", "must be 'auto' or an integer"),
    ("scheduler.max_num_seqs", 0, ">= 1"),
    ("scheduler.prefill_chunk", 0, ">= 1"),
    ("server.port", 70000, "<= 65535"),
    ("server.port", "http", "valid integer"),
    ("server.max_body_bytes", 10, ">= 1024"),
    ("server.log_level", "loud", "'critical'"),
    ("model.dtype", "int3", "'auto'"),
    ("model.device", "tpu", "must be auto, cpu, cuda or cuda:N"),
    ("model.kernels", "triton", "'auto', 'ops' or 'reference'"),
    ("model.source", "", "at least 1 character"),
    ("ray.num_gpu_workers", 0, "must be 'auto' or an integer in [1, 4096]"),
    ("ray.num_gpu_workers", "all", "must be 'auto' or an integer"),
    ("ray.restart_backoff_s", -1, ">= 0"),
    ("server.max_body_bytes", "big", "valid integer"),
    ("scheduler.prefill_chunk", "lots", "a number with an optional unit K or M"),
    ("scheduler.prefill_attention_decoding", "1.3K", "a whole number of tokens"),
    ("model.max_model_len", 8, ">= 16"),
]


@pytest.mark.parametrize("key,value,reason", BAD_VALUES, ids=[f"{k}={v}" for k, v, _ in BAD_VALUES])
def test_bad_value_names_field_and_value_from_file(tmp_path, key, value, reason):
    section, field = key.split(".")
    path = write_yaml(tmp_path, {section: {field: value}})
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert key in message and repr(value) in message and reason in message, message
    assert str(path) in message, f"the file is not named: {message}"


@pytest.mark.parametrize("key,value,reason", BAD_VALUES[:6], ids=[f"{k}={v}" for k, v, _ in BAD_VALUES[:6]])
def test_bad_value_from_overrides_names_overrides(key, value, reason):
    with pytest.raises(ConfigError) as info:
        load_config(overrides={key: value})
    message = str(info.value)
    assert f"overrides: {key} = {value!r}" in message and reason in message, message


CROSS_FIELD = [
    ({"scheduler": {"max_num_seqs": 4096, "max_num_batched_tokens": 2048}},
     "max_num_batched_tokens (2048) must be >= max_num_seqs (4096)"),
    ({"scheduler": {"prefill_chunk": 16384}},
     "prefill_chunk (16384) must be <= max_num_batched_tokens (8192)"),
    ({"cache": {"rank": 20}}, "rank (20) must be <= page_size (16)"),
    ({"cache": {"budget_tokens": 500}}, "budget_tokens (500) must be a multiple of page_size (16)"),
    (
        {"cache": {"budget_tokens": 32, "sink_pages": 2, "recent_pages": 2}},
        "must cover more than sink_pages + recent_pages",
    ),
    (
        {"cache": {"budget_tokens": 48, "sink_pages": 1, "recent_pages": 2}},
        "budget_tokens (48) must cover more than sink_pages + recent_pages (3 pages = 48 tokens)",
    ),
    ({"cache": {"recent_pages": 0}}, "recent_pages"),
    ({"cache": {"tier": "host+nvme"}}, "nvme_dir must be set when tier is 'host+nvme'"),
    ({"cache": {"nvme_lookahead": 1}}, "nvme_lookahead must be 0 (off) or >= 2"),
    (
        {"cache": {"nvme_wait_for_saves": True, "nvme_saved_spills": False}},
        "nvme_wait_for_saves (true) needs nvme_saved_spills (false)",
    ),
    (
        {"server": {"default_max_tokens": 9000}},
        "default_max_tokens (9000) must be <= max_tokens_limit (8192)",
    ),
    ({"server": {"api_key": "  "}}, "api_key must not be empty"),
    (
        {"ray": {"cpu_only": True}, "model": {"device": "cuda:1"}},
        "model.device ('cuda:1') conflicts with ray.cpu_only",
    ),
]


@pytest.mark.parametrize("data,expected", CROSS_FIELD, ids=[e[:30] for _, e in CROSS_FIELD])
def test_cross_field_checks_quote_both_values(tmp_path, data, expected):
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(tmp_path, data))
    assert expected in str(info.value), str(info.value)


def test_cross_field_checks_also_hold_on_direct_construction():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)"):
        SchedulerConfig(max_num_batched_tokens=8, prefill_chunk=8)
    cache = CacheConfig()
    with pytest.raises(ValueError, match=r"rank \(32\) must be <= page_size \(16\)"):
        cache.rank = 32  # validate_assignment: a mutated config cannot slip past the checks


@pytest.mark.parametrize("saved_spills,wait,waits", [
    (True, None, True), (False, None, False), (True, False, False), (True, True, True), (False, False, False),
])
def test_waiting_for_saves_follows_saved_spills_unless_set(saved_spills, wait, waits):
    # cache.nvme_wait_for_saves's default (None) is on exactly where saved spills are on
    cache = CacheConfig(nvme_saved_spills=saved_spills, nvme_wait_for_saves=wait)
    assert cache.waits_for_saves is waits


def test_valid_cross_field_combinations_pass(tmp_path):
    data = {
        "cache": {"tier": "host+nvme", "nvme_dir": str(tmp_path), "budget_tokens": 64, "rank": 16},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 4, "prefill_chunk": 4},
    }
    cfg = load_config(write_yaml(tmp_path, data))
    assert cfg.cache.nvme_dir == str(tmp_path) and cfg.cache.budget_tokens == 64


@pytest.mark.parametrize(
    "data,key",
    [
        ({"cache": {"pagesize": 16}}, "cache.pagesize"),
        ({"caches": {}}, "caches"),
        ({"server": {"port": 1, "hostname": "x"}}, "server.hostname"),
    ],
)
def test_unknown_key_is_named_with_the_file(tmp_path, data, key):
    path = write_yaml(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert f"unknown key {key!r} in {path}" in message, message


def test_unknown_key_suggests_the_close_one(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'page_size'"):
        load_config(write_yaml(tmp_path, {"cache": {"pagesize": 16}}))


def test_unknown_override_key_is_named():
    with pytest.raises(ConfigError, match=r"unknown key 'server.prot' in overrides; did you mean 'port'"):
        load_config(overrides={"server.prot": 1})


def test_overrides_dotted_and_nested_win_over_the_file(tmp_path):
    path = write_yaml(tmp_path, {"server": {"port": 9000}, "cache": {"budget_tokens": 1024}})
    cfg = load_config(path, {"server.port": 9100, "cache": {"attention": "dense"}})
    assert cfg.server.port == 9100
    assert cfg.cache.budget_tokens == 1024 and cfg.cache.attention == "dense"  # untouched file value kept


def test_partial_file_keeps_other_defaults(tmp_path):
    cfg = load_config(write_yaml(tmp_path, {"cache": {"budget_tokens": 2048}}))
    assert cfg.cache.budget_tokens == 2048 and cfg.cache.page_size == 16 and cfg.server.port == 8000


def test_api_key_is_not_printed(tmp_path):
    cfg = load_config(write_yaml(tmp_path, {"server": {"api_key": "s3cret-key"}}))
    assert cfg.server.api_key.get_secret_value() == "s3cret-key"
    assert "s3cret-key" not in repr(cfg) and "s3cret-key" not in str(cfg.server)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("", "empty"),
        ("- 1\n- 2\n", "top level must be a mapping"),
        ("cache: {page_size: [16\n", "invalid YAML"),
    ],
)
def test_malformed_files(tmp_path, text, expected):
    path = write_yaml(tmp_path, text)
    if expected == "empty":
        assert load_config(path) == ServeConfig()
        return
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"config file {missing} does not exist"):
        load_config(missing)


def test_section_that_is_not_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match=r"cache = 5: .*dictionary"):
        load_config(write_yaml(tmp_path, {"cache": 5}))


@pytest.mark.parametrize(
    "text,expected",
    [
        ("cache.budget_tokens=1024", ("cache.budget_tokens", 1024)),
        ("ray.cpu_only=true", ("ray.cpu_only", True)),
        ("model.source=/m/x.gguf", ("model.source", "/m/x.gguf")),
        ("ray.address=", ("ray.address", None)),
    ],
)
def test_parse_override(text, expected):
    assert parse_override(text) == expected


@pytest.mark.parametrize("text", ["cache.budget_tokens", "=3", "a=[1"])
def test_parse_override_rejects(text):
    with pytest.raises(ConfigError, match="override"):
        parse_override(text)


# ----- fuzzed config files: every refusal names the field --------------------------------------------

FIELD_PATHS = [(section, name) for section, info in ServeConfig.model_fields.items()
               for name in info.annotation.model_fields]
YAML_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(10**20), 10**20), st.floats(allow_nan=True),
              st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(path=st.sampled_from(FIELD_PATHS), value=YAML_VALUES)
def test_fuzzed_config_value_is_accepted_or_refused_naming_the_field(tmp_path_factory, path, value):
    section, name = path
    file = tmp_path_factory.mktemp("fuzz") / "c.yaml"
    file.write_text(yaml.safe_dump({section: {name: value}}))
    try:
        config = load_config(file)
    except ConfigError as err:
        message = str(err)
        assert name in message and str(file) in message, message
        assert "\n" not in message, "one line"
        return
    assert getattr(getattr(config, section), name) is not None or value is None


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(section=st.sampled_from([*ServeConfig.model_fields, "engine"]),
       key=st.text(st.characters(whitelist_categories=("Ll", "Nd"), whitelist_characters="_"), min_size=1,
                   max_size=12))
def test_fuzzed_unknown_key_is_named(tmp_path_factory, section, key):
    known = ServeConfig.model_fields.get(section)
    if known is not None and key in known.annotation.model_fields:
        return  # a real field: nothing to refuse
    file = tmp_path_factory.mktemp("fuzz") / "c.yaml"
    file.write_text(yaml.safe_dump({section: {key: 1}}))
    with pytest.raises(ConfigError) as info:
        load_config(file)
    expected = f"unknown key '{section}.{key}'" if known is not None else f"unknown key '{section}'"
    assert expected in str(info.value), str(info.value)


def test_token_counts_take_k_and_m_as_powers_of_two(tmp_path):
    path = write_yaml(tmp_path, "model:\n  max_model_len: 128K\nscheduler:\n"
                                "  prefill_attention_decoding: 32M\n  prefill_chunk_decoding: 0.5K\n"
                                "  prefill_chunk: 8192\n")
    cfg = load_config(path, overrides=dict([parse_override("cache.budget_tokens=1K")]))
    assert cfg.model.max_model_len == 128 * 1024 and cfg.cache.budget_tokens == 1024
    sched = cfg.scheduler
    assert sched.prefill_attention_decoding == 32 << 20 and sched.prefill_chunk_decoding == 512
    assert sched.prefill_chunk == 8192
    assert SchedulerConfig(prefill_chunk_decoding=None).prefill_chunk_decoding is None
    with pytest.raises(ConfigError, match=r"scheduler.prefill_chunk = 2097152: must be <= 1048576"):
        load_config(overrides={"scheduler.prefill_chunk": "2M"})


@pytest.mark.parametrize("text", ["128K", "1M", "1.5K", "4096", " 32k ", "0.5M"])
def test_the_config_and_the_command_lines_read_token_counts_alike(text):
    from lockserve.cluster.measure.eval.command import parse_tokens as eval_tokens
    from lockserve.cluster.measure.harness.sizes import parse_tokens

    assert SchedulerConfig(prefill_attention_decoding=text).prefill_attention_decoding == parse_tokens(text)
    assert eval_tokens(text) == parse_tokens(text) and eval_tokens("max") == "max"
