# chatflow-gateway container: `docker build -t chatflow-gateway .` then
# `docker run -p 8000:8000 -v gateway-data:/app/data chatflow-gateway`.

# --- build: install the project and its PostgreSQL driver into a virtualenv ---
FROM python:3.12-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY migrations ./migrations
RUN pip install ".[postgres]"

# --- runtime: the virtualenv, a non-root user, a data volume ---
FROM python:3.12-slim
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    GATEWAY_LOG_FORMAT=json
RUN useradd --system --uid 10001 --user-group --home-dir /app --shell /usr/sbin/nologin gateway \
    && mkdir -p /app/data /app/config \
    && chown -R gateway:gateway /app
COPY --from=build /opt/venv /opt/venv
COPY config/gateway.toml /app/config/gateway.toml
WORKDIR /app
USER gateway
VOLUME ["/app/data"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; port = os.environ.get('GATEWAY_PORT', '8000'); sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=3).status == 200 else 1)"]
CMD ["gateway", "serve", "--host", "0.0.0.0"]
