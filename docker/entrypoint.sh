#!/bin/sh
# `IMAGE` serves the default model; `IMAGE MODEL [flags]` or `IMAGE --flag ...` passes everything to `kvserve serve`.
# The server listens on 0.0.0.0:8000 unless --host/--port are given.
set -e
case " $* " in
  *" --host "*|*" --host="*) host_args="" ;;
  *) host_args="--host 0.0.0.0" ;;
esac
case " $* " in
  *" --port "*|*" --port="*) port_args="" ;;
  *) port_args="--port 8000" ;;
esac
# shellcheck disable=SC2086
exec kvserve serve "$@" $host_args $port_args
