//! FP8 checkpoints (Qwen's and transformers' fine-grained FP8: e4m3 projections with a scale
//! per 128×128 block in `weight_scale_inv`): a small Qwen3-MoE written twice, once in FP8 and
//! once with those FP8 weights' values in bf16, gives the same logits bit for bit on the CPU
//! (which decodes FP8 to bf16 at load); a missing or misshapen scale is an error naming it.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use common::{fixture_dir, logits_chunked};
use corral_backend::quant::e4m3_value;
use corral_cpu::CpuBackend;
use corral_model::Model;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

const HIDDEN: usize = 128;
const HEAD_DIM: usize = 64;
const HEADS: usize = 2;
const KV_HEADS: usize = 1;
const EXPERTS: usize = 4;
const INTER: usize = 256;
const LAYERS: usize = 2;
const VOCAB: usize = 448;

/// The fixture's config with this test's sizes.
fn config() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture_dir("qwen3_moe_sharded").join("config.json"))
        .expect("fixture config");
    let mut c: serde_json::Value = serde_json::from_str(&text).expect("config json");
    for (key, value) in [
        ("hidden_size", HIDDEN),
        ("head_dim", HEAD_DIM),
        ("num_attention_heads", HEADS),
        ("num_key_value_heads", KV_HEADS),
        ("num_experts", EXPERTS),
        ("moe_intermediate_size", INTER),
        ("intermediate_size", 2 * INTER),
        ("num_hidden_layers", LAYERS),
        ("max_window_layers", LAYERS),
        ("vocab_size", VOCAB),
    ] {
        c[key] = value.into();
    }
    c["torch_dtype"] = "bfloat16".into();
    c
}

/// Deterministic values in [-scale, scale).
fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// The nearest e4m3 byte to `v` (ties to the even code; within ±448), by the positive codes'
/// values, which rise with the code.
fn e4m3(v: f32) -> u8 {
    static POSITIVE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    let table = POSITIVE.get_or_init(|| (0u8..0x7f).map(e4m3_value).collect());
    let sign = if v < 0.0 { 0x80 } else { 0 };
    let a = v.abs().min(448.0);
    let above = table.partition_point(|&t| t < a).min(table.len() - 1);
    let below = above.saturating_sub(1);
    let (d_below, d_above) = (a - table[below], table[above] - a);
    let code = if d_below < d_above || (d_below == d_above && below % 2 == 0) {
        below
    } else {
        above
    };
    sign | code as u8
}

/// `values` (`[n, k]`) quantized as FP8 checkpoints store them: e4m3 bytes and a scale per
/// 128×128 block (its largest magnitude over 448), with the values those bytes decode to.
fn quantize(values: &[f32], n: usize, k: usize) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
    let (bn, bk) = (n.div_ceil(128), k / 128);
    let mut scales = vec![0f32; bn * bk];
    for (i, v) in values.iter().enumerate() {
        let b = (i / k) / 128 * bk + (i % k) / 128;
        scales[b] = scales[b].max(v.abs() / 448.0);
    }
    let mut bytes = Vec::with_capacity(values.len());
    let mut decoded = Vec::with_capacity(values.len());
    for (i, v) in values.iter().enumerate() {
        let s = scales[(i / k) / 128 * bk + (i % k) / 128];
        let q = e4m3(if s > 0.0 { v / s } else { 0.0 });
        bytes.push(q);
        decoded.push(e4m3_value(q) * s);
    }
    (bytes, scales, decoded)
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
        .collect()
}

