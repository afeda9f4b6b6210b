//! `granary csi`, called as the kubelet calls a CSI node plugin (the spec's gRPC over a Unix
//! socket): Probe, GetPluginInfo, NodeGetCapabilities, NodeGetInfo, and NodePublishVolume /
//! NodeUnpublishVolume against a real FUSE mount of a real cluster, the published folders
//! read and written by ordinary programs (docs/kubernetes.md, "Volumes for pods").

use std::path::{Path, PathBuf};
use std::time::Duration;

use granary_proto::csi::v1 as csi;
use granary_tests::*;
use tonic::Code;

use csi::identity_client::IdentityClient;
use csi::node_client::NodeClient;
use csi::volume_capability::{access_mode::Mode, AccessMode, AccessType, MountVolume};

/// A running `granary csi` and clients of its two services.
struct Plugin {
    proc: Proc,
    rt: tokio::runtime::Runtime,
    identity: IdentityClient<tonic::transport::Channel>,
    node: NodeClient<tonic::transport::Channel>,
}

impl Plugin {
    fn start(root: &Path, name: &str, mount: &Path) -> Plugin {
        let socket = root.join(format!("{name}/csi.sock"));
        let endpoint = format!("unix://{}", socket.display());
        let m = mount.display().to_string();
        let mut proc = Proc::spawn(
            name,
            root,
            &[
                "csi",
                "--endpoint",
                &endpoint,
                "--mount",
                &m,
                "--node-id",
                "gpu-node-7",
            ],
        )
        .unwrap();
        proc.wait_for_line("granary csi serving", Duration::from_secs(30))
            .unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let channel = rt
            .block_on(
                tonic::transport::Endpoint::from_shared(endpoint)
                    .unwrap()
                    .connect(),
            )
            .unwrap();
        Plugin {
            proc,
            rt,
            identity: IdentityClient::new(channel.clone()),
            node: NodeClient::new(channel),
        }
    }

    fn publish(&self, r: csi::NodePublishVolumeRequest) -> Result<(), tonic::Status> {
        let mut node = self.node.clone();
        self.rt.block_on(node.node_publish_volume(r)).map(|_| ())
    }

    fn unpublish(&self, target: &Path) -> Result<(), tonic::Status> {
        let mut node = self.node.clone();
        let r = csi::NodeUnpublishVolumeRequest {
            volume_id: "vol".into(),
            target_path: target.display().to_string(),
        };
        self.rt.block_on(node.node_unpublish_volume(r)).map(|_| ())
    }
}

/// A publish request as the kubelet sends it for a PersistentVolume with these attributes.
fn volume(target: &Path, attrs: &[(&str, &str)]) -> csi::NodePublishVolumeRequest {
    csi::NodePublishVolumeRequest {
        volume_id: "vol".into(),
        target_path: target.display().to_string(),
        volume_capability: Some(csi::VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume::default())),
            access_mode: Some(AccessMode {
                mode: Mode::MultiNodeMultiWriter as i32,
            }),
        }),
        volume_context: attrs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .chain([(
                "csi.storage.k8s.io/pod.name".to_string(),
                "trainer-0".to_string(),
            )])
            .collect(),
        ..Default::default()
    }
}

fn code(r: Result<(), tonic::Status>) -> (Code, String) {
    match r {
        Ok(()) => (Code::Ok, String::new()),
        Err(s) => (s.code(), s.message().to_string()),
    }
}

/// The mount at `point`: (its root inside the file system, its options), from mountinfo.
fn mount_of(point: &Path) -> Option<(String, String)> {
    let p = point.display().to_string();
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    text.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (f.get(4) == Some(&p.as_str())).then(|| (f[3].to_string(), f[5].to_string()))
    })
}

