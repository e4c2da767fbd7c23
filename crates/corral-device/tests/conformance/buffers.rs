//! The buffers: copies to and from the host, bytes as stored, weights made on the device, and
//! the arguments every backend refuses alike.

use std::io::Write as _;

use corral_backend::{BufferUsage, DType, MappedFile, QuantFormat, WeightView, synthetic};

use crate::{Rng, assert_near, download, f32_buf, out_buf, subjects_and_staged_copies, u32_buf};

/// Bytes written and read back as stored, in place and from element offsets, 16-bit
/// elements copied within a buffer on the device: the same bytes on every backend, as a
/// plain copy on the host gives them.
#[test]
fn bytes_round_trip_as_stored() {
    let v = Rng(8).values(600);
    let halves: Vec<u8> = (0..1200).map(|i| (i * 7 % 251) as u8).collect();
    // 16-bit elements 10..210 copied to 300..500 (a KV block's copy-on-write).
    let mut want_halves = halves.clone();
    want_halves.copy_within(20..420, 600);
    let floats: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut want_floats = floats.clone();
    want_floats.copy_within(200..1000, 1200);
    for s in subjects_and_staged_copies() {
        let b = s.backend;
        let mut f32s = f32_buf(b, &v);
        let mut bf16 = b
            .take_buffer(DType::BF16, 600, BufferUsage::KvCache)
            .unwrap();
        b.write_bytes(&halves, &mut bf16, 0).unwrap();
        b.copy_within(&mut bf16, 10, 300, 200).unwrap();
        let mut back = vec![0u8; 1200];
        b.read_bytes(&bf16, 0, &mut back).unwrap();
        assert!(back == want_halves, "{}: 16-bit bytes", s.name);
        let mut part = vec![0u8; 800];
        b.read_bytes(&f32s, 50, &mut part).unwrap();
        b.write_bytes(&part, &mut f32s, 300).unwrap();
        let mut all = vec![0u8; 2400];
        b.read_bytes(&f32s, 0, &mut all).unwrap();
        assert!(all == want_floats, "{}: f32 bytes", s.name);
    }
}

/// Weights of deterministic normal values made where the backend's memory is are the
/// host's streams ([`synthetic::normal_values`]) as each float type stores them.
#[test]
fn normal_weights_are_the_host_streams() {
    let n = 3 * 65536 + 7;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let want = crate::stored(dtype, &synthetic::normal_values(0xfeed, n, 0.02));
        for s in subjects_and_staged_copies() {
            let b = s.backend;
            let w = b.weight_normal(n, dtype, 0xfeed, 0.02).unwrap();
            // Read through an embedding of rows covering the whole buffer.
            let rows = n / 7;
            let ids: Vec<u32> = (0..rows as u32).collect();
            let mut out = out_buf(b, rows * 7);
            let view = WeightView::new(&w, rows, 7).unwrap();
            b.embedding(view, &u32_buf(b, &ids), rows, &mut out)
                .unwrap();
            let got = download(b, &out, rows * 7);
            assert_near(
                &s,
                &format!("{dtype} normal weights"),
                &got,
                &want[..rows * 7],
            );
        }
    }
}

