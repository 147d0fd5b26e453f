# The operator image: kopf + kubernetes client + the JAX-free training config schema. No JAX.
# docker build -f docker/operator.Dockerfile -t diloco-operator:dev .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY trainer ./trainer
RUN pip install --no-cache-dir --prefix=/install ".[operator]"

FROM python:3.11-slim
COPY --from=build /install /usr/local
# Fail the build if JAX sneaks in through a dependency: the operator must stay light.
RUN python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('jax') is not None)" \
 && python -c "import diloco_operator.handlers"
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["diloco-operator"]
CMD ["--all-namespaces"]
