"""The tenant whose work the current task does.

Set by a request's authentication (``app/services.py``) and by a run (the launcher), and
read where a shared resource is split by tenant: log lines are masked with that tenant's
secrets only, and provider permits are shared fairly between the tenants that wait.
A task started from another inherits it (contextvars).
"""

from __future__ import annotations

from contextvars import ContextVar

CURRENT_TENANT: ContextVar[str | None] = ContextVar("flowcast_tenant", default=None)
