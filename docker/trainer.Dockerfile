# The trainer image for TPU: learner (diloco-learner) and syncer (diloco-syncer), JAX with libtpu.
# docker build -f docker/trainer.Dockerfile -t diloco-trainer:dev .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY trainer ./trainer
RUN pip install --no-cache-dir --prefix=/install ".[trainer]" "jax[tpu]"

FROM python:3.11-slim
COPY --from=build /install /usr/local
RUN python -c "import diloco_trainer.config, jax" \
 && mkdir -p /var/lib/diloco/checkpoints && chown 65532:65532 /var/lib/diloco/checkpoints
# TPU device access needs the pod's privileges from GKE (google.com/tpu limits), not root.
USER 65532:65532
ENV PYTHONUNBUFFERED=1
EXPOSE 8470
# The operator sets the command (diloco-learner or diloco-syncer --config /etc/diloco/run.yaml).
CMD ["diloco-learner", "--help"]