fn sha_of(path: &Path) -> String {
    sh(&format!("sha256sum < '{}'", path.display()))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

#[test]
fn the_csi_node_plugin_publishes_folders_of_the_nodes_mount_into_pods() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let src = root.join("src");
    for (team, n) in [("team-a", 3), ("team-b", 2)] {
        std::fs::create_dir_all(src.join(team)).unwrap();
        for i in 0..n {
            random_file(&src.join(format!("{team}/s{i}.bin")), 300_000 + i * 7).unwrap();
        }
    }
    let socket = root.join("handover.sock").display().to_string();
    let c = Cluster::start_opts(root, 1, "256MiB", &src, &["--handover-socket", &socket]).unwrap();
    let mnt = c.fuse.mountpoint.clone();
    let plugin = Plugin::start(root, "csi", &mnt);
    let rt = &plugin.rt;

    // What the kubelet and the registrar ask first.
    let mut identity = plugin.identity.clone();
    let info = rt
        .block_on(identity.get_plugin_info(csi::GetPluginInfoRequest {}))
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "csi.granary.io");
    assert!(!info.vendor_version.is_empty());
    let caps = rt
        .block_on(identity.get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {}))
        .unwrap()
        .into_inner();
    assert!(
        caps.capabilities.is_empty(),
        "no controller service: {caps:?}"
    );
    let probe = rt
        .block_on(identity.probe(csi::ProbeRequest {}))
        .unwrap()
        .into_inner();
    assert_eq!(probe.ready.map(|r| r.value), Some(true));
    let mut node = plugin.node.clone();
    let ncaps = rt
        .block_on(node.node_get_capabilities(csi::NodeGetCapabilitiesRequest {}))
        .unwrap()
        .into_inner();
    assert!(ncaps.capabilities.is_empty(), "no staging: {ncaps:?}");
    let ninfo = rt
        .block_on(node.node_get_info(csi::NodeGetInfoRequest {}))
        .unwrap()
        .into_inner();
    assert_eq!(ninfo.node_id, "gpu-node-7");

    // A read-only volume of one folder: the pod sees exactly that folder, byte for byte.
    let pods = root.join("kubelet/pods");
    std::fs::create_dir_all(pods.join("p1")).unwrap();
    let t1 = pods.join("p1/mount");
    let t2 = pods.join("p2/mount");
    // A failed assertion leaves no bind behind.
    let _binds = [UnmountOnDrop(t1.clone()), UnmountOnDrop(t2.clone())];
    let ro = volume(&t1, &[("path", "/data/team-a"), ("readOnly", "true")]);
    plugin.publish(ro.clone()).unwrap();
    let (fs_root, opts) = mount_of(&t1).expect("the target is a mount");
    assert_eq!(fs_root, "/data/team-a");
    assert!(opts.split(',').any(|o| o == "ro"), "{opts}");
    assert!(opts.contains("nosuid") && opts.contains("nodev"), "{opts}");
    let listed = sh(&format!("ls '{}'", t1.display())).unwrap();
    assert_eq!(
        listed.split_whitespace().collect::<Vec<_>>(),
        ["s0.bin", "s1.bin", "s2.bin"]
    );
    for i in 0..3 {
        let name = format!("s{i}.bin");
        assert_eq!(
            sha_of(&t1.join(&name)),
            sha_of(&src.join("team-a").join(&name))
        );
    }
    let touch = std::process::Command::new("touch")
        .arg(t1.join("new"))
        .env("LC_ALL", "C")
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&touch.stderr).contains("Read-only file system"),
        "{touch:?}"
    );
    // The same publish again is done already; the same target with other arguments is not.
    plugin.publish(ro.clone()).unwrap();
    let rw_there = volume(&t1, &[("path", "/data/team-a")]);
    assert_eq!(code(plugin.publish(rw_there)).0, Code::AlreadyExists);
    let other_there = volume(&t1, &[("path", "/data/team-b"), ("readOnly", "true")]);
    assert_eq!(code(plugin.publish(other_there)).0, Code::AlreadyExists);

    // A writable volume of the whole of /data: a file written in the pod reaches the store.
    std::fs::create_dir_all(pods.join("p2")).unwrap();
    plugin.publish(volume(&t2, &[("path", "/data")])).unwrap();
    sh(&format!(
        "head -c 123457 '{}' > '{}'",
        src.join("team-b/s0.bin").display(),
        t2.join("team-b/written.bin").display()
    ))
    .unwrap();
    assert_eq!(
        std::fs::read(src.join("team-b/written.bin")).unwrap(),
        std::fs::read(src.join("team-b/s0.bin")).unwrap()[..123457]
    );

    // Refusals, each with its code, each leaving nothing behind.
    let t3 = pods.join("p3/mount");
    std::fs::create_dir_all(pods.join("p3")).unwrap();
    let cases: Vec<(csi::NodePublishVolumeRequest, Code)> = vec![
        (
            volume(&t3, &[("path", "/data/../..")]),
            Code::InvalidArgument,
        ),
        (volume(&t3, &[("path", "data")]), Code::InvalidArgument),
        (volume(&t3, &[]), Code::InvalidArgument),
        (
            volume(&t3, &[("path", "/data"), ("size", "1Gi")]),
            Code::InvalidArgument,
        ),
        (
            volume(&t3, &[("path", "/data/nothing-here")]),
            Code::NotFound,
        ),
        (
            volume(&t3, &[("path", "/data/team-a/s0.bin")]),
            Code::InvalidArgument,
        ),
        (
            volume(&t3, &[("path", "/data"), ("writeMode", "async-through")]),
            Code::FailedPrecondition,
        ),
        (
            volume(&mnt.join("data/x"), &[("path", "/data")]),
            Code::InvalidArgument,
        ),
        (
            volume(Path::new("/var/../etc/x"), &[("path", "/data")]),
            Code::InvalidArgument,
        ),
    ];
    for (r, want) in cases {
        let (got, message) = code(plugin.publish(r.clone()));
        assert_eq!(
            got, want,
            "{:?} {:?}: {message}",
            r.volume_context, r.target_path
        );
        assert!(!message.is_empty());
        assert!(mount_of(&t3).is_none(), "a refused publish left a mount");
    }

    // The node's FUSE daemon is replaced (a rolling update): the pods' binds go on.
    let m = mnt.display().to_string();
    let mut new = Proc::spawn(
        "fuse-new",
        root,
        &[
            "fuse",
            "--master",
            &c.master.addr,
            "--mount",
            &m,
            "--handover-socket",
            &socket,
            "--takeover",
        ],
    )
    .unwrap();
    new.wait_for_line("granary took over the mount", Duration::from_secs(60))
        .unwrap();
    let Cluster {
        fuse: mut old,
        workers: _workers,
        master: _master,
    } = c;
    poll("the old daemon to exit", Duration::from_secs(30), || {
        old.proc.child.try_wait().ok().flatten()
    })
    .unwrap();
    for i in 0..3 {
        let name = format!("s{i}.bin");
        assert_eq!(
            sha_of(&t1.join(&name)),
            sha_of(&src.join("team-a").join(&name))
        );
    }
    assert_eq!(
        sha_of(&t2.join("team-b/s1.bin")),
        sha_of(&src.join("team-b/s1.bin"))
    );

    // Unpublish: the bind and the folder go; again is done already.
    for t in [&t1, &t2] {
        plugin.unpublish(t).unwrap();
        assert!(mount_of(t).is_none(), "{} is still mounted", t.display());
        assert!(!t.exists(), "{} is still there", t.display());
        plugin.unpublish(t).unwrap();
    }
    // A mount that is not a Granary volume is left alone.
    std::fs::create_dir_all(&t3).unwrap();
    sh(&format!("mount -t tmpfs none '{}'", t3.display())).unwrap();
    let _unmount = UnmountOnDrop(t3.clone());
    assert_eq!(code(plugin.unpublish(&t3)).0, Code::FailedPrecondition);
    assert!(mount_of(&t3).is_some(), "the tmpfs was unmounted");
    sh(&format!("umount '{}'", t3.display())).unwrap();

    // Without its mount the plugin is not ready, and publishes wait for it.
    std::fs::create_dir_all(root.join("nothing")).unwrap();
    let lost = Plugin::start(root, "csi-lost", &root.join("nothing"));
    let mut lid = lost.identity.clone();
    let probe = lost
        .rt
        .block_on(lid.probe(csi::ProbeRequest {}))
        .unwrap()
        .into_inner();
    assert_eq!(probe.ready.map(|r| r.value), Some(false));
    assert_eq!(
        code(lost.publish(volume(&t3, &[("path", "/data")]))).0,
        Code::Unavailable
    );
    drop(new);
    drop(old);
    let _ = (plugin.proc.pid(), lost.proc.pid());
}

