//! The Helm chart, rendered and checked with real Helm code (helm-python-sdk, Helm v4) and
//! validated against the Kubernetes 1.30 schemas (kubernetes-validate), offline: see
//! `charts/granary/tests/test_chart.py` for what is asserted. The Python packages are
//! installed by `scripts/setup-emulators` into the tools folder's `helm-venv`.

use std::process::Command;

use granary_tests::granary_bin;
use granary_tests::stores::tools_dir;

#[test]
fn the_helm_chart_renders_validates_and_uses_only_real_flags() {
    let python = tools_dir().join("helm-venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/setup-emulators",
        python.display()
    );
    // At run time: a test binary built in another checkout must not run that one's script.
    let crate_dir =
        std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
    let script = std::path::Path::new(&crate_dir).join("../charts/granary/tests/test_chart.py");
    let out = Command::new(&python)
        .arg(&script)
        .arg(granary_bin())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "chart checks failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("0 failures"), "{stdout}");
}
