//! Projections.

use corral_backend::{
    Backend, DType, DeviceBuffer, QuantFormat, WeightView, quant, reference, synthetic,
};
use proptest::prelude::*;

use crate::{
    Rng, Subject, assert_refused, assert_within, download, f32_buf, out_buf, stored, subjects,
    u32_buf,
};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// `x · wᵀ` for float weights of each stored type, through a view that skips rows in
    /// front, within [`Format::tol`] of the reference.
    #[test]
    fn matmul_matches_the_reference(
        m in 1usize..160,
        n in 1usize..90,
        k in 1usize..70,
        dtype in prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::F16)],
        row_offset in 0usize..3,
        seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed);
        let x = rng.values(m * k);
        let w_all = rng.values((n + row_offset) * k);
        let want = reference::matmul(&x, m, k, &stored(dtype, &w_all[row_offset * k..]), n);
        for s in subjects() {
            let b = s.backend;
            let w = b.weight_from_f32(&w_all, dtype).unwrap();
            let view = WeightView::new(&w, n + row_offset, k).unwrap().rows(row_offset, n).unwrap();
            let mut out = out_buf(b, m * n);
            b.matmul(&f32_buf(b, &x), m, view, &mut out).unwrap();
            let tol = Format::Float(dtype).tol(&s, m, k);
            assert_within(&s, &format!("matmul, {dtype} weights"), &download(b, &out, m * n), &want, tol);
        }
    }
}

/// A weight format of the suite: a float type, or a block format.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Format {
    Float(DType),
    Blocks(QuantFormat),
}

impl Format {
    /// The weights of `rows * cols` values on `b` (random, from `seed`) and the values they
    /// hold; `None` where `b` does not read the format.
    pub(crate) fn weights(
        self,
        b: &dyn Backend,
        len: usize,
        seed: u64,
    ) -> Option<(DeviceBuffer, Vec<f32>)> {
        match self {
            Format::Float(dtype) => {
                let v = Rng(seed).values(len);
                let w = b.weight_from_f32(&v, dtype).unwrap();
                Some((w, stored(dtype, &v)))
            }
            Format::Blocks(f) if b.capabilities().reads(f) => {
                let blocks = synthetic::quant_blocks(f, seed, len, 0.5);
                let mut values = vec![0.0; len];
                quant::dequantize(f, &blocks, &mut values);
                let w = b.weight_from_blocks(blocks, DType::Quant(f), len).unwrap();
                Some((w, values))
            }
            Format::Blocks(_) => None,
        }
    }

    /// How near the exact product of `rows` rows of `cols` a backend's must be: block formats'
    /// products quantize activations (per 32 values on the CPU and in a GPU's few-row
    /// products) or round them to bf16 (a GPU's tiles). A device that rounds projection inputs
    /// (`Capabilities::bf16_projection_inputs`) keeps f32 for one row, and up to 32 rows of f32
    /// weights or of rows no multiple of 8; tensor cores round the rest, f32 weights too.
    /// Vulkan's tiles on cooperative matrices (more than 8 rows) round both to f16.
    fn tol(self, s: &Subject, rows: usize, cols: usize) -> f64 {
        let rounds = s.backend.capabilities().bf16_projection_inputs;
        match self {
            Format::Blocks(QuantFormat::F8E4M3x128) if rows <= 8 => 3e-3,
            Format::Blocks(_) if rows <= 8 => 5e-2,
            Format::Blocks(_) => 1.5e-2,
            Format::Float(_) if s.f16_tiles && rows > 8 => 1e-2,
            Format::Float(_) if !rounds => s.tol,
            Format::Float(dtype) => {
                let f32_path =
                    rows == 1 || (rows <= 32 && (dtype == DType::F32 || !cols.is_multiple_of(8)));
                if f32_path { s.tol } else { 1e-2 }
            }
        }
    }
}

pub(crate) fn formats() -> impl Strategy<Value = Format> {
    let floats = prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::F16)];
    prop_oneof![
        floats.prop_map(Format::Float),
        prop::sample::select(QuantFormat::ALL.to_vec()).prop_map(Format::Blocks),
    ]
}

