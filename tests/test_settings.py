"""The web tier's one settings object: every variable read in one place, parsed and checked with an
error naming the variable (pure: no Redis)."""
from __future__ import annotations

import dataclasses

import pytest

from web.settings import Settings
from worker import protocol

ENV = {
    "REDIS_URL": "redis://elsewhere:6380/2", "NANOSERVE_MODELS": "/srv/models.toml",
    "NANOSERVE_MAX_BODY_BYTES": "4096", "NANOSERVE_MAX_QUEUE_DEPTH": "5", "NANOSERVE_MAX_CHOICES": "8",
    "NANOSERVE_RETRY_AFTER": "7", "NANOSERVE_SYNC_TIMEOUT": "2.5", "NANOSERVE_KEEPALIVE": "0.5",
    "NANOSERVE_JOB_RETRIES": "0", "NANOSERVE_JOB_TIMEOUT": "60", "NANOSERVE_QUEUE_TTL": "30",
    "NANOSERVE_RESULT_TTL": "90",
    "NANOSERVE_AUTH": "required", "NANOSERVE_METRICS_AUTH": "Required", "NANOSERVE_KEY_RPM": "3",
    "NANOSERVE_KEY_TPM": "0", "NANOSERVE_USER_RPM": "4", "NANOSERVE_USER_TPM": "400",
    "NANOSERVE_ABUSE": "off", "NANOSERVE_ABUSE_WINDOW": "2m", "NANOSERVE_ABUSE_MAX_429": "7",
    "NANOSERVE_ABUSE_MAX_INVALID": "9", "NANOSERVE_ABUSE_BAN": "1d",
    "NANOSERVE_LOG_FORMAT": "text", "NANOSERVE_LOG_LEVEL": "debug",
    "NANOSERVE_UNKNOWN_FIELDS": "ignore", "NANOSERVE_MAX_STOP": "32",
    "NANOSERVE_MAX_FILE_BYTES": "1000", "NANOSERVE_FILE_TTL": "2h", "NANOSERVE_BATCH_WINDOW": "90s",
    "NANOSERVE_BATCH_MAX_LINES": "10", "NANOSERVE_BATCH_MAX_INFLIGHT": "3", "NANOSERVE_BATCH_DISPATCH": "off",
    "NANOSERVE_BATCH_TICK": "0.1", "NANOSERVE_BATCH_LEASE": "4", "NANOSERVE_MAX_LOGIT_BIAS": "50",
    "NANOSERVE_KEY_MAX_JOBS": "6", "NANOSERVE_KEY_MAX_OPEN": "5", "NANOSERVE_KEY_MAX_BATCHES": "2",
    "NANOSERVE_KEY_MAX_FILES": "11", "NANOSERVE_KEY_MAX_STORED_BYTES": "12345",
}


def test_every_variable_is_read():
    s = Settings.from_env(ENV)
    assert (s.redis_url, s.models_path, s.max_body_bytes, s.max_queue_depth, s.max_choices) == \
        ("redis://elsewhere:6380/2", "/srv/models.toml", 4096, 5, 8)
    assert (s.retry_after_s, s.sync_timeout_s, s.keepalive_s, s.job_retries, s.job_timeout_s, s.queue_ttl_s,
            s.result_ttl_s) == (7, 2.5, 0.5, 0, 60, 30, 90)
    assert (s.auth_required, s.metrics_auth_required, s.key_rpm, s.key_tpm, s.user_rpm, s.user_tpm) == \
        (True, True, 3, 0, 4, 400)
    assert (s.abuse_enabled, s.abuse_window_s, s.abuse_max_rate_limited, s.abuse_max_invalid, s.abuse_ban_s) == \
        (False, 120, 7, 9, 86400)
    assert (s.log_format, s.log_level) == ("text", "DEBUG")
    assert (s.unknown_fields, s.max_stop, s.max_logit_bias) == ("ignore", 32, 50)
    assert (s.key_max_jobs, s.key_max_open, s.key_max_batches, s.key_max_files, s.key_max_stored_bytes) == \
        (6, 5, 2, 11, 12345)
    assert (s.max_file_bytes, s.file_ttl_s, s.batch_window_s, s.batch_max_lines, s.batch_max_inflight,
            s.batch_dispatch, s.batch_tick_s, s.batch_lease_s) == (1000, 7200, 90, 10, 3, False, 0.1, 4)
    # every field but one is read from the environment, and this test sets each of them
    read = {f.metadata["env"] for f in dataclasses.fields(Settings) if f.metadata["env"]}
    assert read == set(ENV) and len(read) == len(dataclasses.fields(Settings)) - 1


