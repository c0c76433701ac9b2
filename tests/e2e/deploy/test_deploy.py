"""The Docker image and the compose stack, checked for their structure.

No Docker engine runs on the development machines or in CI, so these tests read the
files: the stages, the user, the healthchecks, the wiring between services, the pins,
the lock, the Prometheus targets. (The proxy's configuration runs for real in
tests/e2e/deploy/test_proxy.py; the bucket's lifecycle document is set on moto here.)
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from app.settings import Settings
from tests.support.s3 import MotoServer, s3_client, shared_bucket

pytestmark = pytest.mark.timeout(20)

ROOT = Path(__file__).resolve().parents[3]
TEMPLATE = ROOT / "deploy" / "nginx.conf.template"
LIFECYCLE = ROOT / "deploy" / "s3-lifecycle.json"
BUILT = "flowcast:local"
# A release: 1.2.3 with an optional v and variant (3.11.16-slim-bookworm, 7.4.11-alpine),
# or MinIO's RELEASE.<date>; and optionally the digest of its bytes.
PINNED = re.compile(
    r"(?P<name>[\w./-]+):(?P<tag>v?\d+\.\d+\.\d+(-[a-z0-9.]+)*"
    r"|RELEASE\.\d{4}-\d\d-\d\dT\d\d-\d\d-\d\dZ)(@sha256:[0-9a-f]{64})?"
)


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return loaded


def dockerfile() -> list[str]:
    return [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]


def flowcast_services() -> dict[str, dict[str, Any]]:
    """The services that run Flowcast: the API replicas and the workers."""
    services = compose()["services"]
    return {name: service for name, service in services.items() if service["image"] == BUILT}


def locked() -> dict[str, Version]:
    """requirements.lock as {canonical name: version}; every line pins one version."""
    pins: dict[str, Version] = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        requirement = Requirement(line)
        [spec] = requirement.specifier
        assert spec.operator == "==", line
        pins[canonicalize_name(requirement.name)] = Version(spec.version)
    return pins


def runtime_closure() -> dict[str, list[Requirement]]:
    """Every package Flowcast needs to serve, with the requirements that name it: the
    `dependencies` of pyproject.toml and its `traces` extra (the image serves traces,
    docs/traces.md), their extras, and theirs in turn (from the installed packages'
    metadata, markers evaluated for this Linux and Python, as in the image)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found: dict[str, list[Requirement]] = {}
    lines = [*project["dependencies"], *project["optional-dependencies"]["traces"]]
    pending = [Requirement(line) for line in lines]
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        seen = name in found
        found.setdefault(name, []).append(requirement)
        if seen and not requirement.extras:
            continue
        for line in importlib.metadata.requires(name) or []:
            needed = Requirement(line)
            wanted = requirement.extras or {""}
            if needed.marker is None or any(
                needed.marker.evaluate({"extra": extra}) for extra in wanted
            ):
                pending.append(needed)
    return found


def test_the_image_is_built_in_two_stages_and_runs_as_a_non_root_user() -> None:
    lines = dockerfile()
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
    # Prometheus too, but on this machine's loopback only: it has no login.
    assert published == {"proxy": ["8000:8000"], "prometheus": ["127.0.0.1:9090:9090"]}
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
        conditions = {name: dep["condition"] for name, dep in replica["depends_on"].items()}
        assert conditions == {
            "redis": "service_healthy",
            "minio-bucket": "service_completed_successfully",
        }


def test_the_bucket_job_sets_the_whole_lifecycle_configuration_from_the_repository() -> None:
    bucket = compose()["services"]["minio-bucket"]
    assert bucket["depends_on"]["minio"]["condition"] == "service_healthy"
    [mount] = bucket["volumes"]
    source, target, mode = mount.split(":")
    assert (ROOT / source).resolve() == LIFECYCLE and mode == "ro"
    script = " ".join(bucket["entrypoint"])
    assert "mc mb --ignore-existing local/flowcast-values" in script
    # `ilm rule import` replaces the configuration: run at every `up`, it adds nothing.
    assert f"mc ilm rule import local/flowcast-values < {target}" in script
    assert "rule add" not in script


def test_the_lifecycle_rule_covers_the_prefix_the_replicas_write_values_under() -> None:
    services = compose()["services"]
    prefix = services["flowcast-1"]["environment"]["FLOWCAST_S3_PREFIX"]
    [rule] = json.loads(LIFECYCLE.read_text())["Rules"]
    assert rule["Filter"] == {"Prefix": prefix} and rule["Status"] == "Enabled"
    # Expired a day after the retention period: the sweep's work, done by the store.
    retention = Settings.model_fields["retention_seconds"].default
    assert rule["Expiration"]["Days"] * 86_400 >= retention + 86_400
    # The README points other S3 stores at the same document.
    assert "deploy/s3-lifecycle.json" in (ROOT / "README.md").read_text()


@pytest.mark.timeout(60)
async def test_setting_the_lifecycle_document_again_leaves_one_rule(moto: MotoServer) -> None:
    """What the bucket job does at every `up`, on an S3 API: the document is a valid
    lifecycle configuration, and setting it twice leaves it as set once."""
    bucket = (await shared_bucket(moto))["FLOWCAST_S3_BUCKET"]
    client = s3_client(moto)
    document = json.loads(LIFECYCLE.read_text())
    for _ in range(2):
        await asyncio.to_thread(
            client.put_bucket_lifecycle_configuration,
            Bucket=bucket,
            LifecycleConfiguration=document,
        )
    stored = await asyncio.to_thread(client.get_bucket_lifecycle_configuration, Bucket=bucket)
    [rule] = stored["Rules"]
    assert rule["ID"] == "flowcast-values"
    assert rule["Filter"] == document["Rules"][0]["Filter"]
    assert rule["Expiration"] == {"Days": 2}


