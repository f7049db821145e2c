"""Every ``serve`` override over a config file whose sections have every field set to a value
of its own (none a default, no two alike): the override changes its field and nothing else.

An override that rebuilds its section from the defaults (``--redis-url`` resetting
``store.key_prefix``, ``--port`` resetting ``server.header_timeout_s``) passes every test
that writes no section; these write all of them. Each option is given three ways: on the
command line, as ``RUNLOOP_<NAME>`` (and ``REDIS_URL``), and as a worker process reads it
(``settings_to_env`` then ``settings_from_env``)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import pytest

from runloop_proxy.cli import build_parser
from runloop_proxy.config import (
    ProxyConfig,
    ServerSection,
    Settings,
    StoreSection,
    UpstreamSpec,
    load_config,
)
from runloop_proxy.environment import (
    SERVE_OPTIONS,
    env_name,
    settings_from_env,
    settings_to_env,
)

from .keys import OPENAI_MODEL, openai_project_key

# every field of each section: distinct from its default and from one another
SERVER: dict[str, Any] = {
    "host": "10.7.3.9", "port": 9441, "max_body_bytes": 3_145_733,
    "max_answer_bytes": 6_291_469, "header_timeout_s": 4.25, "body_timeout_s": 47.5,
    "keep_alive_s": 13, "max_header_bytes": 20_483, "session_header": "X-Agent-Run",
    "websocket": False, "websocket_idle_s": 311.0,
    "admin_key": "admin-file-" + hashlib.sha256(b"file").hexdigest()[:29],
    "cache_mb": 73, "held_answers_mb": 97, "tenant_share": 0.37, "summary_calls": 19,
    "large_requests": 23}
STORE: dict[str, Any] = {
    "redis_url": "redis://10.7.3.10:6390/5", "key_prefix": "acme-prod", "retention_days": 11.5,
    "max_messages_per_session": 17_011, "max_message_bytes": 5_242_903, "max_branches": 91,
    "max_branch_messages": 83_017, "max_stored_messages": 151_009, "timeout_s": 0.83,
    "retry_after_s": 3.7, "write_retry_s": 95.0, "write_queue_mb": 177}
UPSTREAM: dict[str, Any] = {
    "url": "https://gateway.acme.example/v1", "api_key": openai_project_key(7),
    "format": "chat", "connect_timeout": 6.5, "read_timeout": 413.0, "total_timeout": 1517.0,
    "max_retries": 4, "backoff_base": 0.61, "backoff_max": 5.3, "max_connections": 389}
DEFAULTS: dict[str, Any] = {"default_context_window": 90_001, "retention_days": 17.25}
POLICY: dict[str, Any] = {"summary_model": "gpt-4.1-mini-2025-04-14", "max_run_loops": 8}

# each option's override: distinct from the file's value and from the default
OVERRIDES: dict[str, str] = {
    "host": "192.168.44.2", "port": "9555", "upstream": "https://llm.acme.example/v1",
    "upstream_format": "anthropic", "redis_url": "redis://10.9.9.9:6411/3",
    "data_dir": "/srv/runloop-data", "admin_key": "admin-cli-" + "c" * 30,
    "log_level": "warning", "log_format": "text", "context_window": "70001",
    "summary_model": "extractive", "cache_mb": "61", "workers": "3"}
# where each override lands in the loaded config (None: the process's, not the config's)
LANDS = {"host": ("server", "host"), "port": ("server", "port"),
         "admin_key": ("server", "admin_key"), "cache_mb": ("server", "cache_mb"),
         "redis_url": ("store", "redis_url")}


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def write_config(root: Path) -> Path:
    lines = ["[server]", *(f"{k} = {_toml(v)}" for k, v in SERVER.items()),
             "[store]", *(f"{k} = {_toml(v)}" for k, v in STORE.items()),
             "[upstreams.default]", *(f"{k} = {_toml(v)}" for k, v in UPSTREAM.items()),
             "[defaults]", *(f"{k} = {_toml(v)}" for k, v in DEFAULTS.items()),
             "[defaults.policy]", *(f"{k} = {_toml(v)}" for k, v in POLICY.items())]
    (root / "runloop.toml").write_text("\n".join(lines) + "\n")
    (root / "tenants").mkdir()
    (root / "tenants" / "acme.toml").write_text(
        f'keys = ["{openai_project_key(8)}"]\nupstream = "default"\n'
        f'upstream_key = "{openai_project_key(9)}"\n'
        f'[models."{OPENAI_MODEL}"]\ncontext_window = 1047576\n')
    return root


def test_the_file_sets_every_field_to_a_value_of_its_own(tmp_path: Path) -> None:
    """The sweep's precondition: every field of each section is in the file (a field added
    later fails here until it has a value), none at its default, no two numbers alike."""
    for section, values in ((ServerSection, SERVER), (StoreSection, STORE),
                            (UpstreamSpec, UPSTREAM)):
        assert set(values) == set(section.model_fields), section.__name__
        for name, value in values.items():
            assert value != section.model_fields[name].default, (section.__name__, name)
    numbers = [v for d in (SERVER, STORE, UPSTREAM, DEFAULTS, POLICY) for v in d.values()
               if isinstance(v, (int, float)) and not isinstance(v, bool)]
    assert len(numbers) == len(set(numbers))
    assert {o.field for o in SERVE_OPTIONS} == set(OVERRIDES) | {"config_dir"}
    config = load_config(Settings(config_dir=str(write_config(tmp_path))))
    assert config.server.model_dump() == SERVER
    assert config.store.model_dump() == STORE
    assert config.upstreams["default"].model_dump() == UPSTREAM


def _given(field: str, how: str, root: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    option = next(o for o in SERVE_OPTIONS if o.field == field)
    for o in SERVE_OPTIONS:
        monkeypatch.delenv(env_name(o), raising=False)
        if o.fallback_env:
            monkeypatch.delenv(o.fallback_env, raising=False)
    value = OVERRIDES[field]
    if how == "command line":
        args = build_parser().parse_args(["serve", "--config", str(root), option.flags[0],
                                          value])
        return Settings(**{o.field: getattr(args, o.field) for o in SERVE_OPTIONS})
    environ = {env_name(next(o for o in SERVE_OPTIONS if o.field == "config_dir")): str(root)}
    if how == "fallback variable":
        assert option.fallback_env
        environ[option.fallback_env] = value
    else:
        environ[env_name(option)] = value
    settings = settings_from_env(environ)
    if how == "a worker's environment":
        settings = settings_from_env(settings_to_env(settings))
    return settings


def _dumped(config: ProxyConfig) -> dict[str, Any]:
    return {"server": config.server.model_dump(), "store": config.store.model_dump(),
            "upstreams": {k: v.model_dump() for k, v in config.upstreams.items()},
            "tenants": {k: v.model_dump() for k, v in config.tenants.items()}}


CASES = [(f, how) for f in OVERRIDES for how in ("command line", "RUNLOOP_*",
                                                  "a worker's environment")]
CASES += [("redis_url", "fallback variable")]


@pytest.mark.parametrize(("field", "how"), CASES, ids=[f"{f}-{h}" for f, h in CASES])
def test_an_override_changes_its_field_and_keeps_every_other(
        field: str, how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug class: an override that resets the rest of its section (or another section).
    Found: ``--upstream`` replaced the file's default upstream whole (its timeouts, retries,
    connections and format gone). Planted: ``--redis-url`` building the store section from
    the defaults (every other store field lost); second: the server overrides validated
    over ``ServerSection()`` instead of the file's (``--port`` resets
    ``header_timeout_s``, ``admin_key``...)."""
    root = write_config(tmp_path)
    base = _dumped(load_config(Settings(config_dir=str(root))))
    settings = _given(field, how, root, monkeypatch)
    option = next(o for o in SERVE_OPTIONS if o.field == field)
    assert getattr(settings, field) == option.kind(OVERRIDES[field])
    assert dataclasses.replace(settings, **{field: getattr(Settings(), field)}) == \
        Settings(config_dir=str(root)), "the other settings are their defaults"
    got = _dumped(load_config(settings))
    want = {k: {**v} for k, v in base.items()}
    if field in LANDS:
        section, name = LANDS[field]
        want[section] = {**want[section], name: option.kind(OVERRIDES[field])}
    elif field in ("upstream", "upstream_format"):
        # --upstream gives the file's default upstream a new URL: its other fields stay, its
        # key does not (written for another URL, it never goes to this one);
        # --upstream-format alone says what --upstream speaks, with no --upstream nothing
        if field == "upstream":
            want["upstreams"]["default"] = {**UPSTREAM, "url": OVERRIDES["upstream"],
                                            "api_key": None}
    elif field == "context_window":
        # the defaults' context window: a tenant file that sets none of its own takes it
        assert got["tenants"]["acme"]["default_context_window"] == 70_001
        want["tenants"]["acme"]["default_context_window"] = 70_001
    elif field == "summary_model":
        # pass-through mode's summary model: tenants keep their own (files say theirs)
        pass
    assert got == want