/// Copies past a buffer or of the wrong type, byte ranges past the end or of part of an
/// element, weights of a type that is no weight, blocks of the wrong size, and file ranges
/// past the end are refused alike, each naming its call.
#[test]
fn buffers_refuse_bad_arguments() {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(&[0u8; 64]).unwrap();
    file.flush().unwrap();
    for s in subjects_and_staged_copies() {
        let b = s.backend;
        let named = |call: &str, r: corral_backend::Result<()>| match r {
            Err(e) => assert!(e.to_string().contains(call), "{}: {call}: {e}", s.name),
            Ok(()) => panic!("{}: {call} accepted", s.name),
        };
        let mut f = out_buf(b, 4);
        let mut u = u32_buf(b, &[0; 4]);
        named("upload_f32", b.upload_f32(&[0.0; 5], &mut f));
        named("upload_f32", b.upload_f32(&[0.0; 4], &mut u));
        named("upload_u32", b.upload_u32(&[0; 4], &mut f));
        named("download_f32", b.download_f32(&u, &mut [0.0; 4]));
        named("download_u32", b.download_u32(&u, &mut [0; 5]));
        named("read_bytes", b.read_bytes(&f, 2, &mut [0u8; 12]));
        named("write_bytes", b.write_bytes(&[0u8; 3], &mut f, 0));
        let made = |call: &str, r: corral_backend::Result<corral_backend::DeviceBuffer>| {
            named(call, r.map(|_| ()))
        };
        made("weight_from_f32", b.weight_from_f32(&[0.0; 4], DType::U32));
        made("weight_normal", b.weight_normal(4, DType::F8E4M3, 1, 0.1));
        let q8 = DType::Quant(QuantFormat::Q8_0);
        made(
            "weight_from_blocks",
            b.weight_from_blocks(vec![0; 33], q8, 32),
        );
        made(
            "weight_from_blocks",
            b.weight_from_blocks(vec![0; 34], q8, 31),
        );
        made(
            "weight_from_blocks",
            b.weight_from_blocks(vec![0; 4], DType::F32, 1),
        );
        made(
            "weight_synthetic_blocks",
            b.weight_synthetic_blocks(QuantFormat::Q8_0, 33, 1, 0.1),
        );
        let mapped = MappedFile::open(file.path()).unwrap();
        made(
            "weight_from_file",
            b.weight_from_file(&mapped, 8, DType::F32, 15),
        );
        made(
            "weight_from_file",
            b.weight_from_file(&mapped, usize::MAX, DType::F32, 1),
        );
        made(
            "weight_from_file",
            b.weight_from_file(&mapped, 0, DType::U32, 4),
        );
        made("weight_from_file", b.weight_from_file(&mapped, 0, q8, 31));
        assert!(
            b.weight_from_file(&mapped, 8, DType::F32, 14).is_ok(),
            "{}",
            s.name
        );
    }
}

/// A Vulkan device's free memory is its heap less the buffers the backend holds: a buffer
/// made takes its bytes from it, and dropped gives them back once the device's work is done.
#[test]
fn vulkan_free_memory_counts_the_buffers_held() {
    for s in subjects_and_staged_copies() {
        if !s.name.starts_with("vulkan") {
            continue;
        }
        let b = s.backend;
        let free = || {
            b.device_memory()
                .unwrap()
                .expect("Vulkan reports memory")
                .free
        };
        let before = free();
        let bytes = 64 << 20;
        let buffer = b
            .alloc_zeroed(DType::F32, bytes / 4, BufferUsage::KvCache)
            .unwrap();
        assert!(
            free() + bytes as u64 <= before,
            "{}: a buffer's bytes",
            s.name
        );
        drop(buffer);
        b.synchronize().unwrap();
        assert_eq!(free(), before, "{}: given back", s.name);
    }
}

/// Weights from a mapped file, at an offset no page or block aligns: every backend gives the
/// file's bytes back and computes with them. The CPU, and the Vulkan backend on an
/// integrated GPU that imports host memory (lavapipe too), read the file where it is mapped,
/// so those weights refuse writes; copied into a device's memory, they take them.
#[test]
fn weights_from_a_mapped_file_are_the_files_bytes() {
    let values = Rng(21).values(3 * 40);
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(&[7u8; 4100]).unwrap();
    file.write_all(&bytes).unwrap();
    file.flush().unwrap();
    let mapped = MappedFile::open(file.path()).unwrap();
    let x = Rng(22).values(2 * 40);
    let want = corral_backend::reference::matmul(&x, 2, 40, &values, 3);
    for s in subjects_and_staged_copies() {
        let b = s.backend;
        let mut w = b.weight_from_file(&mapped, 4100, DType::F32, 120).unwrap();
        let mut back = vec![0u8; 480];
        b.read_bytes(&w, 0, &mut back).unwrap();
        assert!(back == bytes, "{}: the file's bytes", s.name);
        let mut out = out_buf(b, 6);
        b.matmul(
            &f32_buf(b, &x),
            2,
            WeightView::new(&w, 3, 40).unwrap(),
            &mut out,
        )
        .unwrap();
        assert_near(&s, "a product of them", &download(b, &out, 6), &want);
        // The CPU reads the mapping itself; so does Vulkan on an integrated GPU.
        let unified = b.device_memory().unwrap().is_some_and(|m| m.unified);
        let in_place = s.name == "cpu" || (s.name == "vulkan" && unified);
        let written = b.write_bytes(&[0u8; 4], &mut w, 0);
        assert_eq!(
            written.is_err(),
            in_place,
            "{}: a write to them: {written:?}",
            s.name
        );
    }
}
