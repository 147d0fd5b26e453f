# The trainer image for TPU: learner (diloco-learner) and syncer (diloco-syncer), JAX with libtpu.
#   docker build -f docker/trainer.Dockerfile -t diloco-trainer:dev .
ARG BASE=python:3.11-slim
# Three stages so that a change to the sources alone rebuilds in seconds and adds a small layer:
# the dependencies' venv is a cached layer of its own, the project goes in as one wheel.
FROM ${BASE} AS deps
ARG PIP_NO_INDEX=
ENV PIP_FIND_LINKS=/src PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
# .wheels (optional: e2e/node/images.sh provides it) lands as loose wheels in /src, a find-links
# folder; the glob lets the build go on without it.
# tpu.txt: every dependency pinned (docker/lock.py), so two builds hold the same packages.
# (a stub README: the package metadata needs one, the dependencies do not need ours)
COPY pyproject.toml docker/locks/tpu.txt .wheel[s] ./
RUN mkdir -p operator/diloco_operator trainer/diloco_trainer \
 && touch README.md operator/diloco_operator/__init__.py trainer/diloco_trainer/__init__.py \
 && python3 -m venv /opt/diloco \
 && PIP_NO_INDEX=${PIP_NO_INDEX} /opt/diloco/bin/pip install -c tpu.txt ".[trainer,gcs]" "jax[tpu]" \
 && /opt/diloco/bin/pip uninstall -y elastic-diloco

FROM deps AS code
COPY README.md ./
COPY operator ./operator
COPY trainer ./trainer
RUN PIP_NO_INDEX=${PIP_NO_INDEX} /opt/diloco/bin/pip wheel --no-deps -w /dist .

FROM ${BASE}
COPY --from=deps /opt/diloco /opt/diloco
COPY --from=code /dist /tmp/dist
RUN /opt/diloco/bin/pip install --no-deps --no-index --no-cache-dir /tmp/dist/*.whl \
 && rm -rf /tmp/dist
ENV PATH=/opt/diloco/bin:$PATH PYTHONUNBUFFERED=1 USER=diloco LOGNAME=diloco \
    HOME=/home/diloco DILOCO_CACHE_DIR=/home/diloco/.cache/diloco
RUN python3 -c "import diloco_trainer.config, jax" \
 && mkdir -p /var/lib/diloco/checkpoints /home/diloco/.cache/diloco \
 && chown -R 65532:65532 /var/lib/diloco /home/diloco
# TPU device access needs the pod's privileges from GKE (google.com/tpu limits), not root.
# uid 65532 has no passwd entry: USER/LOGNAME above answer getpass.getuser() (kopf names its
# peering identity with it and crashed without).
USER 65532:65532
EXPOSE 8470
# The operator sets the command (diloco-learner or diloco-syncer --config /etc/diloco/run.yaml).
CMD ["diloco-learner", "--help"]
