#!/bin/sh
# The image's entrypoint: `gptoss-max serve` configured by the environment (see the Dockerfile);
# arguments given to `docker run IMAGE ...` are passed on as more serve flags.
set -eu
if [ -n "${API_KEY:-}" ]; then
  GPTOSS_MAX_API_KEY=$API_KEY
  export GPTOSS_MAX_API_KEY
fi
set -- --model "${MODEL:-auto}" --devices "${DEVICES:-auto}" --host "${HOST:-0.0.0.0}" \
  --port "${PORT:-8000}" "$@"
if [ "${ENABLE_BENCH:-0}" = 1 ]; then set -- "$@" --enable-bench; fi
exec gptoss-max serve "$@"
