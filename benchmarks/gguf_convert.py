"""An HF checkpoint directory written as GGUF the way llama.cpp's convert_hf_to_gguf does it:
GGUF tensor names, llama's q/k rows permuted, byte-level BPE tokenizer metadata and the chat
template. Used by the tests' tiny GGUF models and by the 1B benchmark's F16 file (llama.cpp's own
quantizer makes its Q8_0 and Q4_0 from that).

    write_gguf(src_dir, out_path, arch="llama", qtype="F16")
"""
from __future__ import annotations

import json
from pathlib import Path

_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"


def llama_cpp_permute(w, heads: int):
    # llama.cpp's convert_hf_to_gguf permute: HF rotate_half rows -> interleaved pairs per head
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_hparams(w, cfg: dict) -> None:
    """The model's hyperparameters from its HF config.json."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg["rope_theta"] if "rope_theta" in cfg else cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])


def add_tokenizer(w, tok: dict, vocab_size: int, chat_template: str) -> None:
    """Byte-level BPE metadata from an HF tokenizer.json (tokens, types, merges, special ids, template)."""
    # the model's vocab may be larger than the tokenizer's; pad like llama.cpp does
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + [f"[PAD{i}]" for i in range(len(vocab), vocab_size)]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else (5 if t.startswith("[PAD") else 1) for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template)


def add_tensors(w, src: Path, arch: str, qtype: str, cfg: dict) -> None:
    """The checkpoint's tensors under GGUF names (llama q/k rows permuted); 2-D ones as qtype.
    Read one at a time through torch (bfloat16 checkpoints included)."""
    import gguf
    from safetensors import safe_open

    qt = gguf.GGMLQuantizationType[qtype]
    for file in sorted(Path(src).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name).float().numpy()
                if arch == "llama" and ".q_proj." in name:
                    t = llama_cpp_permute(t, cfg["num_attention_heads"])
                elif arch == "llama" and ".k_proj." in name:
                    t = llama_cpp_permute(t, cfg["num_key_value_heads"])
                if t.ndim == 2 and qtype != "F32":
                    q = gguf.quants.quantize(t, qt)
                    w.add_tensor(gguf_name(name), q, raw_shape=q.shape, raw_dtype=qt)
                else:
                    w.add_tensor(gguf_name(name), t)


def write_gguf(src: Path, path: Path, arch: str = "llama", qtype: str = "F16") -> Path:
    """Converts the HF checkpoint directory `src` (config.json, tokenizer.json, chat_template.jinja,
    *.safetensors) to the GGUF file `path`."""
    import gguf

    src = Path(src)
    cfg = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(path), arch)
    add_hparams(w, cfg)
    add_tokenizer(w, tok, cfg["vocab_size"], (src / "chat_template.jinja").read_text())
    add_tensors(w, src, arch, qtype, cfg)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
