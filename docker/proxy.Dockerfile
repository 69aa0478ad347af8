# CI only (`make compose-test`, tests/compose/ci.yml): stands in for nginx:1.27-bookworm where no registry can
# be reached. The nginx binary of Debian bookworm's `nginx` package (1.22; `make nginx` unpacks the same one
# for the tests) and envsubst from `gettext-base`, laid out as the official image: /var/cache/nginx for the
# rendered configuration and temporary files, STOPSIGNAL SIGQUIT, and an entrypoint that renders
# /etc/nginx/templates/*.template with the same NGINX_ENVSUBST_* variables before it runs the command.
# docker-compose.yml's own command, environment, volume, ports and healthcheck apply unchanged.
#
# Build context: the folder holding the downloaded .debs and the entrypoint (.cache/compose/proxy, filled by
# tests/compose/driver.py):
#   docker build -f docker/proxy.Dockerfile .cache/compose/proxy
ARG PYTHON_IMAGE=flask-triton-shim-ci/python:3.11-bookworm

FROM ${PYTHON_IMAGE} AS unpack
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY nginx_*.deb gettext-base_*.deb /tmp/
RUN mkdir /tmp/root \
 && dpkg-deb --fsys-tarfile /tmp/nginx_*.deb | tar -x -C /tmp/root ./usr/sbin/nginx \
 && dpkg-deb --fsys-tarfile /tmp/gettext-base_*.deb | tar -x -C /tmp/root ./usr/bin/envsubst

FROM ${PYTHON_IMAGE}
COPY --from=unpack /tmp/root/usr/sbin/nginx /usr/sbin/nginx
COPY --from=unpack /tmp/root/usr/bin/envsubst /usr/bin/envsubst
COPY proxy-entrypoint.sh /docker-entrypoint.sh
RUN mkdir -p /etc/nginx/templates /var/cache/nginx \
 && chmod 0755 /docker-entrypoint.sh \
 && nginx -V
EXPOSE 8080
STOPSIGNAL SIGQUIT
ENTRYPOINT ["/docker-entrypoint.sh"]
CMD ["nginx", "-g", "daemon off;"]
