# The hybridpd image: the routing proxy of `serve --emit k8s --target plain` (and the CLI).
#   docker build -t hybridpd:0.1.0 .   then push it and pass --proxy-image REGISTRY/hybridpd:0.1.0
# Only the core dependencies are installed (no torch, no vLLM): the proxy needs aiohttp.
FROM python:3.12.8-slim-bookworm
WORKDIR /src
COPY pyproject.toml README.md ./
COPY hybridpd ./hybridpd
COPY cli ./cli
RUN pip install --no-cache-dir . && rm -rf /src
WORKDIR /
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["python", "-m", "hybridpd_cli", "proxy"]
CMD ["--help"]
