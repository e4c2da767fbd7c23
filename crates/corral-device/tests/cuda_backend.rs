//! The CUDA backend's own behaviour: its fp8 KV format, error flag and promises, dispatch and
//! allocation accounting, projections fed bf16 inputs, kernel cache, the block formats it
//! decodes, its few-row block-format products and per-token experts computing the CPU
//! backend's integer arithmetic (which no reference has; the op conformance suite holds both
//! to the exact products), graphs, and NCCL's collectives. Without a usable GPU every test prints why it skipped
//! and passes.

// The other op tests' helpers come too, not all used here.
#[allow(dead_code)]
mod common;
#[macro_use]
#[path = "common/gpu.rs"]
mod gpu;

use common::{Rng, block_experts, download, f32_buf, out_buf, u32_buf};
use gpu::*;

use corral_backend::{
    Backend, BackendError, BufferUsage, DType, DeltaNetShape, DeviceBuffer, MoeRouting,
    QuantFormat, RecurrentRuns, WeightView,
};
use corral_cpu::CpuBackend;
use corral_cuda::{CudaBackend, CudaOptions};

/// An fp8 store rounds every code's value, the midpoints between neighbours (ties to even)
/// and the subnormal range as the format defines: each head here holds 448 (its largest), so
/// its scale is exactly 1 and the stored bytes are the codes themselves.
#[test]
fn fp8_store_rounds_every_code_as_the_format_defines() {
    let g = gpu_or_skip!();
    let mut wanted: Vec<f32> = (0u8..=0x7e).map(e4m3_value).collect();
    let mids: Vec<f32> = wanted.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
    wanted.extend(mids);
    wanted.extend([447.9, 0.015625 - 1e-6, 0.015625 + 1e-6, 7.5 / 512.0, 1e-4]);
    let negatives: Vec<f32> = wanted.iter().map(|v| -v).collect();
    wanted.extend(negatives);
    let head_dim = 64;
    let mut values = Vec::new();
    for chunk in wanted.chunks(head_dim - 1) {
        values.push(448.0);
        values.extend_from_slice(chunk);
        values.resize(values.len().next_multiple_of(head_dim), 0.0);
    }
    let tokens = values.len() / head_dim;
    let row = corral_backend::kv_row_elems(DType::F8E4M3, 1, head_dim);
    let mut caches = [0, 1].map(|_| {
        g.alloc_zeroed(DType::F8E4M3, tokens * row, BufferUsage::KvCache)
            .unwrap()
    });
    let [ck, cv] = &mut caches;
    let slots: Vec<u32> = (0..tokens as u32).collect();
    let v: Vec<f32> = values.iter().map(|x| -x).collect();
    g.kv_store(
        &f32_buf(g, &values),
        &f32_buf(g, &v),
        &u32_buf(g, &slots),
        tokens,
        1,
        head_dim,
        ck,
        cv,
    )
    .unwrap();
    for (which, cache, input) in [("k", &caches[0], &values), ("v", &caches[1], &v)] {
        let mut bytes = vec![0u8; tokens * row];
        g.read_bytes(cache, 0, &mut bytes).unwrap();
        for t in 0..tokens {
            let r = &bytes[t * row..(t + 1) * row];
            let scale = f32::from_le_bytes([r[64], r[65], r[66], r[67]]);
            assert_eq!(scale, 1.0, "{which} token {t}: scale");
            for d in 0..head_dim {
                let x = input[t * head_dim + d];
                assert_eq!(r[d], e4m3_bits(x), "{which}: {x} stored as {:#04x}", r[d]);
            }
        }
    }
}

#[test]
fn an_index_out_of_range_raises_the_error_flag_and_the_next_step_is_clean() {
    let g = gpu_or_skip!();
    let table = g.weight_from_f32(&[1.0; 32], DType::BF16).unwrap();
    let view = WeightView::new(&table, 4, 8).unwrap();
    let ids = u32_buf(g, &[1, 9]);
    let mut out = out_buf(g, 16);
    g.embedding(view, &ids, 2, &mut out).unwrap();
    let mut host = vec![0.0; 16];
    let err = g.download_f32(&out, &mut host).unwrap_err();
    assert!(
        matches!(err, BackendError::DeviceIndex { what } if what.contains("token id")),
        "{err}"
    );
    let ok = u32_buf(g, &[1, 3]);
    g.embedding(view, &ok, 2, &mut out).unwrap();
    g.download_f32(&out, &mut host).unwrap();
    assert!(host.iter().all(|v| *v == 1.0));
}

