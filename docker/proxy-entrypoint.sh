#!/bin/bash
# CI stand-in for the official nginx image's entrypoint (docker/proxy.Dockerfile): what it does
# before the command runs, with the same files and variables. First every executable
# /docker-entrypoint.d/*.envsh is sourced, in version order (docker-compose.yml mounts
# deploy/nginx/trusted-proxies.envsh there, which exports PROXY_REAL_IP_FROM); then, as its
# 20-envsubst-on-templates.sh, each $NGINX_ENVSUBST_TEMPLATE_DIR/<name>.template becomes
# $NGINX_ENVSUBST_OUTPUT_DIR/<name>, with the environment variables whose names match
# $NGINX_ENVSUBST_FILTER (all when unset) replaced, and no others.
set -euo pipefail

if [ "${1:-}" = "nginx" ]; then
  if [ -d /docker-entrypoint.d ]; then
    while read -r script; do
      if [ -x "$script" ]; then
        echo "$0: sourcing $script" >&2
        # shellcheck disable=SC1090
        . "$script"
      else
        echo "$0: ignoring $script, not executable" >&2
      fi
    done < <(find /docker-entrypoint.d/ -follow -type f -name '*.envsh' -print | sort -V)
  fi
  template_dir="${NGINX_ENVSUBST_TEMPLATE_DIR:-/etc/nginx/templates}"
  suffix="${NGINX_ENVSUBST_TEMPLATE_SUFFIX:-.template}"
  output_dir="${NGINX_ENVSUBST_OUTPUT_DIR:-/etc/nginx/conf.d}"
  filter="${NGINX_ENVSUBST_FILTER:-}"
  defined=$(printf '${%s} ' $(awk "END { for (name in ENVIRON) { print ( name ~ /${filter}/ ) ? name : \"\" } }" </dev/null))
  if [ -d "$template_dir" ]; then
    find "$template_dir" -follow -type f -name "*$suffix" -print | while read -r template; do
      relative="${template#"$template_dir/"}"
      output="$output_dir/${relative%"$suffix"}"
      mkdir -p "$(dirname "$output")"
      echo "$0: rendering $template to $output" >&2
      envsubst "$defined" <"$template" >"$output"
    done
  fi
fi
exec "$@"
