# The base images are arguments so that CI, which cannot reach a registry, can build
# with stand-ins of its own (.ci/images); users get the official ones. No `# syntax=`
# line: it makes BuildKit fetch a frontend image, which fails offline.
ARG RUST_IMAGE=rust:1.95-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

# ---------------------------------------------------------------------------
# Builder
# ---------------------------------------------------------------------------
FROM ${RUST_IMAGE} AS builder
WORKDIR /build

# 1. Dependencies only: build a dummy crate with the real manifest and lock
#    file, so this (slow) layer is cached until Cargo.toml/Cargo.lock change.
#    The examples the compose demo runs (`timeoutd-consume`, `timeoutd-delay`)
#    are built too; examples may use dev-dependencies, so they are compiled here
#    as well.
COPY Cargo.toml Cargo.lock build.rs ./
COPY timeoutd-client/Cargo.toml timeoutd-client/
COPY timeoutd-bench/Cargo.toml timeoutd-bench/
COPY timeoutd-sim/Cargo.toml timeoutd-sim/
# sqlx-core with upstream's TCP_NODELAY fix (see Cargo.toml's [patch]): a real dependency.
COPY vendor/ vendor/
RUN mkdir -p src examples migrations config timeoutd-client/src timeoutd-bench/src \
    timeoutd-sim/src/bin \
 && echo 'fn main() {}' > src/main.rs \
 && echo 'fn main() {}' > examples/consume.rs \
 && echo 'fn main() {}' > examples/delay.rs \
 && : > src/lib.rs \
 && : > timeoutd-client/src/lib.rs \
 && echo 'fn main() {}' > timeoutd-bench/src/main.rs \
 && : > timeoutd-sim/src/lib.rs \
 && echo 'fn main() {}' > timeoutd-sim/src/bin/election-sim.rs \
 && cargo build --release --locked -p timeoutd --bin timeoutd --example consume \
      --example delay \
 && rm -rf src examples timeoutd-client/src

# 2. The real sources. COPY keeps the files' original mtimes, which may be
#    older than the dummy build above, so touch them to force a rebuild. (The
#    benchmark and simulator crates are workspace members only: their dummies stay.)
COPY src/ src/
COPY timeoutd-client/src/ timeoutd-client/src/
COPY examples/ examples/
COPY migrations/ migrations/
COPY config/ config/
RUN touch src/main.rs src/lib.rs build.rs examples/consume.rs examples/delay.rs \
      timeoutd-client/src/lib.rs \
 && cargo build --release --locked -p timeoutd --bin timeoutd --example consume \
      --example delay \
 && strip target/release/timeoutd target/release/examples/consume \
      target/release/examples/delay

# ---------------------------------------------------------------------------
# Runtime
# ---------------------------------------------------------------------------
FROM ${RUNTIME_IMAGE} AS runtime

# rustls is used for TLS (no OpenSSL); ca-certificates for the native roots,
# curl for the compose healthcheck (GET /healthz).
# No setuid or setgid program stays (the base image ships su, mount, passwd, …): the
# daemon runs as 10001 and never needs to gain privileges, and such a program is the
# usual next step of someone who got code running in the container. The build fails
# if one is left.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 timeoutd \
 && useradd --system --uid 10001 --gid 10001 --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin timeoutd \
 && find / -xdev -perm /6000 -type f -exec chmod a-s {} + \
 && if find / -xdev -perm /6000 -type f | grep .; then \
      echo "setuid/setgid programs left (above)" >&2; exit 1; \
    fi

COPY --from=builder /build/target/release/timeoutd /usr/local/bin/timeoutd
# Demo only: prints the messages arriving on a queue (examples/consume.rs), and
# publishes a delayed message (examples/delay.rs).
COPY --from=builder /build/target/release/examples/consume /usr/local/bin/timeoutd-consume
COPY --from=builder /build/target/release/examples/delay /usr/local/bin/timeoutd-delay
COPY --from=builder /build/config/default.toml /etc/timeoutd/default.toml

# Listen on all interfaces inside the container: the built-in default is loopback
# only, which the kubelet's probes, Prometheus and a published port cannot reach. The
# endpoints need no credentials and show the group, its members and its backlog: who
# may reach the port is the deployment's to decide (compose publishes it on
# 127.0.0.1 only; deploy/kubernetes/networkpolicy.yaml lets only the scraper's
# namespace in).
ENV TIMEOUTD__HTTP__LISTEN=0.0.0.0:9464
EXPOSE 9464

USER 10001
STOPSIGNAL SIGTERM
ENTRYPOINT ["timeoutd"]
CMD ["run"]
