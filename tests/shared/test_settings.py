"""Settings: environment, settings file, precedence, and readable errors for bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.router.settings import RouterSettings
from shared.settings import CommonSettings, SettingsError, load_settings
from tests.procs import start_with


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("KVMESH_"):
            monkeypatch.delenv(key)


def test_defaults_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings(CommonSettings).heartbeat_interval_s == 1.0
    assert load_settings(RouterSettings).http_port == 8000
    monkeypatch.setenv("KVMESH_HEARTBEAT_INTERVAL_S", "0.5")
    monkeypatch.setenv("KVMESH_ROUTER_HTTP_PORT", "9001")
    assert load_settings(CommonSettings).heartbeat_interval_s == 0.5
    assert load_settings(RouterSettings).http_port == 9001


def test_settings_are_frozen() -> None:
    common = load_settings(CommonSettings)
    with pytest.raises(ValueError):
        common.log_level = "debug"  # type: ignore[misc]


def test_settings_file_tables_and_precedence(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    file = tmp_path / "kvmesh.toml"
    file.write_text('[common]\nlog_level = "debug"\n\n[router]\nhttp_port = 8100\n')
    monkeypatch.setenv("KVMESH_SETTINGS_FILE", str(file))
    assert load_settings(CommonSettings).log_level == "debug"
    assert load_settings(RouterSettings).http_port == 8100
    monkeypatch.setenv("KVMESH_ROUTER_HTTP_PORT", "8200")  # the environment wins over the file
    assert load_settings(RouterSettings).http_port == 8200


@pytest.mark.parametrize(
    ("var", "value", "says"),
    [
        ("KVMESH_HEARTBEAT_INTERVAL_S", "-1", "greater than 0"),
        ("KVMESH_HEARTBEAT_INTERVAL_S", "often", "valid number"),
        ("KVMESH_LOG_LEVEL", "loud", "'debug', 'info', 'warning' or 'error'"),
        ("KVMESH_NATS_URL", "http://x", "should match pattern"),
    ],
)
def test_bad_common_value_names_variable(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, says: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError) as err:
        load_settings(CommonSettings)
    assert var in str(err.value)
    assert says in str(err.value)
    assert repr(value) in str(err.value)


def test_unknown_key_in_file_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    file = tmp_path / "kvmesh.toml"
    file.write_text("[router]\nhttp_prot = 8100\n")
    monkeypatch.setenv("KVMESH_SETTINGS_FILE", str(file))
    with pytest.raises(SettingsError, match=r"\[router\] http_prot: Extra inputs"):
        load_settings(RouterSettings)


def test_malformed_file_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    file = tmp_path / "kvmesh.toml"
    file.write_text("[router\n")
    monkeypatch.setenv("KVMESH_SETTINGS_FILE", str(file))
    with pytest.raises(SettingsError, match="cannot read KVMESH_SETTINGS_FILE"):
        load_settings(RouterSettings)


@pytest.mark.parametrize("role", ["router", "prefill", "decode", "encoder", "cachemeta"])
def test_service_with_bad_setting_stops_at_start(role: str) -> None:
    """The process exits at once with code 2 and a message naming the variable and the limit."""
    done = start_with(role, f"KVMESH_{role.upper()}_HTTP_PORT", "70000")
    assert done.returncode == 2
    assert f"KVMESH_{role.upper()}_HTTP_PORT" in done.stderr
    assert "less than or equal to 65535" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_picks_its_engine_by_name(monkeypatch: pytest.MonkeyPatch, role: str) -> None:
    from services.decode.settings import DecodeSettings
    from services.prefill.settings import PrefillSettings

    cls = {"prefill": PrefillSettings, "decode": DecodeSettings}[role]
    assert load_settings(cls).engine == "torch"
    var = f"KVMESH_{role.upper()}_ENGINE"
    monkeypatch.setenv(var, "trtllm")
    with pytest.raises(SettingsError) as err:
        load_settings(cls)
    assert var in str(err.value) and "one of torch" in str(err.value)
    assert "'trtllm'" in str(err.value)


def test_the_benchmark_only_engine_is_refused_by_a_production_worker() -> None:
    done = start_with("prefill", "KVMESH_PREFILL_ENGINE", "fake-paced")
    assert done.returncode == 2
    assert "KVMESH_PREFILL_ENGINE=fake-paced: a benchmark-only engine" in done.stderr
    assert "KVMESH_BENCH_ENGINES=true" in done.stderr


def test_an_unknown_engine_stops_the_worker_at_start() -> None:
    done = start_with("decode", "KVMESH_DECODE_ENGINE", "trtllm")
    assert done.returncode == 2
    assert (
        "KVMESH_DECODE_ENGINE: Value error, one of torch, fake-paced, vllm, sglang (got 'trtllm')"
        in done.stderr
    )


def test_an_sglang_worker_where_sglang_is_not_installed_says_so_at_start() -> None:
    done = start_with("decode", "KVMESH_DECODE_ENGINE", "sglang")
    assert done.returncode == 2
    assert "KVMESH_DECODE_ENGINE=sglang" in done.stderr
    assert "SGLang is not installed here" in done.stderr and "sglang==0.5.23" in done.stderr