/// A run longer than the batch's promised longest run (which sizes the convolution's and the
/// chunked delta rule's grids) fails the step instead of leaving tokens uncomputed.
#[test]
fn a_run_longer_than_promised_fails_the_step() {
    let g = gpu_or_skip!();
    let (channels, kernel, tokens) = (32, 4, 100);
    let runs = u32_buf(g, &[0, tokens as u32, 0, 1]);
    let weight = g
        .weight_from_f32(&vec![0.25; channels * kernel], DType::F32)
        .unwrap();
    let mut state = out_buf(g, channels * (kernel - 1));
    let mut out = out_buf(g, tokens * channels);
    for (promised, fails) in [(64, true), (tokens, false)] {
        let rr = RecurrentRuns {
            runs: &runs,
            num_runs: 1,
            max_run_tokens: promised,
            kept: None,
        };
        let x = f32_buf(g, &vec![1.0; tokens * channels]);
        g.causal_conv1d(&x, &weight, channels, kernel, rr, &mut state, &mut out)
            .unwrap();
        let mut host = vec![0.0; tokens * channels];
        expect_promise_error_or_outputs(promised, fails, g.download_f32(&out, &mut host), &host);
    }
    // The chunked delta rule alone: one value head of 16 over one key head of 16.
    let width = 2 * 16 + 16;
    let qkv = f32_buf(g, &vec![0.5; tokens * width]);
    let (gate, beta) = (
        f32_buf(g, &vec![-0.1; tokens]),
        f32_buf(g, &vec![0.5; tokens]),
    );
    let shape = DeltaNetShape {
        num_key_heads: 1,
        num_value_heads: 1,
        key_dim: 16,
        value_dim: 16,
    };
    let mut state = out_buf(g, 16 * 16);
    let mut out = out_buf(g, tokens * 16);
    for (promised, fails) in [(64, true), (tokens, false)] {
        let rr = RecurrentRuns {
            runs: &runs,
            num_runs: 1,
            max_run_tokens: promised,
            kept: None,
        };
        g.gated_delta_rule(&qkv, &gate, &beta, shape, rr, &mut state, &mut out)
            .unwrap();
        let mut host = vec![0.0; tokens * 16];
        expect_promise_error_or_outputs(promised, fails, g.download_f32(&out, &mut host), &host);
    }
}

/// A read-back after a step whose longest run was `promised`: the promise's error when it
/// `fails`, else positive outputs everywhere (every token computed).
fn expect_promise_error_or_outputs(
    promised: usize,
    fails: bool,
    read: Result<(), BackendError>,
    host: &[f32],
) {
    match read {
        Err(BackendError::DeviceIndex { what }) if fails => {
            assert!(what.contains("promised"), "{what}")
        }
        Ok(()) if !fails => assert!(host.iter().all(|v| v.is_finite() && *v > 0.0)),
        other => panic!("promised {promised}: {other:?}"),
    }
}

#[test]
fn launches_syncs_and_allocations_are_counted_exactly() {
    let g = gpu_or_skip!();
    let w = g.weight_from_f32(&vec![0.5; 64 * 32], DType::BF16).unwrap();
    let view = WeightView::new(&w, 64, 32).unwrap();
    let x = f32_buf(g, &[1.0; 32 * 20]);
    let mut out = out_buf(g, 20 * 64);
    let before = g.stats();
    for rows in [1, 20] {
        g.matmul(&x, rows, view, &mut out).unwrap();
    }
    let buffer = g
        .take_buffer(DType::F32, 10, BufferUsage::Activations)
        .unwrap();
    g.give_buffer(buffer);
    let again = g
        .take_buffer(DType::F32, 8, BufferUsage::Activations)
        .unwrap();
    let mut host = vec![0.0; 20 * 64];
    g.download_f32(&out, &mut host).unwrap();
    let spent = g.stats() - before;
    assert_eq!(spent.dispatches, 2, "two matmuls, one launch each");
    assert_eq!(spent.host_syncs, 1, "only the read-back waits");
    assert_eq!(spent.allocations, 1, "the second take is a pool hit");
    // Weight bytes are what the kernels report reading: the matrix once per launch.
    assert_eq!(spent.weight_bytes_read, 2 * 64 * 32 * 2);
    assert!(host.iter().all(|v| (*v - 16.0).abs() < 1e-3), "{}", host[0]);
    g.give_buffer(again);
}

