# gptoss-max: the Responses API server on port 8000. Not yet built in CI (no Docker daemon there);
# linted with hadolint (`make lint-ops`). See README.md, "Docker".
#
#   docker build -t gptoss-max .
#   docker run --gpus all -p 8000:8000 -v gptoss-data:/data -e HF_TOKEN gptoss-max
#
# No CUDA base image: MAX's wheels bring their own GPU libraries and need only the driver, which
# the NVIDIA container runtime mounts (NVIDIA_* below). Besides glibc (>= 2.34: manylinux_2_34
# wheels) they load libstdc++, libgcc_s and libtinfo, all in Debian's base image; every
# dependency resolves to a binary wheel for CPython 3.12 (pip --dry-run --only-binary=:all:), so
# no compiler is needed.
FROM python:3.12.8-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    XDG_CACHE_HOME=/data/cache \
    HF_HOME=/data/huggingface \
    GPTOSS_MAX_DATA=/data/gptoss-max \
    HF_XET_HIGH_PERFORMANCE=1 \
    MODEL=auto \
    DEVICES=auto \
    HOST=0.0.0.0 \
    PORT=8000

RUN useradd --create-home --uid 1000 gptoss \
    && mkdir -p /data \
    && chown gptoss:gptoss /data

WORKDIR /opt/gptoss-max
COPY pyproject.toml ./
COPY src ./src
# A current pip: older resolvers backtrack for a long time over max[serve]'s pins.
RUN pip install --no-cache-dir pip==26.3 \
    && pip install --no-cache-dir . \
    && gptoss-max --help > /dev/null
COPY scripts/docker_entrypoint.sh /usr/local/bin/gptoss-max-entrypoint

USER 1000:1000
# Weights (HF_HOME), compiled graphs and kernels (XDG_CACHE_HOME), the response store and the
# tiny CPU model (GPTOSS_MAX_DATA): mount a volume here so they outlive the container.
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60m \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ['PORT'], timeout=4)"]
ENTRYPOINT ["gptoss-max-entrypoint"]
