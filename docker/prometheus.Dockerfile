# CI only (`make compose-test`, tests/compose/ci.yml): stands in for prom/prometheus where no registry
# can be reached. The server binary of Debian bookworm's `prometheus` package (2.42; the Makefile takes
# promtool from the same package), laid out as the official image: entrypoint /bin/prometheus, config in
# /etc/prometheus, data in /prometheus, user nobody. docker-compose.yml's own command and mounts apply.
#
# Build context: the folder holding the downloaded prometheus_*.deb (.cache/compose/prometheus):
#   docker build -f docker/prometheus.Dockerfile .cache/compose/prometheus
ARG PYTHON_IMAGE=flask-triton-shim-ci/python:3.11-bookworm

FROM ${PYTHON_IMAGE} AS unpack
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY prometheus_*.deb /tmp/
RUN dpkg-deb --fsys-tarfile /tmp/prometheus_*.deb | tar -x -C /tmp ./usr/bin/prometheus

FROM ${PYTHON_IMAGE}
COPY --from=unpack /tmp/usr/bin/prometheus /bin/prometheus
# A named volume mounted at /prometheus takes this owner and content, so that nobody may write there.
# Without --storage.tsdb.path (docker-compose.yml passes none) the official image keeps its data in
# data/ under its working directory, /prometheus/data; Debian's build defaults to
# /var/lib/prometheus/metrics2/, linked there so that the data lands on the same volume.
RUN mkdir -p /etc/prometheus /prometheus/data /var/lib/prometheus \
 && ln -s /prometheus/data /var/lib/prometheus/metrics2 \
 && chown -R nobody:nogroup /prometheus
USER 65534:65534
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
