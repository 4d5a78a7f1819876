//! The Dockerfile.

use crate::read;

#[test]
fn the_image_is_multi_stage_small_and_not_root() {
    let d = read("Dockerfile");
    let froms: Vec<&str> = d.lines().filter(|l| l.starts_with("FROM ")).collect();
    assert!(froms.len() >= 2, "a build stage and a runtime stage");
    assert!(froms.last().unwrap().contains("-slim"), "a slim runtime");
    for bin in [
        "delay-publisher",
        "delay-consumer",
        "delay-proxy",
        "delay-console",
    ] {
        assert!(
            d.contains(&format!("target/release/{bin}")),
            "{bin} in the image"
        );
    }
    assert!(d.contains("--locked"), "builds what Cargo.lock says");
    assert!(d.contains("EXPOSE 9464"));
    let user = d.lines().rev().find(|l| l.starts_with("USER ")).unwrap();
    assert!(!user.contains(" 0") && !user.contains("root"), "{user}");
}
