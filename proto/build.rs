//! Generates the tonic/prost code from `proto/granary/v1/*.proto`, the masters' stored state
//! (`proto/granary/state/v1/state.proto`) and the CSI spec's part
//! that `granary csi` serves (`proto/csi/v1/csi.proto`), with a vendored protoc,
//! so building Granary needs no protoc install.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // Only this build script's process sees PROTOC: raft-proto's build needs a 3.x protoc.
    std::env::set_var("PROTOC", protoc);
    let files = [
        "proto/granary/v1/common.proto",
        "proto/granary/v1/master.proto",
        "proto/granary/v1/worker.proto",
        "proto/granary/v1/raft.proto",
        "proto/granary/v1/fuse.proto",
        "proto/csi/v1/csi.proto",
        "proto/granary/state/v1/state.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .bytes(".")
        // Stored records encode their maps in key order: the same record, the same bytes.
        .btree_map(".granary.state.v1")
        .compile_protos(&files, &["proto"])?;
    Ok(())
}
