#!/bin/sh
# The image's entrypoint: one image, three roles, chosen by the first argument
# or DISAGG_ROLE. Everything after the role goes to the part as flags.
#
#   entrypoint.sh router  --prefill dns:///prefill.ns.svc.cluster.local:50051 --decode ...
#   entrypoint.sh prefill --decode dns:///decode.ns.svc.cluster.local:50061 --tp-degree 8
#   entrypoint.sh decode  --batch-size 16
#   entrypoint.sh probe   [--service liveness]      (a health check of this container's part)
#
# Settings that every role shares come from the environment (the Helm chart sets them):
#   DISAGG_MODEL           checkpoint directory (unset: the built-in tiny model, made on first use)
#   DISAGG_PORT            gRPC port (unset: the part's default, 50050 / 50051 / 50061)
#   DISAGG_METRICS_PORT    Prometheus port (unset: 9400 / 9401 / 9402)
#   DISAGG_HOST            interface to bind (unset: all interfaces, as a pod needs)
#   DISAGG_GRACE_SECONDS   drain time on SIGTERM
#   DISAGG_TLS_DIR         mutual TLS between the parts: tls.crt, tls.key, ca.crt (a cert-manager Secret)
#   DISAGG_TLS_SERVER_NAME the name in that certificate that peers check (pods are dialled by IP)
#   DISAGG_PUBLIC_TLS_DIR  router only: tls.crt, tls.key for the public port
#   DISAGG_LOG_LEVEL, DISAGG_AUTH_TOKEN are read by the parts themselves.
set -eu

role="${DISAGG_ROLE:-}"
case "${1:-}" in
  router | prefill | decode | probe) role="$1"; shift ;;
esac
# The probe checks the part this container runs (DISAGG_ROLE).
part="$role"
[ "$role" = probe ] && part="${DISAGG_ROLE:-}"
case "$part" in
  router) module=router ;;
  prefill) module=prefill_worker ;;
  decode) module=decode_worker ;;
  *)
    echo "entrypoint: give the role (router, prefill or decode) as the first argument or in DISAGG_ROLE" >&2
    exit 2
    ;;
esac

check_tls_dir() {
  for file in tls.crt tls.key ca.crt; do
    if [ ! -f "$1/$file" ]; then
      echo "entrypoint: DISAGG_TLS_DIR=$1 has no $file (a cert-manager Secret has tls.crt, tls.key and ca.crt)" >&2
      exit 2
    fi
  done
}
[ -n "${DISAGG_TLS_DIR:-}" ] && check_tls_dir "$DISAGG_TLS_DIR"
tls_name=""
[ -n "${DISAGG_TLS_DIR:-}" ] && [ -n "${DISAGG_TLS_SERVER_NAME:-}" ] && tls_name="$DISAGG_TLS_SERVER_NAME"

if [ "$role" = probe ]; then
  case "$part" in router) port="${DISAGG_PORT:-50050}" ;; prefill) port="${DISAGG_PORT:-50051}" ;; *) port="${DISAGG_PORT:-50061}" ;; esac
  host="${DISAGG_HOST:-127.0.0.1}"
  set -- "$host:$port" "$@"
  if [ "$part" = router ] && [ -n "${DISAGG_PUBLIC_TLS_DIR:-}" ]; then
    set -- "$@" --tls-ca "$DISAGG_PUBLIC_TLS_DIR/ca.crt"
    [ -n "${DISAGG_TLS_SERVER_NAME:-}" ] && set -- "$@" --tls-server-name "$DISAGG_TLS_SERVER_NAME"
  elif [ "$part" != router ] && [ -n "${DISAGG_TLS_DIR:-}" ]; then
    set -- "$@" --tls-cert "$DISAGG_TLS_DIR/tls.crt" --tls-key "$DISAGG_TLS_DIR/tls.key" --tls-ca "$DISAGG_TLS_DIR/ca.crt"
    [ -n "$tls_name" ] && set -- "$@" --tls-server-name "$tls_name"
  fi
  exec python -m disagg.rpc.healthcheck "$@"
fi

[ -n "${DISAGG_MODEL:-}" ] && set -- --model "$DISAGG_MODEL" "$@"
[ -n "${DISAGG_PORT:-}" ] && set -- --port "$DISAGG_PORT" "$@"
[ -n "${DISAGG_METRICS_PORT:-}" ] && set -- --metrics-port "$DISAGG_METRICS_PORT" "$@"
[ -n "${DISAGG_GRACE_SECONDS:-}" ] && set -- --grace-seconds "$DISAGG_GRACE_SECONDS" "$@"
if [ -n "${DISAGG_HOST:-}" ]; then
  set -- --host "$DISAGG_HOST" "$@"
else
  set -- --bind-all "$@"
fi
if [ -n "${DISAGG_TLS_DIR:-}" ]; then
  [ -n "$tls_name" ] && set -- --tls-server-name "$tls_name" "$@"
  set -- --tls-cert "$DISAGG_TLS_DIR/tls.crt" --tls-key "$DISAGG_TLS_DIR/tls.key" --tls-ca "$DISAGG_TLS_DIR/ca.crt" "$@"
fi
if [ "$part" = router ] && [ -n "${DISAGG_PUBLIC_TLS_DIR:-}" ]; then
  set -- --public-tls-cert "$DISAGG_PUBLIC_TLS_DIR/tls.crt" --public-tls-key "$DISAGG_PUBLIC_TLS_DIR/tls.key" "$@"
fi
exec python -m "$module" "$@"
