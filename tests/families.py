"""Tiny config entries per mlx-lm model family: `conftest.make_tiny_model(path, **COMPRESSED[f])`.

Each entry overrides or adds to make_tiny_model's base config (2 layers, hidden 64, 4 query and
2 KV heads of dim 32, byte-level vocabulary): the fields a family's `ModelArgs` requires and the
feature that makes the family what it is (llama3 RoPE scaling, sliding windows, partial rotary,
soft-capped scores, QK norms, MoE routing, biases, multipliers); `embed_std` and
`attn_gain` (overriding the test's) are make_tiny_model's own. Families whose ModelArgs take no
`head_dim` get 2 query heads and 1 KV head, so their head dim is 64 / 2 = 32 as well.
"""

from __future__ import annotations

_TWO_HEADS = {"num_attention_heads": 2, "num_key_value_heads": 1}

# Families the compressed presets serve (their attention goes through mlx-lm's routed SDPA, or
# through the Gemma-2 shim of `longctx.kvcache.routing`).
COMPRESSED = {
    "llama": {},
    "llama3-rope": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        }
    },
    # mlx-lm maps model_type "mistral" onto its llama module (MODEL_REMAPPING)
    "mistral": {"model_type": "mistral", "rope_theta": 1e6},
    "ministral3": {
        "model_type": "ministral3",
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e6,
            "llama_4_scaling_beta": 0.1,
            # below the document's length: the scale grows past it
            "original_max_position_embeddings": 256,
        },
    },
    "qwen2": {"model_type": "qwen2", **_TWO_HEADS},
    "qwen3": {"model_type": "qwen3"},
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, **_TWO_HEADS},
    "gemma2": {
        "model_type": "gemma2",
        "query_pre_attn_scalar": 32,
        "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 30.0,
    },
    # layer 0 slides (window 64: the document runs past it), layer 1 is full attention
    "gemma3_text": {"model_type": "gemma3_text", "query_pre_attn_scalar": 32, "sliding_window": 64, "sliding_window_pattern": 2},
    "phi3": {"model_type": "phi3", "partial_rotary_factor": 0.5, "tie_word_embeddings": False, **_TWO_HEADS},
    "olmo2": {"model_type": "olmo2"},
    "starcoder2": {"model_type": "starcoder2", "norm_epsilon": 1e-5, **_TWO_HEADS},
    "granite": {
        "model_type": "granite",
        "logits_scaling": 2.0,
        "attention_multiplier": 0.25,
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "attention_bias": False,
        "mlp_bias": False,
        **_TWO_HEADS,
    },
    "cohere": {"model_type": "cohere", "layer_norm_eps": 1e-5, "logit_scale": 0.5, "use_qk_norm": False, **_TWO_HEADS},
    "internlm2": {"model_type": "internlm2", "bias": False, "tie_word_embeddings": False, **_TWO_HEADS},
    "exaone": {"model_type": "exaone", "num_layers": 2, "layer_norm_epsilon": 1e-5, **_TWO_HEADS},
    # Gemma scales embeddings by sqrt(hidden) = 8 (8x smaller ones, or attention never matters),
    # and its norms by 1 + weight = 2 at init (gain 1 gives the other families' gain-2 scores)
    "gemma": {"model_type": "gemma", "embed_std": 0.0625, "attn_gain": 1.0},
    # NoPE every 2nd layer (layer 1 attends without positions)
    "smollm3": {"model_type": "smollm3", "no_rope_layer_interval": 2},
    "glm4": {"model_type": "glm4", "attention_bias": True, "partial_rotary_factor": 0.5},
    "cohere2": {
        "model_type": "cohere2",
        "layer_norm_eps": 1e-5,
        "logit_scale": 0.5,
        "sliding_window": 64,
        "sliding_window_pattern": 2,
        **_TWO_HEADS,
    },
    "exaone4": {
        "model_type": "exaone4",
        "rope_scaling": None,
        "sliding_window": 64,
        "sliding_window_pattern": "LG",
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "olmo3": {"model_type": "olmo3", "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]},
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        **_TWO_HEADS,
    },
    "gpt_neox": {
        "model_type": "gpt_neox",
        "layer_norm_eps": 1e-5,
        "rotary_emb_base": 10000,
        "rotary_pct": 0.25,
        "tie_word_embeddings": False,
        **_TWO_HEADS,
    },
    "phi": {"model_type": "phi", "partial_rotary_factor": 0.4, "layer_norm_eps": 1e-5, **_TWO_HEADS},
    "stablelm": {
        "model_type": "stablelm",
        "use_qkv_bias": True,
        "partial_rotary_factor": 0.25,
        "layer_norm_eps": 1e-5,
        **_TWO_HEADS,
    },
}

# Families no preset but fp16 can serve, and families nothing can store (`kvcache.support`).
REFUSED = {
    "deepseek_v2": {
        "model_type": "deepseek_v2",
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 32,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "rope_scaling": {"factor": 1.0, "type": "yarn", "original_max_position_embeddings": 4096},
    },
    # real DeepSeek-V2 checkpoints: keys qk_nope + qk_rope wide, values v_head_dim
    "deepseek_v2-wide-keys": {
        "model_type": "deepseek_v2",
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "rope_scaling": {"factor": 1.0, "type": "yarn", "original_max_position_embeddings": 4096},
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 32,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        "linear_num_value_heads": 2,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 32,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "partial_rotary_factor": 0.25,
        "full_attention_interval": 2,
    },
    "mamba": {
        "model_type": "mamba",
        "state_size": 8,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 4,
    },
    "falcon_h1": {
        "model_type": "falcon_h1",
        "mamba_d_ssm": 64,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_d_state": 8,
        "mamba_chunk_size": 32,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_expand": 1,
    },
}
