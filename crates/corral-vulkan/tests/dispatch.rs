//! The Vulkan path end to end on whatever device the loader reports (Mesa's lavapipe in CI):
//! the device's capabilities read, shaders that do not exist refused, and an op recorded
//! once as a graph and replayed. Without a Vulkan loader, a device or the shaders (a build
//! without `glslc`), each test prints why it skipped and passes, unless
//! `CORRAL_REQUIRE_VULKAN=1` (as CI sets it, with lavapipe installed), which fails it
//! instead.

use corral_backend::{Backend, BufferUsage, DType};
use corral_vulkan::{Kernel, VulkanBackend, VulkanDevice, VulkanOptions, vulkan_available};

/// What to do without a device: skip, or fail where one is required.
fn skipped(why: corral_backend::BackendError) {
    if std::env::var("CORRAL_REQUIRE_VULKAN").is_ok_and(|v| v == "1") {
        panic!("Vulkan is required here: {why}")
    }
    eprintln!("skipped: {why}");
}

fn device() -> Option<VulkanDevice> {
    match vulkan_available().and_then(|names| {
        eprintln!("Vulkan devices: {names:?}");
        VulkanDevice::open(0)
    }) {
        Ok(d) => Some(d),
        Err(why) => {
            skipped(why);
            None
        }
    }
}

/// The device names itself and reports what the backend will choose kernels by.
#[test]
fn the_device_reports_what_it_can_do() {
    let Some(d) = device() else { return };
    let info = d.info();
    eprintln!("{info:?}");
    assert!(!info.name.is_empty());
    assert!(info.subgroup_size.is_power_of_two(), "{info:?}");
    assert!(info.shared_memory_bytes >= 16 * 1024, "{info:?}");
}

/// `add_in_place` recorded once as a graph and replayed three times adds `x` three times,
/// over a length that is no multiple of the workgroup, leaving the elements past it alone;
/// recording ran nothing, and each replay counts its dispatch.
#[test]
fn a_recorded_graph_replays() {
    let backend = match VulkanBackend::new(VulkanOptions::default()) {
        Ok(b) => b,
        Err(why) => return skipped(why),
    };
    let b: &dyn Backend = &backend;
    let n = 1000;
    let acc0: Vec<f32> = (0..n + 8).map(|i| i as f32).collect();
    let x: Vec<f32> = (0..n + 8).map(|i| 0.5 * i as f32 - 7.0).collect();
    let mut acc = b
        .take_buffer(DType::F32, n + 8, BufferUsage::Activations)
        .unwrap();
    let mut xb = b
        .take_buffer(DType::F32, n + 8, BufferUsage::Activations)
        .unwrap();
    b.upload_f32(&acc0, &mut acc).unwrap();
    b.upload_f32(&x, &mut xb).unwrap();
    b.begin_capture().unwrap();
    b.add_in_place(&mut acc, &xb, n).unwrap();
    let graph = b.end_capture().unwrap();
    assert_eq!(graph.kernels(), 1);
    let before = b.stats().dispatches;
    for _ in 0..3 {
        b.replay(&graph).unwrap();
    }
    let mut got = vec![0.0; n + 8];
    b.download_f32(&acc, &mut got).unwrap();
    assert_eq!(
        b.stats().dispatches - before,
        3,
        "each replay counts its dispatch"
    );
    for (i, (&g, (&a, &v))) in got.iter().zip(acc0.iter().zip(&x)).enumerate() {
        let want = if i < n { a + 3.0 * v } else { a };
        assert_eq!(g, want, "element {i}");
    }
}

/// Shaders that do not exist are refused.
#[test]
fn unknown_shaders_are_refused() {
    let Some(d) = device() else { return };
    assert!(Kernel::new(&d, "no_such_shader").is_err());
    assert!(Kernel::new(&d, "add_in_place").is_ok());
}