/// The reference of a projection stored in parts (each `[rows_i, cols]`), side by side
/// into rows of `wide` from column 0; the rest NaN.
fn parts_reference(
    x: &[f32],
    m: usize,
    cols: usize,
    parts: &[(usize, Vec<f32>)],
    wide: usize,
) -> Vec<f32> {
    let mut out = vec![f32::NAN; m * wide];
    let mut col0 = 0;
    for (n, values) in parts {
        let part = reference::matmul(x, m, cols, values, *n);
        for r in 0..m {
            out[r * wide + col0..r * wide + col0 + n].copy_from_slice(&part[r * n..(r + 1) * n]);
        }
        col0 += n;
    }
    out
}

/// Each value within `tol` of the reference's norm where the reference has one, and NaN (left
/// as it was) where it has none.
fn assert_placed(s: &Subject, what: &str, got: &[f32], want: &[f32], tol: f64) {
    let written = |v: &[f32]| {
        v.iter()
            .copied()
            .filter(|x| !x.is_nan())
            .collect::<Vec<_>>()
    };
    let outside = got.iter().zip(want).any(|(g, w)| w.is_nan() != g.is_nan());
    assert!(
        !outside,
        "{}: {what}: a column outside the parts written, or one inside not",
        s.name
    );
    assert_within(s, what, &written(got), &written(want), tol);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// A projection stored in parts of any formats (a GGUF file's q, k and v): through
    /// `matmul_parts` (which may quantize x once for them all) bit for bit what
    /// `matmul_columns` gives part by part, each part in exactly its columns, near the
    /// reference; and `matmuls` of the parts what `matmul` gives each.
    #[test]
    fn projections_in_parts_match_the_reference(
        m in 1usize..20,
        spans in 1usize..4,
        parts in prop::collection::vec((formats(), 1usize..40), 1..4),
        seed in any::<u64>(),
    ) {
        let cols = 256 * spans;
        let mut rng = Rng(seed);
        let x = rng.values(m * cols);
        let total: usize = parts.iter().map(|(_, n)| n).sum();
        let wide = total + 3;
        for s in subjects() {
            let b = s.backend;
            let made: Option<Vec<_>> = parts
                .iter()
                .enumerate()
                .map(|(i, (f, n))| f.weights(b, n * cols, seed ^ i as u64).map(|w| (w, *n)))
                .collect();
            let Some(made) = made else { continue };
            let values: Vec<(usize, Vec<f32>)> = made.iter().map(|((_, v), n)| (*n, v.clone())).collect();
            let want = parts_reference(&x, m, cols, &values, wide);
            let tol = parts.iter().map(|(f, _)| f.tol(&s, m, cols)).fold(0.0, f64::max);
            let buffers: Vec<(DeviceBuffer, usize)> = made.into_iter().map(|((w, _), n)| (w, n)).collect();
            let xb = f32_buf(b, &x);
            let mut together = f32_buf(b, &vec![f32::NAN; m * wide]);
            b.matmul_parts(&xb, m, (&buffers, cols), &mut together, wide).unwrap();
            let together = download(b, &together, m * wide);
            assert_placed(&s, &format!("{parts:?}: parts"), &together, &want, tol);
            let mut apart = f32_buf(b, &vec![f32::NAN; m * wide]);
            let mut col0 = 0;
            for (w, n) in &buffers {
                let view = WeightView::new(w, *n, cols).unwrap();
                b.matmul_columns(&xb, m, view, &mut apart, wide, col0).unwrap();
                col0 += n;
            }
            let apart = download(b, &apart, m * wide);
            let same = together.iter().zip(&apart).all(|(a, c)| a.to_bits() == c.to_bits() || (a.is_nan() && c.is_nan()));
            prop_assert!(same, "{}: {:?}: parts together differ from apart", s.name, parts);
            let views: Vec<WeightView<'_>> = buffers.iter().map(|(w, n)| WeightView::new(w, *n, cols).unwrap()).collect();
            let mut joint: Vec<DeviceBuffer> = views.iter().map(|v| out_buf(b, m * v.rows)).collect();
            let mut outs: Vec<&mut DeviceBuffer> = joint.iter_mut().collect();
            b.matmuls(&xb, m, &views, &mut outs).unwrap();
            for (v, joint) in views.iter().zip(&joint) {
                let mut each = out_buf(b, m * v.rows);
                b.matmul(&xb, m, *v, &mut each).unwrap();
                prop_assert_eq!(download(b, joint, m * v.rows), download(b, &each, m * v.rows), "{}: matmuls", s.name);
            }
        }
    }
}

