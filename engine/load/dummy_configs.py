"""Checkpoint configs of known shapes for `dummy:NAME` models (random weights, no files): benchmarks and
GPU checks at real sizes without a download."""

DUMMY_CONFIGS: dict[str, dict] = {
    "gemma-2-9b": {     # soft-capped attention, sliding and global layers, head_dim 256: the GPU paths Llama skips
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256000,
        "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "bos_token_id": 2, "eos_token_id": [1, 107],
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    },
    "qwen3-30b-a3b": {     # 30.5B parameters, 3.3B active: 48 layers of 128 experts, 8 per token
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2,
    },
}
