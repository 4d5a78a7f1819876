# Multi-stage build of the amqp-delay binaries.
#   docker build -t amqp-delay .
#   docker run --rm amqp-delay                      # prints delay-publisher --help
#   docker run --rm -e AMQP_URL=... amqp-delay delay-consumer --queue orders.timeout --log

# ---- build ------------------------------------------------------------------
FROM rust:1-bookworm AS builder
WORKDIR /src
COPY . .
RUN cargo build --release --locked

# ---- runtime ----------------------------------------------------------------
FROM debian:bookworm-slim
# CA certificates for amqps:// connections.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=builder /src/target/release/delay-publisher \
                    /src/target/release/delay-consumer \
                    /src/target/release/delay-bench \
                    /usr/local/bin/
# Run as an unprivileged user.
RUN useradd --system --no-create-home --shell /usr/sbin/nologin amqp-delay
USER amqp-delay
CMD ["delay-publisher", "--help"]