/// The shapes at which a GPU's projection kernels change: each row count around its
/// few-row products and tiles, rows of 4,096 values and more, K split over blocks where the
/// output features are few, and weights streamed through shared memory. Each launch twice,
/// bit for bit the same (a split's last block adds the parts in a fixed order and leaves its
/// ticket at zero for the next launch); a backend's strategies within 1e-5 of each other
/// where they read the same 16-bit operands (everything but cuBLAS).
#[test]
fn matmul_matches_the_reference_where_kernels_change() {
    let mut rng = Rng(1);
    let mut shapes = Vec::new();
    for (n, rows) in [1, 2, 5, 8, 9, 16, 17, 32, 33, 64, 65, 130]
        .into_iter()
        .enumerate()
    {
        let k = if n % 3 == 0 {
            1 + rng.below(100)
        } else {
            8 * (1 + rng.below(40))
        };
        shapes.push((
            rows,
            1 + rng.below(150),
            k,
            [DType::BF16, DType::F16, DType::F32][n % 3],
            false,
        ));
    }
    for (n, rows) in [1, 2, 5, 8, 1, 9].into_iter().enumerate() {
        shapes.push((
            rows,
            1 + rng.below(150),
            4096 + 8 * rng.below(100),
            [DType::BF16, DType::F16][n % 2],
            false,
        ));
    }
    for (n, rows) in [17, 32, 3, 24, 16, 12].into_iter().enumerate() {
        shapes.push((
            rows,
            1 + rng.below(150),
            1024 + 8 * rng.below(400),
            [DType::BF16, DType::F16][n % 2],
            false,
        ));
    }
    for (n, (rows, out, k)) in [
        (2, 4300, 2048),
        (8, 4231, 768),
        (5, 5000, 8),
        (7, 8200, 2040),
        (3, 4229, 1032),
    ]
    .into_iter()
    .enumerate()
    {
        shapes.push((rows, out, k, [DType::BF16, DType::F16][n % 2], true));
    }
    for (case, (rows, n, k, dtype, streamed)) in shapes.into_iter().enumerate() {
        let x = rng.values(rows * k);
        let w = rng.values((n + 1) * k);
        let want = reference::matmul(&x, rows, k, &stored(dtype, &w[k..]), n);
        let what = format!("case {case}: rows {rows} n {n} k {k} {dtype}");
        let mut results = Vec::new();
        for s in subjects() {
            let b = s.backend;
            let wb = b.weight_from_f32(&w, dtype).unwrap();
            let view = WeightView::new(&wb, n + 1, k).unwrap().rows(1, n).unwrap();
            let xb = f32_buf(b, &x);
            let mut first = out_buf(b, rows * n);
            b.matmul(&xb, rows, view, &mut first).unwrap();
            let first = download(b, &first, rows * n);
            let mut again = out_buf(b, rows * n);
            b.matmul(&xb, rows, view, &mut again).unwrap();
            assert_eq!(
                download(b, &again, rows * n),
                first,
                "{}: {what}: a second launch differs",
                s.name
            );
            assert_within(
                &s,
                &what,
                &first,
                &want,
                Format::Float(dtype).tol(&s, rows, k),
            );
            results.push((s, first));
        }
        if streamed {
            crate::strategies_agree(&what, &results);
        }
    }
}