def test_compose_runs_two_workers_beside_api_replicas_that_run_no_work() -> None:
    services = compose()["services"]
    for name in ("flowcast-1", "flowcast-2"):
        assert services[name]["environment"]["FLOWCAST_WORKER_SLOTS"] == "0", name
    worker = services["worker"]
    assert worker["command"] == ["flowcast", "worker"]
    assert worker["deploy"]["replicas"] == 2
    assert worker["image"] == BUILT and "build" not in worker and "ports" not in worker
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


def test_every_base_image_is_pinned_to_a_release() -> None:
    services = compose()["services"]
    images = [service["image"] for service in services.values() if service["image"] != BUILT]
    bases = [line.split()[1] for line in dockerfile() if line.startswith("FROM ")]
    for image in images + bases:
        assert PINNED.fullmatch(image), f"{image} names no exact release"
    # Both stages on one Python, the one the lock was made for, on Debian bookworm.
    assert len(set(bases)) == 1
    pinned = PINNED.fullmatch(bases[0])
    assert pinned is not None
    tag = pinned["tag"]
    assert tag.endswith("-slim-bookworm")
    header = (ROOT / "requirements.lock").read_text().split("\n\n")[0]
    assert f"Python {'.'.join(tag.split('.')[:2])}," in header


def test_the_image_is_built_once_and_every_replica_and_worker_runs_it() -> None:
    services = compose()["services"]
    builders = {name: service["build"] for name, service in services.items() if "build" in service}
    assert builders == {"flowcast-1": "."}
    assert services["flowcast-1"]["image"] == BUILT
    assert set(flowcast_services()) == {"flowcast-1", "flowcast-2", "worker"}
    # The others never look for it in a registry (an older compose would fail the `up`
    # on that pull): `up` builds it before it creates their containers.
    for name in ("flowcast-2", "worker"):
        assert services[name]["pull_policy"] == "never", name


def test_the_image_installs_exactly_the_locked_dependencies() -> None:
    lines = dockerfile()
    assert "COPY requirements.lock ./" in lines
    assert (
        "RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels -r requirements.lock" in lines
    )
    # Nothing the lock does not name comes in, nor with Flowcast's own wheel, and the
    # final stage resolves nothing: it installs those wheels, and `pip check` proves
    # them complete.
    assert "RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels ." in lines
    [install] = [line for line in lines if line.startswith("RUN pip install")]
    assert "--no-index --no-deps /wheels/*.whl" in install and "pip check" in install
    # `make lock` writes it.
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^lock:", makefile, re.MULTILINE) and "> requirements.lock" in makefile


def test_the_lock_pins_every_runtime_dependency_within_its_range() -> None:
    pins = locked()
    for name, requirements in runtime_closure().items():
        assert name in pins, f"requirements.lock lacks {name} (needed by {requirements[0]})"
        for requirement in requirements:
            assert pins[name] in requirement.specifier, f"{name}=={pins[name]} vs {requirement}"


def test_the_lock_holds_no_test_or_lint_tool() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = set(runtime_closure())
    tools = {
        canonicalize_name(Requirement(line).name)
        for line in project["optional-dependencies"]["dev"]
    }
    assert not (tools - runtime) & set(locked())
    assert "flowcast" not in locked()


def test_prometheus_scrapes_every_replica_and_every_worker_by_name() -> None:
    services = compose()["services"]
    prometheus = services["prometheus"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    port = next(
        line.split("=")[1].rstrip(" \\") for line in dockerfile() if "FLOWCAST_PORT=" in line
    )
    scraped: set[str] = set()
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        for discovery in job["dns_sd_configs"]:
            # A records: one per container, so every scaled worker is a target.
            assert discovery["type"] == "A" and str(discovery["port"]) == port
            scraped |= set(discovery["names"])
    assert scraped == set(flowcast_services())
    # They serve /metrics to a scraper without a key (only this network reaches them).
    for service in flowcast_services().values():
        assert service["environment"]["FLOWCAST_METRICS_PUBLIC"] == "true"
        assert "ports" not in service


def test_compose_shows_how_to_mount_your_own_workflows_over_the_demo_ones() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    [mount] = re.findall(r"^\s*#\s+- (\./\S+:\S+:ro)$", text, re.MULTILINE)
    target = mount.split(":")[1]
    lines = dockerfile()
    assert f"FLOWCAST_WORKFLOWS_DIR={target} \\" in lines
    # The image's own workflows are the examples, in that directory.
    workdir = next(line.split()[1] for line in lines if line.startswith("WORKDIR /srv"))
    [copy] = [line for line in lines if line.startswith("COPY") and " examples " in line]
    assert f"{workdir}/{copy.split()[-1].removeprefix('./')}" == target
    # Uncommented, it is a volume of every replica and worker.
    uncommented = re.sub(r"^(\s*)# (volumes:|  - \./)", r"\1\2", text, flags=re.MULTILINE)
    services = yaml.safe_load(uncommented)["services"]
    for name in flowcast_services():
        assert services[name]["volumes"] == [mount], name
