//! `corral inspect`: what a checkpoint is and what it costs in memory.

use anyhow::{Context, Result};
use clap::Args;
use corral_backend::DType;
use corral_model::ModelConfig;

use crate::loading::{ModelArgs, load_model};

/// Arguments of `corral inspect`.
#[derive(Debug, Args)]
pub(crate) struct InspectArgs {
    #[command(flatten)]
    model: ModelArgs,
}

pub(crate) fn run(args: InspectArgs) -> Result<()> {
    // A synthetic model is described from its config alone, without making its weights.
    let (config, num_parameters, weight_bytes) = match &args.model.synthetic {
        Some(path) => {
            let config = ModelConfig::from_file(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let params = config.num_parameters();
            let bytes = corral_model::Model::synthetic_weight_bytes(&config);
            (config, params, bytes)
        }
        None => {
            let model = load_model(&args.model)?;
            (
                model.config().clone(),
                model.num_parameters(),
                model.weight_bytes(),
            )
        }
    };
    let c = &config;
    println!("model_type           {}", c.family.model_type());
    println!("layers               {}", c.num_layers);
    println!("hidden_size          {}", c.hidden_size);
    println!(
        "attention            {} heads, {} kv heads, head_dim {}",
        c.num_heads, c.num_kv_heads, c.head_dim
    );
    match &c.moe {
        Some(m) => {
            let sparse = (0..c.num_layers).filter(|&i| c.is_sparse_layer(i)).count();
            println!(
                "experts              {} routed, top-{}, intermediate {}, norm_topk_prob {}",
                m.num_experts, m.top_k, m.moe_intermediate_size, m.norm_topk_prob
            );
            println!("sparse layers        {sparse} of {}", c.num_layers);
        }
        None => println!(
            "mlp                  dense, intermediate {}",
            c.intermediate_size
        ),
    }
    println!("vocab_size           {}", c.vocab_size);
    println!("tied embeddings      {}", c.tie_word_embeddings);
    println!("rope_theta           {}", c.rope.theta);
    if let Some(y) = c.rope.yarn {
        println!(
            "rope scaling         yarn, factor {} over {} positions (attention factor {:.4})",
            y.factor, y.original_max_position_embeddings, y.attention_factor
        );
    }
    println!("max context          {}", c.max_context());
    println!("parameters           {num_parameters}");
    println!(
        "weight bytes         {weight_bytes} ({:.2} MiB)",
        weight_bytes as f64 / (1 << 20) as f64
    );
    println!(
        "KV bytes per token   {} at f32, {} at bf16, {} at fp8 (with its head scales)",
        c.kv_bytes_per_token(DType::F32),
        c.kv_bytes_per_token(DType::BF16),
        c.kv_bytes_per_token(DType::F8E4M3)
    );
    if let Some(h) = &c.hybrid {
        let full = c.num_attention_layers();
        println!(
            "layers               {} Gated DeltaNet, {full} gated attention",
            c.num_linear_layers()
        );
        println!(
            "linear attention     {} key heads x {}, {} value heads x {}, conv kernel {}",
            h.linear.num_key_heads,
            h.linear.key_head_dim,
            h.linear.num_value_heads,
            h.linear.value_head_dim,
            h.linear.conv_kernel
        );
        println!(
            "state per sequence   {} bytes (fp32 delta-rule state, f32 conv state of kernel-1 inputs)",
            corral_model::RecurrentStateCache::bytes_per_slot(c)
        );
    }
    Ok(())
}