/// Weights outside their buffer or across blocks, inputs of the wrong type, short outputs,
/// columns past the row and projections without outputs are refused alike.
#[test]
fn projections_refuse_bad_arguments() {
    for s in subjects() {
        let b = s.backend;
        let w = b.weight_from_f32(&[0.5; 64], DType::BF16).unwrap();
        let x = f32_buf(b, &[1.0; 16]);
        let mut out = out_buf(b, 16);
        let beyond = WeightView {
            buffer: &w,
            offset: 8,
            rows: 8,
            cols: 8,
        };
        assert_refused(&s, "matmul", b.matmul(&x, 2, beyond, &mut out));
        let view = WeightView::new(&w, 8, 8).unwrap();
        let ids = u32_buf(b, &[0; 16]);
        assert_refused(&s, "matmul", b.matmul(&ids, 2, view, &mut out));
        let mut short = out_buf(b, 15);
        assert_refused(&s, "matmul", b.matmul(&x, 2, view, &mut short));
        assert_refused(&s, "matmul", b.matmul(&x, 3, view, &mut out));
        assert_refused(
            &s,
            "matmul_columns",
            b.matmul_columns(&x, 2, view, &mut out, 8, 1),
        );
        let mut outs = [&mut out];
        assert_refused(&s, "matmuls", b.matmuls(&x, 2, &[view, view], &mut outs));
        let parts = [(b.weight_from_f32(&[0.5; 64], DType::F32).unwrap(), 8)];
        assert_refused(
            &s,
            "matmul_parts",
            b.matmul_parts(&x, 2, (&parts, 8), &mut out, 7),
        );
        let blocks = synthetic::quant_blocks(QuantFormat::Q8_0, 1, 64, 0.5);
        let q = b.weight_from_blocks(blocks, DType::Quant(QuantFormat::Q8_0), 64);
        if !b.capabilities().reads(QuantFormat::Q8_0) {
            assert!(
                q.is_err(),
                "{}: blocks of a format it does not read",
                s.name
            );
            continue;
        }
        let q = q.unwrap();
        let across = WeightView {
            buffer: &q,
            offset: 16,
            rows: 1,
            cols: 32,
        };
        let xq = f32_buf(b, &[1.0; 32]);
        let mut one = out_buf(b, 1);
        assert_refused(&s, "matmul", b.matmul(&xq, 1, across, &mut one));
    }
}

/// Products of weights in every block format a backend reads, at the row counts where a
/// GPU's kernels change (its integer few-row products up to 8 rows, bf16 tiles on decoded
/// weights past them), through a view of whole blocks, also into columns of a wider output
/// (the rest left as it was); FP8 rows of 40 blocks, which a GPU's warps take in more than
/// one pass.
#[test]
fn block_format_products_match_the_reference_where_kernels_change() {
    let mut rng = Rng(41);
    for (n, format) in QuantFormat::ALL.into_iter().enumerate() {
        let block = format.block().0;
        for rows in [1, 2, 3, 5, 8, 9, 40] {
            let (out_rows, spans) = (1 + rng.below(70), 1 + rng.below(3));
            let passes = format == QuantFormat::F8E4M3x128 && (rows == 1 || rows == 8);
            let cols = block * if passes { 40 } else { spans };
            let x = rng.values(rows * cols);
            let f = Format::Blocks(format);
            for s in subjects() {
                let b = s.backend;
                let Some((w, values)) = f.weights(b, out_rows * cols, 50 + n as u64) else {
                    continue;
                };
                let want = reference::matmul(&x, rows, cols, &values, out_rows);
                let what = format!(
                    "{} matmul, {rows} rows of {cols} into {out_rows}",
                    format.name()
                );
                let view = WeightView::new(&w, out_rows, cols).unwrap();
                let xb = f32_buf(b, &x);
                let mut out = out_buf(b, rows * out_rows);
                b.matmul(&xb, rows, view, &mut out).unwrap();
                let tol = f.tol(&s, rows, cols);
                assert_within(&s, &what, &download(b, &out, rows * out_rows), &want, tol);
                let wide = out_rows + 5;
                let mut placed = f32_buf(b, &vec![f32::NAN; rows * wide]);
                b.matmul_columns(&xb, rows, view, &mut placed, wide, 3)
                    .unwrap();
                let mut want_placed = vec![f32::NAN; rows * wide];
                for r in 0..rows {
                    want_placed[r * wide + 3..r * wide + 3 + out_rows]
                        .copy_from_slice(&want[r * out_rows..(r + 1) * out_rows]);
                }
                let got = download(b, &placed, rows * wide);
                assert_placed(
                    &s,
                    &format!("{what}: into columns"),
                    &got,
                    &want_placed,
                    tol,
                );
            }
        }
    }
}