/// A node whose mount holds an identity confined to one folder: a volume of another folder
/// is refused with PERMISSION_DENIED, one of its own folder is published.
#[test]
fn a_publish_the_nodes_identity_may_not_read_is_refused() {
    if insecure_suite() {
        return; // no identities without TLS
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let src = root.join("src");
    for team in ["team-a", "team-b"] {
        std::fs::create_dir_all(src.join(team)).unwrap();
        random_file(&src.join(format!("{team}/s.bin")), 4096).unwrap();
    }
    let c = Cluster::start(root, 1, "64MiB", &src).unwrap();
    let confined = TestTls::get()
        .issue(
            "csi-team-a",
            &["--role", "user", "--subtree", "/data/team-a"],
        )
        .unwrap();
    let tls = confined.display().to_string();
    let fuse = Fuse::start_opts(root, "mnt-a", &c.master.addr, &["--tls-dir", &tls]).unwrap();
    let plugin = Plugin::start(root, "csi-a", &fuse.mountpoint);
    let pods: PathBuf = root.join("kubelet/pods");
    std::fs::create_dir_all(&pods).unwrap();
    let t = pods.join("b");
    let (got, message) = code(plugin.publish(volume(&t, &[("path", "/data/team-b")])));
    assert_eq!(got, Code::PermissionDenied, "{message}");
    assert!(message.contains("/data/team-b"), "{message}");
    assert!(mount_of(&t).is_none());
    let ta = pods.join("a");
    let _bind = UnmountOnDrop(ta.clone());
    plugin
        .publish(volume(
            &ta,
            &[("path", "/data/team-a"), ("readOnly", "true")],
        ))
        .unwrap();
    assert_eq!(sha_of(&ta.join("s.bin")), sha_of(&src.join("team-a/s.bin")));
    plugin.unpublish(&ta).unwrap();
    assert!(mount_of(&ta).is_none());

    // A second plugin on the socket of one that answers is refused; the first serves on.
    let endpoint = format!("unix://{}", root.join("csi-a/csi.sock").display());
    let m = fuse.mountpoint.display().to_string();
    let second = granary(&["csi", "--endpoint", &endpoint, "--mount", &m]);
    assert_eq!(second.status.code(), Some(1));
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(err.contains("another plugin listens on"), "{err}");
    let mut identity = plugin.identity.clone();
    assert!(plugin
        .rt
        .block_on(identity.probe(csi::ProbeRequest {}))
        .is_ok());
}
