use super::*;

fn parse(json: &str) -> ModelConfig {
    ModelConfig::from_json(json, Path::new("config.json")).unwrap()
}

#[test]
fn absent_head_dim_follows_transformers_defaults() {
    let dense = r#"{"model_type": "qwen3", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "intermediate_size": 8}"#;
    assert_eq!(parse(dense).head_dim, 128);
    let moe = r#"{"model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 8}"#;
    assert_eq!(parse(moe).head_dim, 16);
}

#[test]
fn both_key_spellings_agree() {
    let hub = r#"{"model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        "rope_theta": 1e6, "torch_dtype": "bfloat16", "rope_scaling": null}"#;
    let v5 = r#"{"model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "dtype": "bfloat16"}"#;
    assert_eq!(parse(hub), parse(v5));
    assert_eq!(parse(hub).rope, RopeParams::plain(1e6));
}

#[test]
fn huge_or_unsupported_values_are_refused_by_name() {
    let base = r#""model_type": "qwen3", "vocab_size": 10, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 8"#;
    for (extra, field) in [
        (
            r#""num_hidden_layers": 1000000000000000000"#,
            "num_hidden_layers",
        ),
        (r#""num_hidden_layers": 1, "head_dim": 4096"#, "head_dim"),
        (
            r#""num_hidden_layers": 1, "attention_bias": true"#,
            "attention_bias",
        ),
        (
            r#""num_hidden_layers": 1, "hidden_act": "gelu""#,
            "hidden_act",
        ),
    ] {
        let json = format!("{{{base}, {extra}}}");
        let err = ModelConfig::from_json(&json, Path::new("config.json"))
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{err}");
    }
}

#[test]
fn unsupported_rope_type_is_named() {
    let llama3 = r#"{"model_type": "qwen3", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "intermediate_size": 8, "rope_scaling": {"rope_type": "llama3", "factor": 4}}"#;
    let err = ModelConfig::from_json(llama3, Path::new("config.json"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rope_scaling.rope_type") && err.contains("llama3"),
        "{err}"
    );
}

/// Qwen3's documented YaRN settings, in both spellings: the context runs to the original
/// times the factor, and transformers' defaults fill the rest.
#[test]
fn yarn_is_read_with_transformers_defaults() {
    let base = r#""model_type": "qwen3", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "intermediate_size": 8, "max_position_embeddings": 40960"#;
    let hub = format!(
        r#"{{{base}, "rope_theta": 1e6, "rope_scaling": {{"rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 32768}}}}"#
    );
    let v5 = format!(
        r#"{{{base}, "rope_parameters": {{"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
        "original_max_position_embeddings": 32768}}}}"#
    );
    let c = parse(&hub);
    assert_eq!(c, parse(&v5));
    let y = c.rope.yarn.unwrap();
    assert_eq!((y.factor, y.original_max_position_embeddings), (4.0, 32768));
    assert_eq!((y.beta_fast, y.beta_slow, y.truncate), (32.0, 1.0, true));
    assert!((y.attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
    assert_eq!(c.max_context(), 131_072);
    assert_eq!(c.max_position_embeddings, 40_960);
    // No original context given: transformers takes max_position_embeddings.
    let bare = format!(r#"{{{base}, "rope_scaling": {{"type": "yarn", "factor": 2}}}}"#);
    assert_eq!(parse(&bare).max_context(), 81_920);
    // No factor: the model's context over the original (40,960 / 10,240 = 4).
    let no_factor = format!(
        r#"{{{base}, "rope_scaling": {{"type": "yarn", "original_max_position_embeddings": 10240}}}}"#
    );
    assert_eq!(parse(&no_factor).rope.yarn.unwrap().factor, 4.0);
    // A zero beta is the default, as transformers reads `beta or default`.
    let zero_beta =
        format!(r#"{{{base}, "rope_scaling": {{"type": "yarn", "factor": 2, "beta_fast": 0}}}}"#);
    assert_eq!(parse(&zero_beta).rope.yarn.unwrap().beta_fast, 32.0);
    for (bad, field) in [
        (
            r#"{"rope_type": "yarn", "factor": 0.5}"#,
            "rope_scaling.factor",
        ),
        (
            r#"{"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 1.5}"#,
            "rope_scaling.original_max_position_embeddings",
        ),
        (
            r#"{"rope_type": "yarn", "factor": 2, "beta_slow": -1}"#,
            "rope_scaling.beta_slow",
        ),
        (
            r#"{"rope_type": "yarn", "factor": 2, "attention_factor": 0}"#,
            "rope_scaling.attention_factor",
        ),
        (
            r#"{"rope_type": "yarn", "factor": 2, "truncate": "yes"}"#,
            "rope_scaling.truncate",
        ),
    ] {
        let json = format!(r#"{{{base}, "rope_scaling": {bad}}}"#);
        let err = ModelConfig::from_json(&json, Path::new("config.json"))
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{err}");
    }
}
