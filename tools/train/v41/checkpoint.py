"""Reading and writing checkpoints in the release layout (model-spec §2), by hand: a safetensors
file is an 8-byte little-endian header length, a JSON header, then raw little-endian bytes.

load_weights() returns every tensor dequantized to fp32 under its checkpoint name, with the
`.scale` siblings consumed:
  * F8_E4M3 weights with an F8_E8M0 `<name>.scale`: W = e4m3(w) · 2^(s-127), one scale per tile;
    the tile is derived from the two shapes (32×32 for dense weights in these checkpoints, 128×128
    in the release; 1×32 for Engram tables, whose scale is [rows, dim/32]).
  * I8 routed experts: two E2M1 codes per byte along K, the low nibble the even k, with F8_E8M0
    scales per 32 along K (the scale shape gives the group size).
  * BF16 and F32 widened exactly; F8_E4M3 without a scale is decoded as is.
"""
import json
import math
import os
import struct

import numpy as np
import torch

from .numerics import E2M1_TABLE, e4m3_table, e8m0_values

_E4M3 = e4m3_table()


def load_config(model_dir):
    """The flat inference/config.json (ModelArgs field names); else the HF config.json mapped to
    those names (model-spec §1.2)."""
    flat = os.path.join(model_dir, "inference", "config.json")
    if os.path.exists(flat):
        with open(flat) as f:
            return json.load(f)
    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    t = hf.get("text_config", hf)
    rs = t.get("rope_scaling") or {}
    cfg = {
        "vocab_size": t["vocab_size"], "dim": t["hidden_size"], "moe_inter_dim": t["moe_intermediate_size"],
        "n_layers": t["num_hidden_layers"], "n_mtp_layers": t.get("num_nextn_predict_layers", 0),
        "n_heads": t["num_attention_heads"], "head_dim": t["head_dim"], "rope_head_dim": t["qk_rope_head_dim"],
        "q_lora_rank": t["q_lora_rank"], "o_lora_rank": t["o_lora_rank"], "o_groups": t["o_groups"],
        "swiglu_limit": t.get("swiglu_limit", 0.0), "norm_eps": t.get("rms_norm_eps", 1e-20),
        "rope_theta": t.get("rope_theta", 10000.0), "compress_rope_theta": t.get("compress_rope_theta", 10000.0),
        "original_seq_len": rs.get("original_max_position_embeddings", 0), "rope_factor": rs.get("factor", 1),
        "beta_fast": rs.get("beta_fast", 32), "beta_slow": rs.get("beta_slow", 1),
        "n_routed_experts": t["n_routed_experts"], "n_shared_experts": t.get("n_shared_experts", 1),
        "n_activated_experts": t["num_experts_per_tok"], "score_func": t.get("scoring_func", "sqrtsoftplus"),
        "route_scale": t.get("routed_scaling_factor", 1.0), "norm_topk_prob": t.get("norm_topk_prob", True),
        "window_size": t["sliding_window"], "compress_ratios": t["compress_ratios"],
        "kv_source_layers": t.get("kv_source_layer_ids", []), "index_source_layers": t.get("index_source_layer_ids", []),
        "index_n_heads": t.get("index_n_heads", 0), "index_head_dim": t.get("index_head_dim", 0),
        "index_topk": t.get("index_topk", 0), "candidate_source_layer": t.get("candidate_source_layer_id", -1),
        "candidate_topk_blocks": t.get("candidate_topk_blocks", 0), "candidate_block_size": t.get("candidate_block_size", 0),
        "hc_mult": t.get("hc_mult", 4), "hc_sinkhorn_iters": t.get("hc_sinkhorn_iters", 20), "hc_eps": t.get("hc_eps", 1e-6),
        "engram_layer_ids": t.get("engram_layer_ids", []), "engram_num_embeddings": t.get("engram_num_embeddings", []),
        "engram_max_ngram_size": t.get("engram_max_ngram_size", 0), "engram_vocab_size": t.get("engram_vocab_size", 0),
        "engram_n_heads": t.get("engram_n_heads", 0), "engram_head_dim": t.get("engram_head_dim", 0),
        "engram_pad_id": t.get("engram_pad_token_id", 2),
        "engram_compressed_vocab_size": t.get("engram_compressed_vocab_size", 0),
        "dspark_block_size": t.get("dspark_block_size", 0), "dspark_noise_token_id": t.get("dspark_noise_token_id", 0),
        "dspark_target_layer_ids": t.get("dspark_target_layer_ids", []), "dspark_markov_rank": t.get("dspark_markov_rank", 0),
        "dspark_n_routed_experts": t.get("dspark_n_routed_experts", 0),
        "dspark_n_activated_experts": t.get("dspark_num_experts_per_tok", 0),
        "max_seq_len": t.get("max_position_embeddings", 4096),
    }
    if "gate_temp" in t:
        cfg["gate_temp"] = t["gate_temp"]
    qc = hf.get("quantization_config") or {}
    cfg["dtype"] = "fp8" if qc.get("quant_method") == "fp8" else "bf16"
    cfg["expert_dtype"] = qc.get("expert_dtype")
    return cfg


