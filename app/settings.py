"""The one settings object, read from ``FLOWCAST_*`` environment variables, and what is
read off it: the warnings about unsafe defaults, and whether the data directory is
used. It imports nothing of the server: the CLI reads it too."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

log = logging.getLogger("flowcast")

# Why ``flowcast worker`` (app.main:create_worker) refuses FLOWCAST_WORKER_SLOTS=0.
NO_SLOTS = "FLOWCAST_WORKER_SLOTS=0: a worker without slots would run nothing"


class Settings(BaseSettings):
    """Every knob of a Flowcast process; the embedded default needs none of them."""

    model_config = SettingsConfigDict(env_prefix="FLOWCAST_", frozen=True, extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    redis_url: str | None = None
    redis_prefix: str = "fc"
    redis_max_connections: int = Field(24, ge=4)
    s3_bucket: str | None = None
    s3_endpoint_url: str | None = None
    s3_prefix: str = ""
    data_dir: Path = Path(".flowcast")
    workflows_dir: Path = Path("examples")
    event_limit: int = Field(10_000, ge=1)
    event_budget_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    large_value_bytes: int = Field(8 * 1024 * 1024, ge=64)
    inline_file_bytes: int = Field(8 * 1024 * 1024, ge=0)
    max_pending_events: int = Field(10_000, ge=1)
    retention_seconds: int = Field(86_400, ge=1)
    sweep_seconds: float = Field(600.0, gt=0)
    sse_ping_seconds: float = Field(15.0, gt=0)
    sse_max_seconds: float = Field(3600.0, gt=0)
    block_concurrency: int = Field(8, ge=1, le=1024)
    max_executions_per_tenant: int = Field(1000, ge=0)
    # The queue (SPEC §14): what one tenant runs at once (0: no limit), what this
    # process runs at once (0: it serves the API only), each tenant's share.
    max_running_per_tenant: int = Field(100, ge=0)
    worker_slots: int = Field(64, ge=0)
    tenant_weights: str | None = None
    # Redis bytes one tenant may keep: workflows, secrets, retained executions (0: no limit).
    tenant_storage_bytes: int = Field(1024 * 1024 * 1024, ge=0)
    max_recoveries: int = Field(3, ge=0)
    execution_memory_bytes: int = Field(128 * 1024 * 1024, ge=1024 * 1024)
    lease_seconds: float = Field(15.0, gt=0)
    shutdown_grace_seconds: float = Field(30.0, ge=0)
    api_keys: str | None = None
    secret_key: str | None = None
    stream_token_seconds: int = Field(3600, ge=1)
    idempotency_seconds: int = Field(86_400, ge=1)
    max_body_bytes: int = Field(10 * 1024 * 1024, ge=1024)
    max_streams_per_tenant: int = Field(1000, ge=0)
    body_timeout_seconds: float = Field(30.0, gt=0)
    template_timeout_ms: int = Field(1000, ge=1)
    template_max_bytes: int = Field(1024 * 1024, ge=1024)
    template_workers: int = Field(2, ge=1, le=64)
    # How often the event loop's lag is measured (app/loopwatch.py); 0: never.
    loop_watch_ms: int = Field(100, ge=0)
    http_allow_private: bool = False
    http_max_concurrency: int = Field(64, ge=1)
    # Webhooks (SPEC §15): the delays before each retry of a delivery (the Standard
    # Webhooks schedule: about a day), and how many attempts one process makes at once.
    webhook_retry_seconds: str = "5,300,1800,7200,18000,36000,36000"
    webhook_concurrency: int = Field(16, ge=1, le=1024)
    # How long one attempt waits for a 2xx (the Standard Webhooks receivers' budget).
    webhook_timeout_seconds: float = Field(10.0, gt=0, le=300)
    plugins: str | None = None
    llm_base_url: str | None = None
    llm_api_key: str | None = None
    llm_providers: str | None = None
    log_level: str = "info"
    log_format: Literal["auto", "json", "text"] = "auto"
    # With API keys set, /metrics needs one too unless this opens it (a scraper on a
    # private network that cannot send a Bearer token).
    metrics_public: bool = False
    # With traces on (the OTEL_* variables, docs/traces.md), a span per Redis command
    # too: every background loop's as well, so only when asked.
    traces_redis: bool = False

    @field_validator(
        "redis_url",
        "s3_bucket",
        "s3_endpoint_url",
        "api_keys",
        "plugins",
        "llm_base_url",
        "llm_api_key",
        "llm_providers",
        "tenant_weights",
    )
    @classmethod
    def _empty_is_unset(cls, value: str | None) -> str | None:
        return value or None

    @model_validator(mode="after")
    def _workflows_dir_exists(self) -> Settings:
        # Only a directory someone named: a typo there must stop the server, not start
        # it with no workflows. (A missing default, examples/ under another working
        # directory, is a warning at start.)
        named = self.workflows_dir
        if "workflows_dir" in self.model_fields_set and not named.is_dir():
            raise ValueError(
                f"FLOWCAST_WORKFLOWS_DIR={named} names no directory (resolved against the "
                f"working directory: {named.resolve()})"
            )
        return self

    @field_validator("tenant_weights")
    @classmethod
    def _weights_are_a_map(cls, value: str | None) -> str | None:
        if value:
            weights_of(value)  # raises ValueError with what is wrong
        return value

    @field_validator("webhook_retry_seconds")
    @classmethod
    def _retry_delays(cls, value: str) -> str:
        retry_delays(value)  # raises ValueError with what is wrong
        return value

    @property
    def webhook_retries(self) -> list[float]:
        return retry_delays(self.webhook_retry_seconds)

    @property
    def weights(self) -> dict[str, float]:
        return weights_of(self.tenant_weights) if self.tenant_weights else {}

    @property
    def plugin_modules(self) -> list[str]:
        return [name.strip() for name in (self.plugins or "").split(",") if name.strip()]


def weights_of(text: str) -> dict[str, float]:
    """``FLOWCAST_TENANT_WEIGHTS``: a JSON object of tenant -> positive number."""
    try:
        loaded = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"FLOWCAST_TENANT_WEIGHTS is not JSON: {exc}") from None
    if not isinstance(loaded, dict):
        raise ValueError("FLOWCAST_TENANT_WEIGHTS must be a JSON object: tenant -> weight")
    weights: dict[str, float] = {}
    for tenant, weight in loaded.items():
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
            raise ValueError(f"FLOWCAST_TENANT_WEIGHTS: the weight of {tenant!r} must be > 0")
        weights[tenant] = float(weight)
    return weights


def warn_about_defaults(settings: Settings) -> None:
    """Say which unsafe or single-process defaults are in use."""
    if not settings.api_keys:
        log.warning(
            "no FLOWCAST_API_KEYS set: the API is open, so it answers on loopback only "
            "and refuses requests relayed by a proxy"
        )
    if settings.redis_url and not settings.secret_key:
        log.warning(
            "no FLOWCAST_SECRET_KEY set: this process uses a key of its own, so stream "
            "tokens and secrets work only where it runs; give every replica the same key"
        )


def data_dir_in_use(settings: Settings) -> bool:
    """Whether anything is kept under FLOWCAST_DATA_DIR: the embedded engine, the local
    value store, or this process's own secret key."""
    return not settings.redis_url or not settings.s3_bucket or not settings.secret_key


def retry_delays(text: str) -> list[float]:
    """``FLOWCAST_WEBHOOK_RETRY_SECONDS``: comma-separated delays, each >= 0 ("" for none)."""
    delays = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            delay = float(part)
        except ValueError:
            raise ValueError(f"FLOWCAST_WEBHOOK_RETRY_SECONDS: {part!r} is not a number") from None
        if not delay >= 0:
            raise ValueError(f"FLOWCAST_WEBHOOK_RETRY_SECONDS: {part!r} is negative")
        delays.append(delay)
    return delays