/// Writes the model twice under `dir`: `fp8/` with the projections in FP8 and `bf16/` with
/// their decoded values; `edit` changes the FP8 file's tensors (name → dtype, shape, bytes)
/// before it is written.
fn write_models(dir: &Path, edit: impl FnOnce(&mut HashMap<String, (Dtype, Vec<usize>, Vec<u8>)>)) {
    let mut fp8: HashMap<String, (Dtype, Vec<usize>, Vec<u8>)> = HashMap::new();
    let mut bf16: HashMap<String, (Dtype, Vec<usize>, Vec<u8>)> = HashMap::new();
    let mut seed = 0;
    let mut plain = |name: String, shape: Vec<usize>, scale: f32, ones: bool| {
        seed += 1;
        let n = shape.iter().product();
        let v = if ones {
            vec![1.0; n]
        } else {
            values(seed, n, scale)
        };
        let bytes = bf16_bytes(&v);
        fp8.insert(name.clone(), (Dtype::BF16, shape.clone(), bytes.clone()));
        bf16.insert(name, (Dtype::BF16, shape, bytes));
    };
    plain(
        "model.embed_tokens.weight".into(),
        vec![VOCAB, HIDDEN],
        0.5,
        false,
    );
    plain("lm_head.weight".into(), vec![VOCAB, HIDDEN], 0.1, false);
    plain("model.norm.weight".into(), vec![HIDDEN], 0.0, true);
    let mut projections = Vec::new();
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}.");
        plain(
            format!("{p}input_layernorm.weight"),
            vec![HIDDEN],
            0.0,
            true,
        );
        plain(
            format!("{p}post_attention_layernorm.weight"),
            vec![HIDDEN],
            0.0,
            true,
        );
        plain(
            format!("{p}self_attn.q_norm.weight"),
            vec![HEAD_DIM],
            0.0,
            true,
        );
        plain(
            format!("{p}self_attn.k_norm.weight"),
            vec![HEAD_DIM],
            0.0,
            true,
        );
        plain(
            format!("{p}mlp.gate.weight"),
            vec![EXPERTS, HIDDEN],
            0.3,
            false,
        );
        projections.push((
            format!("{p}self_attn.q_proj.weight"),
            HEADS * HEAD_DIM,
            HIDDEN,
        ));
        projections.push((
            format!("{p}self_attn.k_proj.weight"),
            KV_HEADS * HEAD_DIM,
            HIDDEN,
        ));
        projections.push((
            format!("{p}self_attn.v_proj.weight"),
            KV_HEADS * HEAD_DIM,
            HIDDEN,
        ));
        projections.push((
            format!("{p}self_attn.o_proj.weight"),
            HIDDEN,
            HEADS * HEAD_DIM,
        ));
        for e in 0..EXPERTS {
            let x = format!("{p}mlp.experts.{e}.");
            projections.push((format!("{x}gate_proj.weight"), INTER, HIDDEN));
            projections.push((format!("{x}up_proj.weight"), INTER, HIDDEN));
            projections.push((format!("{x}down_proj.weight"), HIDDEN, INTER));
        }
    }
    for (name, n, k) in projections {
        seed += 1;
        let (bytes, scales, decoded) = quantize(&values(seed, n * k, 0.2), n, k);
        let scale_shape = vec![n.div_ceil(128), k / 128];
        let scale_bytes = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        fp8.insert(
            format!("{name}_scale_inv"),
            (Dtype::F32, scale_shape, scale_bytes),
        );
        fp8.insert(name.clone(), (Dtype::F8_E4M3, vec![n, k], bytes));
        bf16.insert(name, (Dtype::BF16, vec![n, k], bf16_bytes(&decoded)));
    }
    edit(&mut fp8);
    for (sub, tensors) in [("fp8", &fp8), ("bf16", &bf16)] {
        let d = dir.join(sub);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("config.json"), config().to_string()).unwrap();
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(name, (dtype, shape, bytes))| {
                (
                    name.clone(),
                    TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
                )
            })
            .collect();
        let file = safetensors::serialize(views, &None).unwrap();
        std::fs::write(d.join("model.safetensors"), file).unwrap();
    }
}

fn load(dir: &Path) -> corral_model::Result<Model> {
    Model::load(dir, Arc::new(CpuBackend::new()), &mut |_, _| {})
}

#[test]
fn an_fp8_checkpoint_gives_the_logits_of_its_decoded_values() {
    let dir = tempfile::tempdir().unwrap();
    write_models(dir.path(), |_| {});
    let tokens: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % VOCAB as u32).collect();
    let fp8 = load(&dir.path().join("fp8")).unwrap();
    let bf16 = load(&dir.path().join("bf16")).unwrap();
    for chunk in [1, tokens.len()] {
        let (a, b) = (
            logits_chunked(&fp8, &tokens, chunk),
            logits_chunked(&bf16, &tokens, chunk),
        );
        assert!(
            a.iter().all(|v| v.is_finite()),
            "chunk {chunk}: finite logits"
        );
        assert_eq!(
            a, b,
            "chunk {chunk}: FP8 against its decoded values in bf16"
        );
    }
}

#[test]
fn an_fp8_weight_without_its_scales_or_with_misshapen_ones_is_refused_by_name() {
    let name = "model.layers.1.self_attn.k_proj.weight";
    let scale = format!("{name}_scale_inv");
    let dir = tempfile::tempdir().unwrap();
    write_models(dir.path(), |t| {
        t.remove(&scale);
    });
    let err = load(&dir.path().join("fp8")).unwrap_err().to_string();
    assert!(err.contains(&scale), "{err}");
    let dir = tempfile::tempdir().unwrap();
    write_models(dir.path(), |t| {
        t.insert(scale.clone(), (Dtype::F32, vec![2, 1], vec![0; 8]));
    });
    let err = load(&dir.path().join("fp8")).unwrap_err().to_string();
    assert!(err.contains(&scale), "{err}");
}

/// On a GPU, which keeps the FP8 blocks (few rows and per-token experts on tensor cores with
/// x in f16; more rows on bf16 copies), the logits stay near the CPU's. Skips without one.
#[test]
fn an_fp8_checkpoint_on_the_gpu_stays_near_the_cpu() {
    if let Err(why) = corral_cuda::cuda_available() {
        eprintln!("skipped: no CUDA device ({why})");
        return;
    }
    let gpu: Arc<dyn corral_backend::Backend> = Arc::new(
        corral_cuda::CudaBackend::new(corral_cuda::CudaOptions {
            kv_dtype: Some(corral_backend::DType::F32),
            ..Default::default()
        })
        .expect("open cuda:0"),
    );
    let dir = tempfile::tempdir().unwrap();
    write_models(dir.path(), |_| {});
    let on_gpu = Model::load(&dir.path().join("fp8"), gpu, &mut |_, _| {}).unwrap();
    let on_cpu = load(&dir.path().join("fp8")).unwrap();
    let tokens: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % VOCAB as u32).collect();
    for chunk in [1, tokens.len()] {
        let (a, b) = (
            logits_chunked(&on_gpu, &tokens, chunk),
            logits_chunked(&on_cpu, &tokens, chunk),
        );
        let err = common::rel_err(&a, &b);
        eprintln!("chunk {chunk}: GPU against CPU {err:.2e}");
        assert!(err < 2e-2, "chunk {chunk}: GPU against CPU {err:.2e}");
    }
}
