"""Settings: defaults < config file < environment, and every way a bad setting stops start-up."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.errors import SettingsError
from gateway.platforms.registry import settings_groups
from gateway.platforms.telegram.spec import TelegramSettings
from gateway.platforms.whatsapp.spec import WhatsAppSettings
from gateway.settings import Settings, group_env_name, load_settings, settings_from, unknown_env_settings
from tests.helpers import GATEWAY, gateway_env

GROUPS = settings_groups()  # the platforms' settings groups, as the CLI and the app load them


def write_config(directory: Path, text: str) -> Path:
    path = directory / "config" / "gateway.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_defaults_without_file_or_environment() -> None:
    settings = load_settings()
    assert settings.database_url == "sqlite+aiosqlite:///./data/gateway.db"
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)
    assert settings.log_level == "info"
    assert settings.log_format == "auto"


def test_file_overrides_defaults_and_environment_overrides_file(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_config(clean_env, 'port = 9001\nhost = "0.0.0.0"\nlog_level = "debug"\n')
    monkeypatch.setenv("GATEWAY_PORT", "9002")
    settings = load_settings()
    assert settings.port == 9002  # environment beats the file
    assert settings.host == "0.0.0.0"  # file beats the default
    assert settings.log_level == "debug"


def test_config_file_env_names_another_file(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_config(clean_env, "port = 9001\n")
    other = clean_env / "elsewhere.toml"
    other.write_text('log_format = "json"\n')
    monkeypatch.setenv("GATEWAY_CONFIG_FILE", str(other))
    settings = load_settings()
    assert settings.port == 8000  # the default file is not read when another is named
    assert settings.resolved_log_format == "json"


def test_shipped_config_file_is_valid_and_lists_every_setting() -> None:
    shipped = Path(__file__).resolve().parents[2] / "config" / "gateway.toml"
    text = shipped.read_text()
    for name in Settings.model_fields:
        assert f"# {name} = " in text, f"config/gateway.toml does not document {name}"
    for group, model in GROUPS.items():
        for field in model.model_fields:
            name = f"{group}_{field}"
            assert f"# {name} = " in text, f"config/gateway.toml does not document {name}"
    # Uncommented, the documented defaults are exactly the built-in ones.
    uncommented = "\n".join(line[2:] for line in text.splitlines() if line.startswith("# ") and " = " in line)
    import tomllib

    assert settings_from(tomllib.loads(uncommented), GROUPS) == settings_from({}, GROUPS)


def test_values_are_case_insensitive_where_sensible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_LOG_LEVEL", "WARNING")
    assert load_settings().log_level == "warning"


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"GATEWAY_PORT": "abc"}, "GATEWAY_PORT"),
        ({"GATEWAY_PORT": "70000"}, "GATEWAY_PORT"),
        ({"GATEWAY_LOG_LEVEL": "loud"}, "GATEWAY_LOG_LEVEL"),
        ({"GATEWAY_LOG_FORMAT": "xml"}, "GATEWAY_LOG_FORMAT"),
        ({"GATEWAY_DATABASE_URL": "mysql://root@localhost/x"}, "GATEWAY_DATABASE_URL"),
        ({"GATEWAY_DATABASE_URL": "not a url"}, "GATEWAY_DATABASE_URL"),
        ({"GATEWAY_HOST": ""}, "GATEWAY_HOST"),
    ],
)
def test_bad_environment_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SettingsError, match=named):
        load_settings()


def test_bad_file_value_names_the_key_and_the_file(clean_env: Path) -> None:
    path = write_config(clean_env, 'port = "eighty"\n')
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert "port" in str(caught.value)
    assert str(path.relative_to(clean_env)) in str(caught.value)


def test_unknown_key_in_file_is_an_error(clean_env: Path) -> None:
    write_config(clean_env, 'databse_url = "sqlite+aiosqlite:///x.db"\n')
    with pytest.raises(SettingsError, match="unknown setting 'databse_url'"):
        load_settings()


def test_invalid_toml_is_an_error(clean_env: Path) -> None:
    write_config(clean_env, "port = = 1\n")
    with pytest.raises(SettingsError, match="not valid TOML"):
        load_settings()


def test_named_config_file_must_exist(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    monkeypatch.setenv("GATEWAY_CONFIG_FILE", str(clean_env / "missing.toml"))
    with pytest.raises(SettingsError, match=r"GATEWAY_CONFIG_FILE.*does not exist"):
        load_settings()


def test_unreadable_config_file_is_an_error(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    # A directory cannot be read as a file, even by root (who ignores permission bits).
    directory = clean_env / "conf.toml"
    directory.mkdir()
    monkeypatch.setenv("GATEWAY_CONFIG_FILE", str(directory))
    with pytest.raises(SettingsError, match=r"GATEWAY_CONFIG_FILE: cannot read"):
        load_settings()


def test_database_password_is_not_echoed_in_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_DATABASE_URL", "mysql://root:hunter2-secret@db/x")
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert "GATEWAY_DATABASE_URL" in str(caught.value)
    assert "hunter2-secret" not in str(caught.value)


def test_secret_values_include_the_database_password() -> None:
    settings = Settings(database_url="postgresql+asyncpg://gw:pa55-word@db:5432/gw")
    assert "pa55-word" in settings.secret_values()


def test_unknown_gateway_variables_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_DATABSE_URL", "typo")
    monkeypatch.setenv("GATEWAY_PORT", "8001")
    assert unknown_env_settings() == ["GATEWAY_DATABSE_URL"]


def test_cli_exits_2_with_one_line_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GATEWAY_LOG_FORMAT", "xml")
    assert main(["db", "current"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "GATEWAY_LOG_FORMAT" in err


def test_real_process_exits_2_on_unknown_file_key(clean_env: Path) -> None:
    write_config(clean_env, "prot = 8001\n")
    result = subprocess.run(
        [GATEWAY, "serve"], cwd=clean_env, env=gateway_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"gateway: unknown setting 'prot' in config file {Path('config/gateway.toml')}"
    ]
    assert not (clean_env / "data").exists(), "nothing may be created when start-up is refused"


def test_readme_documents_every_setting() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for name in Settings.model_fields:
        assert f"`GATEWAY_{name.upper()}`" in readme, f"README does not document GATEWAY_{name.upper()}"
    for model in GROUPS.values():
        for field in model.model_fields:
            variable = group_env_name(model, field)
            assert f"`{variable}`" in readme, f"README does not document {variable}"


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [
        ("GATEWAY_TELEGRAM_SECRET_TOKEN", "has spaces", "1-256 characters"),
        ("GATEWAY_TELEGRAM_BOT_TOKEN", "not-a-token", "bot token"),
        ("GATEWAY_WHATSAPP_API_BASE", "graph.facebook.com", "http"),
        ("GATEWAY_MAX_BODY_BYTES", "10", "greater than or equal"),
        ("GATEWAY_DEDUP_TTL_HOURS", "0", "greater than"),
        ("GATEWAY_MAX_TURNS", "0", "greater than or equal"),
        ("GATEWAY_MAX_TURNS_IN_FLIGHT", "0", "greater than or equal"),
        ("GATEWAY_OPENAI_RPM", "-1", "greater than or equal"),
        ("GATEWAY_OPENAI_TPM", "many", "valid integer"),
        ("GATEWAY_MODEL_RETRY_S", "-5", "greater than or equal"),
        ("GATEWAY_COALESCE_MS", "-1", "greater than or equal"),
        ("GATEWAY_COALESCE_MS", "60000", "less than or equal"),
        ("GATEWAY_COALESCE_MS", "soon", "valid integer"),
        ("GATEWAY_HOLDING_REPLY", "", "at least 1 character"),
        ("GATEWAY_ANTHROPIC_BASE_URL", "api.anthropic.com", "http"),
        ("GATEWAY_OPENAI_BASE_URL", "http://[bad", "not a valid URL"),
        ("GATEWAY_TELEGRAM_API_BASE", "https://", "with a host"),
        ("GATEWAY_GEMINI_BASE_URL", "http://exa mple.com/v1", "with a host"),
        ("GATEWAY_WHATSAPP_API_BASE", "https://graph.facebook.com:99999", "not a valid URL"),
        ("GATEWAY_GEMINI_RPM", "-3", "greater than or equal"),
        ("GATEWAY_MODEL", "claude:sonnet", "'anthropic:<model>'"),
        ("GATEWAY_MODEL_PRICES", '{"openai:x": [1, -2]}', "must be 0 or more"),
        ("GATEWAY_MODEL_PRICES", '{"openai:x": [1, Infinity]}', "finite number"),
        ("GATEWAY_MODEL_PRICES", '{"openai:x": [1]}', "GATEWAY_MODEL_PRICES"),
        ("GATEWAY_MODEL_PRICES", "openai:x=1,2", "JSON object"),
        ("GATEWAY_MODEL_PRICES", '{"openai:x": [1, 2]', "JSON object"),
        ("GATEWAY_MODEL_PRICES", "[1, 2]", "valid dictionary"),
        # Infinite or absurd durations once passed and then failed start-up with a traceback (a
        # datetime past the year 9999).
        ("GATEWAY_DEDUP_TTL_HOURS", "inf", "finite number"),
        ("GATEWAY_DEDUP_TTL_HOURS", "1e9", "less than or equal to 87600"),
        ("GATEWAY_DELIVERY_RETRY_HOURS", "inf", "finite number"),
        ("GATEWAY_DELIVERY_RETRY_HOURS", "1e9", "less than or equal to 8760"),
        ("GATEWAY_MODEL_RETRY_S", "inf", "finite number"),
        ("GATEWAY_MODEL_RETRY_S", "1e12", "less than or equal to 31536000"),
        ("GATEWAY_HOLDING_REPLY_AFTER_S", "inf", "finite number"),
        ("GATEWAY_HOLDING_REPLY_AFTER_S", "1e12", "less than or equal to 604800"),
        ("GATEWAY_TELEGRAM_CHAT_PER_SECOND", "inf", "finite number"),
        ("GATEWAY_WHATSAPP_GLOBAL_PER_SECOND", "infinity", "finite number"),
    ],
)
def test_platform_settings_are_checked(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, problem: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as caught:
        load_settings(GROUPS)
    assert name in str(caught.value)
    assert problem in str(caught.value)
    if "TOKEN" in name:
        assert value not in str(caught.value)  # secrets are not echoed back


def test_platform_secrets_feed_the_log_redactor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_TELEGRAM_BOT_TOKEN", "123456:secret-bot-token")
    monkeypatch.setenv("GATEWAY_WHATSAPP_APP_SECRET", "app-secret-value")
    monkeypatch.setenv("GATEWAY_WHATSAPP_VERIFY_TOKEN", "")
    settings = load_settings(GROUPS)
    assert {"123456:secret-bot-token", "app-secret-value"} <= set(settings.secret_values())
    assert settings.group("whatsapp", WhatsAppSettings).verify_token is None  # empty means unset


def test_turn_kinds_default_matches_the_domain_and_parses_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gateway.bootstrap import turn_kinds
    from gateway.domain.inbound import DEFAULT_TURN_KINDS, MessageKind

    assert turn_kinds(load_settings()) == DEFAULT_TURN_KINDS
    monkeypatch.setenv("GATEWAY_TURN_KINDS", "text, sticker")
    assert turn_kinds(load_settings()) == {MessageKind.TEXT, MessageKind.STICKER}
    monkeypatch.setenv("GATEWAY_TURN_KINDS", '["text"]')
    assert turn_kinds(load_settings()) == {MessageKind.TEXT}
    monkeypatch.setenv("GATEWAY_TURN_KINDS", "text,gif")
    with pytest.raises(SettingsError, match=r"GATEWAY_TURN_KINDS.*'gif'"):
        turn_kinds(load_settings())


def test_a_malformed_turn_kinds_list_is_a_settings_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_TURN_KINDS", "[text")
    with pytest.raises(SettingsError, match="GATEWAY_TURN_KINDS"):
        load_settings()


def test_platform_settings_come_from_flat_keys_a_table_or_the_environment(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_config(
        clean_env,
        'telegram_bot_token = "42:file-token"\ntelegram_chat_per_second = 2\n'
        '[whatsapp]\napp_secret = "from-the-table"\n',
    )
    monkeypatch.setenv("GATEWAY_TELEGRAM_CHAT_PER_SECOND", "3")
    settings = load_settings(GROUPS)
    telegram = settings.group("telegram", TelegramSettings)
    assert telegram.bot_token is not None
    assert telegram.bot_token.get_secret_value() == "42:file-token"
    assert telegram.chat_per_second == 3  # the environment beats the file here too
    whatsapp = settings.group("whatsapp", WhatsAppSettings)
    assert whatsapp.app_secret is not None
    assert whatsapp.app_secret.get_secret_value() == "from-the-table"
    assert {"42:file-token", "from-the-table"} <= set(settings.secret_values())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('telegram_api_base = "x"\n', "invalid setting telegram_api_base in config"),
        ('[telegram]\napi_base = "x"\n', "invalid setting telegram.api_base in config"),
        ("[telegram]\nbot_tokn = 1\n", "unknown setting 'telegram.bot_tokn' in config file"),
        ("telegram_bot_tokn = 1\n", "unknown setting 'telegram_bot_tokn' in config file"),
        ("[slack]\nsecret = 1\n", "unknown setting 'slack' in config file"),
        ('telegram_api_base = "http://a"\n[telegram]\napi_base = "http://b"\n', "given twice"),
    ],
)
def test_bad_platform_keys_in_the_file_are_named(clean_env: Path, text: str, message: str) -> None:
    write_config(clean_env, text)
    with pytest.raises(SettingsError, match=message):
        load_settings(GROUPS)


def test_settings_built_directly_read_a_platform_group_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GATEWAY_TELEGRAM_SECRET_TOKEN", "from-env")
    telegram = Settings().group("telegram", TelegramSettings)
    assert telegram.secret_token is not None
    assert telegram.secret_token.get_secret_value() == "from-env"
    monkeypatch.setenv("GATEWAY_TELEGRAM_GROUP_PER_MINUTE", "-1")
    with pytest.raises(SettingsError, match="GATEWAY_TELEGRAM_GROUP_PER_MINUTE"):
        Settings().group("telegram", TelegramSettings)


def test_platform_variables_are_known_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_TELEGRAM_BOT_TOKEN", "1:x")
    monkeypatch.setenv("GATEWAY_WHATSAPP_GLOBAL_PER_SECOND", "10")
    monkeypatch.setenv("GATEWAY_TELEGRAM_BOT_TOKN", "1:x")
    assert unknown_env_settings(GROUPS) == ["GATEWAY_TELEGRAM_BOT_TOKN"]


@pytest.mark.parametrize("provider", ["openai", "anthropic", "gemini"])
def test_a_providers_own_endpoint_needs_its_key(monkeypatch: pytest.MonkeyPatch, provider: str) -> None:
    variable = f"GATEWAY_{provider.upper()}_API_KEY"
    monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("GATEWAY_MODEL", f"{provider}:some-model")
    with pytest.raises(SettingsError) as caught:
        load_settings(GROUPS)
    assert str(caught.value).startswith(
        f"invalid setting GATEWAY_MODEL: '{provider}:some-model' needs {variable}: it calls https://"
    )
    monkeypatch.setenv(f"GATEWAY_{provider.upper()}_BASE_URL", "http://127.0.0.1:8000/v1")
    assert load_settings(GROUPS).model == f"{provider}:some-model"  # a server of one's own may go without
    monkeypatch.delenv(f"GATEWAY_{provider.upper()}_BASE_URL")
    monkeypatch.setenv(variable, "sk-test-key")
    assert load_settings(GROUPS).model == f"{provider}:some-model"
