"""The Docker image and the compose stack, checked for their structure.

No Docker engine runs on the development machines or in CI, so these tests read the
files: the stages, the user, the healthchecks, the wiring between services. (The proxy's
configuration runs for real in tests/e2e/deploy/test_proxy.py.)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from app.settings import Settings

ROOT = Path(__file__).resolve().parents[3]
TEMPLATE = ROOT / "deploy" / "nginx.conf.template"


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return loaded


def test_the_image_is_built_in_two_stages_and_runs_as_a_non_root_user() -> None:
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    stages = [line for line in lines if line.startswith("FROM ")]
    assert len(stages) == 2 and stages[0].endswith(" AS build")
    assert any(line.startswith("COPY --from=build") for line in lines)
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert any(line.startswith("HEALTHCHECK") for line in lines)
    command = [line for line in lines if line.startswith("CMD ")][-1]  # the last CMD wins
    assert "--factory" in command and "app.main:create_app" in command


def test_the_image_copies_only_what_it_runs() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    for path in (".venv", ".git", "tests", ".flowcast"):
        assert path in ignored


def test_compose_runs_two_replicas_on_redis_with_aof_and_minio() -> None:
    services = compose()["services"]
    assert {"redis", "minio", "minio-bucket", "flowcast-1", "flowcast-2"} <= services.keys()
    assert "--appendonly" in services["redis"]["command"]
    for name in ("redis", "minio"):
        assert "test" in services[name]["healthcheck"], name


def test_compose_publishes_one_address_the_proxy_and_keeps_the_replicas_behind_it() -> None:
    services = compose()["services"]
    published = {name: service["ports"] for name, service in services.items() if "ports" in service}
    assert published == {"proxy": ["8000:8000"]}
    proxy = services["proxy"]
    assert proxy["image"].startswith("nginx:")
    assert "test" in proxy["healthcheck"]
    assert set(proxy["depends_on"]) == {"flowcast-1", "flowcast-2"}


def test_the_proxy_renders_the_repository_template_with_every_variable_it_uses() -> None:
    services = compose()["services"]
    proxy = services["proxy"]
    [mount] = proxy["volumes"]
    source, target, _ = mount.split(":")
    assert (ROOT / source).resolve() == TEMPLATE
    # The image renders /etc/nginx/templates/X.conf.template into conf.d/X.conf.
    assert target == "/etc/nginx/templates/default.conf.template"
    text = TEMPLATE.read_text()
    # envsubst and tests/support/proxy.py (string.Template) read "$$" differently.
    assert "$$" not in text
    env = proxy["environment"]
    assert set(re.findall(r"\$\{(\w+)\}", text)) == set(env)
    assert {env["REPLICA_1"], env["REPLICA_2"]} == {"flowcast-1:8000", "flowcast-2:8000"}
    assert proxy["ports"] == [f"{env['PROXY_LISTEN']}:{env['PROXY_LISTEN']}"]
    # nginx refuses the bodies the replicas would: the same variable, the same default.
    replica_cap = services["flowcast-1"]["environment"]["FLOWCAST_MAX_BODY_BYTES"]
    assert env["MAX_BODY_BYTES"] == replica_cap
    default = re.fullmatch(r"\$\{FLOWCAST_MAX_BODY_BYTES:-(\d+)\}", replica_cap)
    assert default is not None
    assert int(default[1]) == Settings.model_fields["max_body_bytes"].default


def test_every_replica_is_wired_to_the_same_redis_bucket_keys_and_secret() -> None:
    services = compose()["services"]
    replicas = [services["flowcast-1"], services["flowcast-2"]]
    environments = [replica["environment"] for replica in replicas]
    assert environments[0] == environments[1]
    env = environments[0]
    assert env["FLOWCAST_REDIS_URL"].startswith("redis://redis:")
    assert env["FLOWCAST_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert env["FLOWCAST_S3_BUCKET"]
    assert "FLOWCAST_API_KEYS" in env and "FLOWCAST_SECRET_KEY" in env
    for replica in replicas:
        assert replica["build"] == "."
        conditions = {name: dep["condition"] for name, dep in replica["depends_on"].items()}
        assert conditions == {
            "redis": "service_healthy",
            "minio-bucket": "service_completed_successfully",
        }


def test_the_bucket_is_created_with_a_lifecycle_rule_once_minio_is_healthy() -> None:
    bucket = compose()["services"]["minio-bucket"]
    assert bucket["depends_on"]["minio"]["condition"] == "service_healthy"
    script = " ".join(bucket["entrypoint"])
    assert "mc mb" in script and "flowcast-values" in script and "ilm rule add" in script


def test_the_lifecycle_rule_covers_the_prefix_the_replicas_write_values_under() -> None:
    services = compose()["services"]
    prefix = services["flowcast-1"]["environment"]["FLOWCAST_S3_PREFIX"]
    script = " ".join(services["minio-bucket"]["entrypoint"])
    assert f"--prefix {prefix} " in script
    # The README's rule for other S3 stores names the same prefix.
    assert f'"Filter": {{"Prefix": "{prefix}"}}' in (ROOT / "README.md").read_text()


def test_compose_runs_two_workers_beside_api_replicas_that_run_no_work() -> None:
    services = compose()["services"]
    for name in ("flowcast-1", "flowcast-2"):
        assert services[name]["environment"]["FLOWCAST_WORKER_SLOTS"] == "0", name
    worker = services["worker"]
    assert worker["command"] == ["flowcast", "worker"]
    assert worker["deploy"]["replicas"] == 2
    assert worker["build"] == "." and "ports" not in worker
    slots = re.fullmatch(
        r"\$\{FLOWCAST_WORKER_SLOTS:-(\d+)\}", worker["environment"]["FLOWCAST_WORKER_SLOTS"]
    )
    assert slots is not None and int(slots[1]) > 0
    # The same Redis, bucket, keys, secret and tenant weights as the API replicas.
    api = dict(services["flowcast-1"]["environment"])
    shared = {k: v for k, v in worker["environment"].items() if k != "FLOWCAST_WORKER_SLOTS"}
    assert shared == {k: v for k, v in api.items() if k != "FLOWCAST_WORKER_SLOTS"}
    assert worker["depends_on"] == services["flowcast-1"]["depends_on"]
    assert worker["stop_grace_period"] == services["flowcast-1"]["stop_grace_period"]
