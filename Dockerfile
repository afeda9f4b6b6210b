# Granary's container image: one `granary` binary for every role (master, worker, fuse,
# the CLI). Multi-stage: build with cargo on the Rust image, run on Debian slim with fuse3.
#
#   docker build -t granary:dev .        (scripts/build-image checks it is the tested binary)
#
# The Helm chart (charts/granary) runs it as `granary <command> --config ...`.

# The toolchain the tests run with (rust-toolchain: stable 1.95 on the CI machines).
FROM rust:1.95-bookworm AS build
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      clang libclang-dev g++ \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The same build as the tests' binary, in release mode, with the locked dependencies.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p granary-cli \
 && install -m 0755 target/release/granary /usr/local/bin/granary

FROM debian:bookworm-slim
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      fuse3 ca-certificates util-linux \
 && rm -rf /var/lib/apt/lists/* \
 && echo user_allow_other >> /etc/fuse.conf
COPY --from=build /usr/local/bin/granary /usr/local/bin/granary
ENTRYPOINT ["granary"]
CMD ["--help"]
