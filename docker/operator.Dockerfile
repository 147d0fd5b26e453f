# The operator image: kopf + kubernetes client + the JAX-free training config schema. No JAX.
#   docker build -f docker/operator.Dockerfile -t diloco-operator:dev .
ARG BASE=python:3.11-slim
# Three stages so that a change to the sources alone rebuilds in seconds and adds a small layer:
# the dependencies' venv is a cached layer of its own, the project goes in as one wheel.
FROM ${BASE} AS deps
ARG PIP_NO_INDEX=
ENV PIP_FIND_LINKS=/src PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
# .wheels (optional: e2e/node/images.sh provides it) lands as loose wheels in /src, a find-links
# folder; the glob lets the build go on without it.
# cpu.txt: every dependency pinned (docker/lock.py), so two builds hold the same packages.
# (a stub README: the package metadata needs one, the dependencies do not need ours)
COPY pyproject.toml docker/locks/cpu.txt .wheel[s] ./
RUN mkdir -p operator/diloco_operator trainer/diloco_trainer \
 && touch README.md operator/diloco_operator/__init__.py trainer/diloco_trainer/__init__.py \
 && python3 -m venv /opt/diloco \
 && PIP_NO_INDEX=${PIP_NO_INDEX} /opt/diloco/bin/pip install -c cpu.txt ".[operator]" \
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
ENV PATH=/opt/diloco/bin:$PATH PYTHONUNBUFFERED=1 USER=diloco LOGNAME=diloco HOME=/tmp
# Fail the build if JAX sneaks in through a dependency: the operator must stay light.
RUN python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('jax') is not None)" \
 && python3 -c "import diloco_operator.k8s.handlers"
# uid 65532 has no passwd entry: USER/LOGNAME above answer getpass.getuser() (kopf names its
# peering identity with it and crashed without).
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["diloco-operator"]
CMD ["--all-namespaces"]
