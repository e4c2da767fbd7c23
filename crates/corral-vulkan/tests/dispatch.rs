//! The Vulkan path end to end on whatever device the loader reports (Mesa's lavapipe in CI):
//! the device's capabilities read, a buffer written and read by address, a kernel recorded
//! once and replayed. Without a Vulkan loader, a device or the shaders (a build without
//! `glslc`), each test prints why it skipped and passes, unless `CORRAL_REQUIRE_VULKAN=1`
//! (as CI sets it, with lavapipe installed), which fails it instead.

use corral_vulkan::{Kernel, Recording, VulkanBuffer, VulkanDevice, vulkan_available};

fn device() -> Option<VulkanDevice> {
    match vulkan_available().and_then(|names| {
        eprintln!("Vulkan devices: {names:?}");
        VulkanDevice::open(0)
    }) {
        Ok(d) => Some(d),
        Err(why) if std::env::var("CORRAL_REQUIRE_VULKAN").is_ok_and(|v| v == "1") => {
            panic!("Vulkan is required here: {why}")
        }
        Err(why) => {
            eprintln!("skipped: {why}");
            None
        }
    }
}

fn floats(b: &VulkanBuffer) -> Vec<f32> {
    let mut bytes = vec![0; b.len_bytes()];
    b.read(0, &mut bytes);
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn write(b: &VulkanBuffer, values: &[f32]) {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    b.write(0, &bytes);
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

/// `add_in_place` recorded once and replayed three times adds `x` three times, over a length
/// that is no multiple of the workgroup, leaving the elements past it alone.
#[test]
fn a_recorded_dispatch_replays() {
    let Some(d) = device() else { return };
    let n = 1000;
    let acc0: Vec<f32> = (0..n + 8).map(|i| i as f32).collect();
    let x: Vec<f32> = (0..n + 8).map(|i| 0.5 * i as f32 - 7.0).collect();
    let acc = VulkanBuffer::new(&d, (n + 8) * 4).unwrap();
    let xb = VulkanBuffer::new(&d, (n + 8) * 4).unwrap();
    write(&acc, &acc0);
    write(&xb, &x);
    let kernel = Kernel::new(&d, "add_in_place").unwrap();
    let mut args = Vec::new();
    args.extend_from_slice(&acc.address().to_le_bytes());
    args.extend_from_slice(&xb.address().to_le_bytes());
    args.extend_from_slice(&(n as u32).to_le_bytes());
    let recording =
        Recording::new(&d, &[(&kernel, [(n as u32).div_ceil(256), 1, 1], &args)]).unwrap();
    for _ in 0..3 {
        recording.submit().unwrap();
    }
    let got = floats(&acc);
    for (i, (&g, (&a, &v))) in got.iter().zip(acc0.iter().zip(&x)).enumerate() {
        let want = if i < n { a + 3.0 * v } else { a };
        assert_eq!(g, want, "element {i}");
    }
}

/// Arguments past what push constants hold, and shaders that do not exist, are refused.
#[test]
fn bad_kernels_and_arguments_are_refused() {
    let Some(d) = device() else { return };
    assert!(Kernel::new(&d, "no_such_shader").is_err());
    let kernel = Kernel::new(&d, "add_in_place").unwrap();
    let args = [0u8; 129];
    assert!(Recording::new(&d, &[(&kernel, [1, 1, 1], &args)]).is_err());
}