/// Projections of one input through `matmuls` equal `matmul` each, bit for bit: on the cuBLAS
/// path (rows past the matrix-vector kernels) the input is rounded once for all of them (one
/// conversion and a GEMM each); below it, each is its own matrix-vector launch.
/// Random bf16 weights of `[n, k]` for each n of `ns`.
fn bf16_weights(g: &dyn Backend, rng: &mut Rng, k: usize, ns: &[usize]) -> Vec<DeviceBuffer> {
    ns.iter()
        .map(|&n| g.weight_from_f32(&rng.values(n * k), DType::BF16).unwrap())
        .collect()
}

/// Each weight as a whole `[n, k]` matrix.
fn views_of<'a>(weights: &'a [DeviceBuffer], ns: &[usize], k: usize) -> Vec<WeightView<'a>> {
    weights
        .iter()
        .zip(ns)
        .map(|(w, &n)| WeightView::new(w, n, k).unwrap())
        .collect()
}

#[test]
fn matmuls_equal_each_matmul_and_round_the_input_once() {
    let g = gpu_or_skip!();
    let mut rng = Rng(41);
    let (k, ns) = (96, [64, 40, 8]);
    let weights = bf16_weights(g, &mut rng, k, &ns);
    let views = views_of(&weights, &ns, k);
    for rows in [20, 100] {
        let x = f32_buf(g, &rng.values(rows * k));
        let mut each: Vec<DeviceBuffer> = ns.iter().map(|&n| out_buf(g, rows * n)).collect();
        for (v, out) in views.iter().zip(each.iter_mut()) {
            g.matmul(&x, rows, *v, out).unwrap();
        }
        let mut joint: Vec<DeviceBuffer> = ns.iter().map(|&n| out_buf(g, rows * n)).collect();
        let before = g.stats();
        let mut outs: Vec<&mut DeviceBuffer> = joint.iter_mut().collect();
        g.matmuls(&x, rows, &views, &mut outs).unwrap();
        let spent = g.stats() - before;
        let blas = rows > 32 && g.device_name().contains("cuBLAS");
        let expected = if blas { 1 + ns.len() } else { ns.len() };
        assert_eq!(spent.dispatches, expected as u64, "rows {rows}");
        for ((a, b), n) in each.iter().zip(&joint).zip(ns) {
            assert_eq!(
                download(g, a, rows * n),
                download(g, b, rows * n),
                "rows {rows}, n {n}"
            );
        }
    }
    let mut one = out_buf(g, 4);
    assert!(
        g.matmuls(&f32_buf(g, &[0.0; 96]), 1, &views, &mut [&mut one])
            .is_err()
    );
}

/// A norm writes bf16 for projections (`gemm_input_dtype`) exactly as it writes f32 rounded
/// once, and a projection of that bf16 input equals the projection of the f32 input bit for
/// bit (every path rounds its input to bf16 first): cuBLAS reading it directly, the few-row
/// products through a widened copy, one and several projections.
#[test]
fn bf16_norm_outputs_feed_projections_as_f32_inputs_do() {
    let g = gpu_or_skip!();
    let mut rng = Rng(43);
    let (k, ns) = (96, [64, 40, 8]);
    let weights = bf16_weights(g, &mut rng, k, &ns);
    let views = views_of(&weights, &ns, k);
    let norm = g.weight_from_f32(&rng.values(k), DType::F32).unwrap();
    assert_eq!(g.gemm_input_dtype(100, DType::F32), DType::F32);
    for rows in [20, 100] {
        let x = f32_buf(g, &rng.values(rows * k));
        let mut normed = out_buf(g, rows * k);
        g.rms_norm(&x, &norm, rows, k, 1e-6, false, &mut normed)
            .unwrap();
        let mut normed16 = g
            .take_buffer(DType::BF16, rows * k, BufferUsage::Activations)
            .unwrap();
        g.rms_norm(&x, &norm, rows, k, 1e-6, false, &mut normed16)
            .unwrap();
        let mut bytes = vec![0u8; rows * k * 2];
        g.read_bytes(&normed16, 0, &mut bytes).unwrap();
        let rounded: Vec<u16> = download(g, &normed, rows * k)
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        let written: Vec<u16> = bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        assert_eq!(written, rounded, "rows {rows}: the bf16 norm");
        for (v, n) in views.iter().zip(ns) {
            let (mut a, mut b) = (out_buf(g, rows * n), out_buf(g, rows * n));
            g.matmul(&normed, rows, *v, &mut a).unwrap();
            g.matmul(&normed16, rows, *v, &mut b).unwrap();
            assert_eq!(
                download(g, &a, rows * n),
                download(g, &b, rows * n),
                "rows {rows}, n {n}"
            );
        }
        let mut joint: Vec<DeviceBuffer> = ns.iter().map(|&n| out_buf(g, rows * n)).collect();
        let mut outs: Vec<&mut DeviceBuffer> = joint.iter_mut().collect();
        g.matmuls(&normed16, rows, &views, &mut outs).unwrap();
        for (out, (v, n)) in joint.iter().zip(views.iter().zip(ns)) {
            let mut each = out_buf(g, rows * n);
            g.matmul(&normed, rows, *v, &mut each).unwrap();
            assert_eq!(
                download(g, out, rows * n),
                download(g, &each, rows * n),
                "rows {rows} joint"
            );
        }
    }
}