def test_defaults():
    s = Settings.from_env({})
    assert s == Settings()
    assert s.redis_url == protocol.DEFAULT_REDIS_URL  # the one default the worker uses too
    assert (s.retry_after_s, s.auth_required, s.abuse_enabled, s.key_rpm, s.abuse_window_s) == (1, False, True, 10_000, 600)
    assert s.metrics_auth_required is None  # unset: /metrics is as open as /v1
    assert Settings.from_env({"NANOSERVE_RETRY_AFTER": ""}).retry_after_s == 1  # empty: unset


@pytest.mark.parametrize("var, value, message", [
    ("NANOSERVE_AUTH", "maybe", "NANOSERVE_AUTH must be 'required' or 'disabled', not 'maybe'"),
    ("NANOSERVE_ABUSE", "sometimes", "NANOSERVE_ABUSE must be 'on' or 'off'"),
    ("NANOSERVE_ABUSE_BAN", "soon", "NANOSERVE_ABUSE_BAN: Invalid duration 'soon'"),
    ("NANOSERVE_ABUSE_MAX_429", "-3", "NANOSERVE_ABUSE_MAX_429 must be a whole number of at least 1"),
    ("NANOSERVE_ABUSE_MAX_INVALID", "0", "NANOSERVE_ABUSE_MAX_INVALID must be a whole number of at least 1"),
    ("NANOSERVE_KEY_RPM", "lots", "NANOSERVE_KEY_RPM must be a whole number (0: no limit)"),
    ("NANOSERVE_RETRY_AFTER", "1.5", "NANOSERVE_RETRY_AFTER must be a whole number"),
    ("NANOSERVE_SYNC_TIMEOUT", "-1", "NANOSERVE_SYNC_TIMEOUT must be a number of seconds"),
    ("NANOSERVE_KEEPALIVE", "nan", "NANOSERVE_KEEPALIVE must be a number of seconds"),
    ("NANOSERVE_LOG_FORMAT", "xml", "NANOSERVE_LOG_FORMAT must be one of json, text"),
    ("NANOSERVE_BATCH_WINDOW", "a day", "NANOSERVE_BATCH_WINDOW: Invalid duration 'a day'"),
    ("NANOSERVE_BATCH_MAX_INFLIGHT", "0", "NANOSERVE_BATCH_MAX_INFLIGHT must be a whole number of at least 1"),
    ("NANOSERVE_LOG_LEVEL", "LOUD", "NANOSERVE_LOG_LEVEL must be a logging level"),
])
def test_a_bad_value_names_its_variable(var, value, message):
    with pytest.raises(ValueError) as info:
        Settings.from_env({var: value})
    assert message in str(info.value)


def test_replace_parses_strings_and_takes_values_as_given():
    s = Settings().replace(auth_required="required", retry_after_s="7", abuse_ban_s="2h", key_rpm=5)
    assert (s.auth_required, s.retry_after_s, s.abuse_ban_s, s.key_rpm) == (True, 7, 7200, 5)
    with pytest.raises(ValueError, match="NANOSERVE_RETRY_AFTER"):  # a field is checked as its variable
        Settings().replace(retry_after_s="soon")
    with pytest.raises(ValueError, match="unknown setting 'retry_after'"):
        Settings().replace(retry_after="7")
