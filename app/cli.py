"""The ``flowcast`` command line."""

from __future__ import annotations

import argparse
import ipaddress
import sys

import uvicorn

from app.settings import Settings


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(args: argparse.Namespace) -> int:
    """Run one Flowcast process (embedded engine unless FLOWCAST_REDIS_URL is set)."""
    settings = Settings()
    host = args.host or settings.host
    port = args.port if args.port is not None else settings.port
    if not settings.api_keys and not _is_loopback(host):
        print(
            f"flowcast: refusing to listen on {host} without FLOWCAST_API_KEYS; "
            "without keys the API is open, so it binds to 127.0.0.1 only",
            file=sys.stderr,
        )
        return 2
    if not settings.api_keys:
        print("flowcast: no FLOWCAST_API_KEYS set; listening on loopback only", file=sys.stderr)
    uvicorn.run(
        "app.main:create_app",
        factory=True,
        host=host,
        port=port,
        log_config=None,
        timeout_graceful_shutdown=int(settings.shutdown_grace_seconds) + 5,
    )
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="flowcast", description=__doc__)
    commands = top.add_subparsers(dest="command", required=True)
    run_server = commands.add_parser("serve", help="run the server")
    run_server.add_argument("--host", help="listen address (default FLOWCAST_HOST or 127.0.0.1)")
    run_server.add_argument("--port", type=int, help="listen port (default FLOWCAST_PORT or 8000)")
    run_server.set_defaults(handler=serve)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    handler = args.handler
    result: int = handler(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