#[test]
fn a_second_start_compiles_nothing() {
    if gpu().is_none() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let options = CudaOptions {
        kernel_cache: Some(dir.path().to_path_buf()),
        ..Default::default()
    };
    let first = CudaBackend::new(options.clone()).unwrap();
    assert!(first.kernel_cache_report().compiled > 0);
    assert_eq!(first.kernel_cache_report().cached, 0);
    drop(first);
    let second = CudaBackend::new(options).unwrap();
    assert_eq!(second.kernel_cache_report().compiled, 0);
    assert!(second.kernel_cache_report().cached > 0);
}

#[test]
fn an_activation_beyond_f16_range_fails_the_step_with_f16_weights() {
    let g = gpu_or_skip!();
    let (rows, n, k) = (40, 16, 32);
    let w = g.weight_from_f32(&vec![0.01; n * k], DType::F16).unwrap();
    let view = WeightView::new(&w, n, k).unwrap();
    let mut x = vec![1.0f32; rows * k];
    x[5] = 1e5;
    let xb = f32_buf(g, &x);
    let mut out = out_buf(g, rows * n);
    g.matmul(&xb, rows, view, &mut out).unwrap();
    let mut host = vec![0.0; rows * n];
    let err = g.download_f32(&out, &mut host).unwrap_err();
    assert!(err.to_string().contains("f16"), "{err}");
    // In range, the same product runs.
    x[5] = 1.0;
    let xb = f32_buf(g, &x);
    g.matmul(&xb, rows, view, &mut out).unwrap();
    g.download_f32(&out, &mut host).unwrap();
}

#[test]
fn block_formats_decode_on_the_gpu_as_on_the_cpu_bit_for_bit() {
    let g = gpu_or_skip!(cuda);
    let b: &dyn Backend = g;
    let formats = b.capabilities().weight_formats.clone();
    for (n, format) in formats.into_iter().enumerate() {
        let (rows, cols) = (7, 512);
        let (blocks, values) = blocks_and_values(format, 40 + n as u64, rows * cols);
        let w = b
            .weight_from_blocks(blocks, DType::Quant(format), rows * cols)
            .unwrap();
        // The first value of `w` that the device decodes to other bits than the CPU.
        let first_differing = |w: &DeviceBuffer| {
            let mut out = out_buf(g, rows * cols);
            g.dequantize_on_device(WeightView::new(w, rows, cols).unwrap(), &mut out)
                .unwrap();
            let got = download(g, &out, rows * cols);
            got.iter()
                .zip(&values)
                .position(|(a, b)| a.to_bits() != b.to_bits())
        };
        assert_eq!(
            first_differing(&w),
            None,
            "{}: first value that differs",
            format.name()
        );
        // The device's synthetic blocks are the host's: they decode to the same bits.
        let made = b
            .weight_synthetic_blocks(format, rows * cols, 40 + n as u64, 0.5)
            .unwrap();
        assert_eq!(
            first_differing(&made),
            None,
            "{}: synthetic blocks made on the device",
            format.name()
        );
    }
}

