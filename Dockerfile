# Flowcast: build the wheels in one stage, run them as a non-root user in a slim one.
#   docker build -t flowcast .
#   docker run --rm -p 8000:8000 -e FLOWCAST_API_KEYS=change-me flowcast
# API keys are required: a published port reaches the server through the container's
# own network interface, never its loopback, and a server without FLOWCAST_API_KEYS
# answers loopback only (403 loopback_only; `flowcast serve` refuses to start at all).
# Without FLOWCAST_REDIS_URL the server runs its embedded Valkey, with that data, the
# large values and the generated secret key under /srv/flowcast/data; mount a volume
# there to keep them (-v flowcast-data:/srv/flowcast/data). The default command is the
# app factory under uvicorn; `flowcast serve` runs the same server (same settings):
#   docker run --rm -p 8000:8000 -e FLOWCAST_API_KEYS=change-me flowcast flowcast serve
# On Redis and S3, with replicas, see docker-compose.yml: every replica needs the same
# FLOWCAST_API_KEYS and FLOWCAST_SECRET_KEY. `flowcast worker` runs a process of the same
# image that only runs queued work (health and metrics on port 8000, no API):
#   docker run --rm -e FLOWCAST_API_KEYS=… -e FLOWCAST_SECRET_KEY=… -e FLOWCAST_REDIS_URL=… flowcast flowcast worker

# The base image is pinned to one Python and one Debian release (bump both FROM lines
# together), and the dependencies to the versions in requirements.lock (`make lock`).
FROM python:3.11.16-slim-bookworm AS build
WORKDIR /src
# The locked dependencies first, each alone (--no-deps: nothing the lock does not name
# comes in); this layer is built again only when the lock changes.
COPY requirements.lock ./
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels -r requirements.lock
COPY pyproject.toml README.md ./
COPY app ./app
COPY lib ./lib
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11.16-slim-bookworm
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin flowcast
COPY --from=build /wheels /wheels
# Exactly the wheels built above, nothing resolved again; `pip check` fails the build if
# the lock lacks a dependency of Flowcast's or pins one it does not accept (extras, such
# as uvicorn[standard]'s, it does not follow: tests/e2e/deploy/test_deploy.py does).
RUN pip install --no-cache-dir --no-index --no-deps /wheels/*.whl && pip check && rm -rf /wheels
WORKDIR /srv/flowcast
# The examples are the demo workflows: mount your own directory over this one
# (-v "$PWD/workflows:/srv/flowcast/workflows:ro") and yours replace them.
COPY --chown=flowcast:flowcast examples ./workflows
RUN mkdir data && chown flowcast:flowcast data
USER flowcast
ENV FLOWCAST_HOST=0.0.0.0 \
    FLOWCAST_PORT=8000 \
    FLOWCAST_DATA_DIR=/srv/flowcast/data \
    FLOWCAST_WORKFLOWS_DIR=/srv/flowcast/workflows \
    PYTHONUNBUFFERED=1
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=2).status != 200)"]
CMD ["uvicorn", "--factory", "app.main:create_app", "--host", "0.0.0.0", "--port", "8000", "--timeout-graceful-shutdown", "40", "--backlog", "16384"]
