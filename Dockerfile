# syntax=docker/dockerfile:1
# Multi-stage build of the amqp-delay binaries: a Rust build stage, then a small runtime image
# with delay-publisher, delay-consumer and delay-proxy only, running as an unprivileged numeric user (so
# Kubernetes' runAsNonRoot can check it). TLS (rustls, with the system's CA certificates) is
# always built in.
#
#   docker build -t amqp-delay .
#   docker run --rm amqp-delay                                   # delay-publisher --help
#   docker run --rm -e AMQP_URL=amqp://user:pass@host:5672/%2f amqp-delay \
#       delay-consumer --queue orders.timeout --log --metrics-addr 0.0.0.0:9464
#
# delay-bench is not in the image: it is the benchmark, a crate of its own (bench/):
#   cargo run --release -p amqp-delay-bench -- --help

# ---- build ------------------------------------------------------------------
# The toolchain must be at least Cargo.toml's rust-version (1.88).
FROM rust:1-bookworm AS builder
WORKDIR /src
COPY . .
# Cache mounts keep the registry and the build directory between builds (BuildKit), so a
# source change does not rebuild every dependency. Symbols are stripped: the binaries shrink
# to a fraction and panics still print their message.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    CARGO_PROFILE_RELEASE_STRIP=symbols \
    cargo build --release --locked --bin delay-publisher --bin delay-consumer --bin delay-proxy \
        --bin delay-console \
    && mkdir -p /out \
    && cp target/release/delay-publisher target/release/delay-consumer target/release/delay-proxy \
        target/release/delay-console /out/

# ---- runtime ----------------------------------------------------------------
# Debian slim rather than distroless: `delay-consumer --exec` runs commands, which need a
# shell and tools, and the compose demo publisher is a shell loop.
FROM debian:bookworm-slim AS runtime
# CA certificates for amqps:// URLs and --http https:// targets.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 amqp-delay \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
        --shell /usr/sbin/nologin amqp-delay \
    && install -d -o 10001 -g 10001 /var/lib/amqp-delay
COPY --from=builder /out/delay-publisher /out/delay-consumer /out/delay-proxy /out/delay-console \
    /usr/local/bin/
# Numeric, so that a runtime can verify "not root" without reading /etc/passwd.
USER 10001:10001
# Metrics and health on the port used throughout deploy/: the worker, relay, gateway and proxy
# serve /metrics, /healthz and /readyz there (the publisher's one-shot commands serve nothing).
ENV AMQP_DELAY_METRICS_ADDR=0.0.0.0:9464
EXPOSE 9464
CMD ["delay-publisher", "--help"]