/// Products of 1 to 8 rows of weights in each block format that both backends read as stored
/// (not FP8, which the CPU decodes at load): the GPU's few-row products quantize activations
/// per 32 values as the CPU does and take the same integer dots, the scales combined in
/// another order, so they are the CPU's products (a row at a time: from 8 rows the CPU may
/// decode Q8_0 to f32 instead) within 1e-5.
#[test]
fn few_row_block_format_products_are_the_cpus_integer_products() {
    let g = gpu_or_skip!();
    let c: &dyn Backend = &CpuBackend::new();
    let mut rng = Rng(41);
    let formats = g.capabilities().weight_formats.clone();
    for (n, format) in formats.into_iter().enumerate() {
        if !c.capabilities().reads(format) {
            continue;
        }
        let block = format.block().0;
        for rows in [1, 2, 3, 5, 8] {
            let (out_rows, cols) = (1 + rng.below(70), block * (1 + rng.below(3)));
            let (blocks, _) = blocks_and_values(format, 50 + n as u64, out_rows * cols);
            let x = rng.values(rows * cols);
            let weights = |b: &dyn Backend| {
                b.weight_from_blocks(blocks.clone(), DType::Quant(format), out_rows * cols)
                    .unwrap()
            };
            let wc = weights(c);
            let view = WeightView::new(&wc, out_rows, cols).unwrap();
            let cpu: Vec<f32> = x
                .chunks(cols)
                .flat_map(|row| {
                    let mut out = out_buf(c, out_rows);
                    c.matmul(&f32_buf(c, row), 1, view, &mut out).unwrap();
                    download(c, &out, out_rows)
                })
                .collect();
            let wg = weights(g);
            let mut got = out_buf(g, rows * out_rows);
            let view = WeightView::new(&wg, out_rows, cols).unwrap();
            g.matmul(&f32_buf(g, &x), rows, view, &mut got).unwrap();
            let what = format!(
                "{} matmul, {rows} rows of {cols} into {out_rows}",
                format.name()
            );
            assert_close(&what, &download(g, &got, rows * out_rows), &cpu, 1e-5);
        }
    }
}

/// Experts in block formats, gate/up and down each in its own (as Q4_K_M files store them),
/// a token at a time: the GPU quantizes x and the activations as the CPU does, so its
/// outputs are the CPU's integer products within 1e-4. Activations quantized per
/// super-block (Q4_K, Q6_K) within 3e-4: the two backends compute the activation rows in
/// different float orders, a value on a rounding edge lands on the neighbouring int8 step,
/// and a super-block's step is up to eight times a block's (measured 1.15e-4 for Q5_K
/// gate/up with a Q4_K down at 40 tokens; a GPU that quantized per 32 against these CPU
/// products was off by 1.7e-2).
#[test]
fn per_token_block_format_experts_are_the_cpus_integer_products() {
    let g = gpu_or_skip!();
    let c: &dyn Backend = &CpuBackend::new();
    let mut rng = Rng(43);
    let cases = [
        (QuantFormat::Q4K, QuantFormat::Q6K, 1, 8, 2, 256, 512),
        (QuantFormat::Q8_0, QuantFormat::Q8_0, 3, 16, 4, 64, 96),
        (QuantFormat::Q5K, QuantFormat::Q4K, 40, 8, 8, 256, 256),
        (QuantFormat::Q4_0, QuantFormat::Q5_0, 200, 32, 8, 96, 32),
    ];
    for (case, (up_format, down_format, tokens, e, top_k, h, i)) in cases.into_iter().enumerate() {
        let gate_up_len = e * 2 * i * h;
        let (gu_blocks, _) = blocks_and_values(up_format, 70 + case as u64, gate_up_len);
        let (d_blocks, _) = blocks_and_values(down_format, 80 + case as u64, e * h * i);
        let x = rng.values(tokens * h);
        let logits = rng.values(tokens * e);
        let pairs = tokens * top_k;
        let per_token = |b: &dyn Backend| {
            let w = block_experts(
                b,
                (up_format, &gu_blocks),
                (down_format, &d_blocks),
                (e, h, i),
            );
            let mut ids = b
                .take_buffer(DType::U32, pairs, BufferUsage::Metadata)
                .unwrap();
            let mut weights = out_buf(b, pairs);
            let lb = f32_buf(b, &logits);
            b.moe_route(&lb, tokens, e, top_k, true, false, &mut ids, &mut weights)
                .unwrap();
            let routing = MoeRouting {
                expert_ids: &ids,
                expert_weights: &weights,
                tokens,
                top_k,
            };
            let (mut act, mut out) = (out_buf(b, pairs * i), out_buf(b, tokens * h));
            b.moe_experts_per_token(&f32_buf(b, &x), routing, &w, &mut act, &mut out)
                .unwrap();
            download(b, &out, tokens * h)
        };
        let what = format!(
            "{} gate/up, {} down: {tokens} tokens, top {top_k} of {e}, h {h} i {i}",
            up_format.name(),
            down_format.name()
        );
        let supers = [up_format, down_format]
            .iter()
            .any(|&f| matches!(f, QuantFormat::Q4K | QuantFormat::Q6K));
        let tol = if supers { 3e-4 } else { 1e-4 };
        assert_close(&what, &per_token(g), &per_token(c), tol);
    }
}

