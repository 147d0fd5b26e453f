# The trainer image for CPU clusters (kind, examples/kind-cpu.yaml): same programs, CPU JAX.
# docker build -f docker/trainer-cpu.Dockerfile -t diloco-trainer-cpu:dev . && kind load docker-image diloco-trainer-cpu:dev
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY trainer ./trainer
RUN pip install --no-cache-dir --prefix=/install ".[trainer]"

FROM python:3.11-slim
COPY --from=build /install /usr/local
RUN python -c "import diloco_trainer.config, jax" \
 && mkdir -p /var/lib/diloco/checkpoints && chown 65532:65532 /var/lib/diloco/checkpoints
USER 65532:65532
ENV PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu
EXPOSE 8470
CMD ["diloco-learner", "--help"]