def read_safetensors_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return header, 8 + n


def read_safetensors(path, names=None):
    """{name: (dtype string, shape, raw bytes)} for the tensors of one file (all, or `names`)."""
    header, base = read_safetensors_header(path)
    out = {}
    with open(path, "rb") as f:
        data = f.read()
    for name, info in header.items():
        if name == "__metadata__" or (names is not None and name not in names):
            continue
        a, b = info["data_offsets"]
        out[name] = (info["dtype"], tuple(info["shape"]), data[base + a: base + b])
    return out


def _raw_tensor(dtype, shape, raw):
    """The stored values as a torch tensor of the natural container type."""
    if dtype == "F32":
        return torch.from_numpy(np.frombuffer(raw, dtype="<f4").copy()).reshape(shape)
    if dtype == "BF16":
        u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return torch.from_numpy(u.view(np.float32).copy()).reshape(shape)
    if dtype == "F16":
        return torch.from_numpy(np.frombuffer(raw, dtype="<f2").astype(np.float32)).reshape(shape)
    if dtype in ("F8_E4M3", "F8_E8M0", "U8", "I8"):
        return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy()).reshape(shape)
    if dtype == "I32":
        return torch.from_numpy(np.frombuffer(raw, dtype="<i4").copy()).reshape(shape)
    if dtype == "I64":
        return torch.from_numpy(np.frombuffer(raw, dtype="<i8").copy()).reshape(shape)
    raise ValueError(f"unsupported safetensors dtype {dtype}")


def _expand_scale(scale, rows, cols):
    """Per-tile scale values [R, C] -> [rows, cols], the tile size derived from the shapes."""
    R, C = scale.shape
    tr, tc = math.ceil(rows / R), math.ceil(cols / C)
    return scale.repeat_interleave(tr, dim=0)[:rows].repeat_interleave(tc, dim=1)[:, :cols]


def dequantize(dtype, shape, raw, scale=None):
    t = _raw_tensor(dtype, shape, raw)
    if dtype == "F8_E4M3":
        v = _E4M3[t.long()]
        if scale is not None:
            v = v * _expand_scale(e8m0_values(scale), *v.shape)
        return v
    if dtype == "I8":  # packed E2M1 pairs along K, low nibble = even k (model-spec §2.2)
        lo, hi = E2M1_TABLE[(t & 0x0F).long()], E2M1_TABLE[(t >> 4).long()]
        v = torch.stack([lo, hi], dim=-1).flatten(-2)
        if scale is not None:
            v = v * _expand_scale(e8m0_values(scale), *v.shape)
        return v
    if dtype == "F8_E8M0":
        return e8m0_values(t)
    return t.to(torch.float32) if t.dtype != torch.float32 else t


def _shard_files(model_dir):
    idx = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            wm = json.load(f)["weight_map"]
        files = {}
        for name, fn in wm.items():
            files.setdefault(fn, []).append(name)
        return {os.path.join(model_dir, fn): set(ns) for fn, ns in files.items()}
    single = os.path.join(model_dir, "model.safetensors")
    return {single: None}


def load_weights(model_dir, with_dtypes=False):
    """{name: fp32 tensor} for every checkpoint tensor except the `.scale` siblings, dequantized.
    with_dtypes=True also returns {name: stored dtype} (the `.scale`d ones as stored)."""
    stored = {}
    for path, names in _shard_files(model_dir).items():
        stored.update(read_safetensors(path, names))
    out, dtypes = {}, {}
    for name, (dtype, shape, raw) in stored.items():
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in stored:
            continue
        scale = None
        if name.endswith(".weight"):
            sname = name[: -len(".weight")] + ".scale"
            if sname in stored:
                sd, ss, sr = stored[sname]
                scale = _raw_tensor(sd, ss, sr)
        out[name] = dequantize(dtype, shape, raw, scale)
        dtypes[name] = dtype
    return (out, dtypes) if with_dtypes else out


def save_float_checkpoint(path, tensors, metadata=None):
    """One plain F32 safetensors file (names as given, e.g. the model's state_dict); metadata: a
    dict of strings for the header's __metadata__ (the C++ side quantizes on import)."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to(torch.float32).contiguous().cpu()
        raw = t.numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((-len(h)) % 8)  # align the data to 8 bytes, as the reference writer does
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)