/// A graph recorded on a backend whose pool is empty (a step shape first recorded after other
/// shapes took the pool's buffers) allocates the scratch its ops take while recording, and
/// replays as the same ops run eagerly: a Q4_K and a Q6_K part quantize x each way at once.
#[test]
fn a_graph_recorded_with_an_empty_pool_replays_as_eager_ops_run() {
    if gpu().is_none() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let cuda = CudaBackend::new(CudaOptions::default()).expect("open cuda:0");
    let g: &dyn Backend = &cuda;
    let (cols, rows) = (512, 3);
    let parts: Vec<(DeviceBuffer, usize)> = [(QuantFormat::Q4K, 48), (QuantFormat::Q6K, 16)]
        .into_iter()
        .enumerate()
        .map(|(i, (format, n))| {
            let w = g
                .weight_synthetic_blocks(format, n * cols, 7 + i as u64, 0.05)
                .unwrap();
            (w, n)
        })
        .collect();
    let x = f32_buf(g, &Rng(5).values(rows * cols));
    let mut graphed = out_buf(g, rows * 64);
    assert_eq!(g.pool_bytes().0, 0, "a fresh backend's pool is empty");
    g.begin_capture().unwrap();
    let recorded = g.matmul_parts(&x, rows, (&parts, cols), &mut graphed, 64);
    let graph = g.end_capture();
    recorded.unwrap();
    let graph = graph.unwrap();
    g.replay(&graph).unwrap();
    let first = download(g, &graphed, rows * 64);
    // Whatever runs between replays may take the graph's scratch and give it back.
    let mut eager = out_buf(g, rows * 64);
    g.matmul_parts(&x, rows, (&parts, cols), &mut eager, 64)
        .unwrap();
    g.replay(&graph).unwrap();
    assert_eq!(
        download(g, &graphed, rows * 64),
        first,
        "a second replay differs"
    );
    assert_eq!(
        download(g, &eager, rows * 64),
        first,
        "eager ops differ from the graph"
    );
    assert!(first.iter().all(|v| v.is_finite() && *v != 0.0));
}

/// NCCL's collectives through Corral's binding, on a group of this one GPU (a sum over one
/// rank is its own values): the calls reach NCCL with the right arguments on the backend's
/// stream. Skipped without a GPU or without NCCL installed.
#[test]
fn nccl_collectives_of_a_group_of_one_gpu_pass_values_through() {
    let _ = gpu_or_skip!(cuda);
    let nccl = match corral_cuda::Nccl::open() {
        Ok(nccl) => nccl,
        Err(e) => {
            eprintln!("skipped: {e}");
            return;
        }
    };
    let backend = std::sync::Arc::new(CudaBackend::new(CudaOptions::default()).expect("cuda:0"));
    let group = corral_cuda::nccl_group(&nccl, std::slice::from_ref(&backend)).expect("group");
    let (c, b): (&dyn corral_backend::Collective, &dyn Backend) = (&group[0], backend.as_ref());
    let values = Rng(5).values(1000);
    let mut buf = f32_buf(b, &values);
    c.all_reduce_sum(&mut buf, 1000).expect("all_reduce_sum");
    assert_eq!(download(b, &buf, 1000), values, "all_reduce_sum");
    let mut all = out_buf(b, 1000);
    c.all_gather(&buf, 1000, &mut all).expect("all_gather");
    assert_eq!(download(b, &all, 1000), values, "all_gather");
    c.broadcast(&mut buf, 1000, 0).expect("broadcast");
    assert_eq!(download(b, &buf, 1000), values, "broadcast");
    eprintln!(
        "NCCL {} on one GPU: the collectives pass values through",
        nccl.version()
    );
}
