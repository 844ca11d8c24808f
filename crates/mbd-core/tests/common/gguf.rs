//! A small GGUF writer for the tests: a model directory (config.json, tokenizer.json, a single f32/bf16
//! model.safetensors) as llama.cpp's converter lays it out (the layout scripts/write_gguf.py writes with llama.cpp's
//! `gguf` package), kept as a structure that tests edit, and serialized with the byte position of every count,
//! length, type tag and offset recorded (the fuzzer overwrites them).
#![allow(dead_code)]

use super::read_st;
use mbd_core::kernels::blocks::{QMatrix, QuantFormat};
use serde_json::Value;
use std::path::Path;

/// A metadata value (GGUF value types 0-12).
#[derive(Clone, Debug)]
pub enum Meta {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(u8),
    Str(Vec<u8>),
    /// Element type, elements (written as they are, whatever their own type: a hostile file may lie).
    Arr(u32, Vec<Meta>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Meta {
    pub fn type_id(&self) -> u32 {
        match self {
            Meta::U8(_) => 0,
            Meta::I8(_) => 1,
            Meta::U16(_) => 2,
            Meta::I16(_) => 3,
            Meta::U32(_) => 4,
            Meta::I32(_) => 5,
            Meta::F32(_) => 6,
            Meta::Bool(_) => 7,
            Meta::Str(_) => 8,
            Meta::Arr(..) => 9,
            Meta::U64(_) => 10,
            Meta::I64(_) => 11,
            Meta::F64(_) => 12,
        }
    }
    pub fn str(s: &str) -> Meta {
        Meta::Str(s.as_bytes().to_vec())
    }
    pub fn strs<S: AsRef<str>>(xs: &[S]) -> Meta {
        Meta::Arr(8, xs.iter().map(|s| Meta::str(s.as_ref())).collect())
    }
}

/// One tensor: its name, dimensions in GGUF order (innermost first), GGML type and bytes.
#[derive(Clone, Debug)]
pub struct GTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: u32,
    pub data: Vec<u8>,
}

#[derive(Clone, Debug)]
pub struct Gguf {
    pub version: u32,
    pub kv: Vec<(String, Meta)>,
    pub tensors: Vec<GTensor>,
    pub alignment: usize,
}

/// What a recorded field of the serialized file is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Field {
    /// A u64 count or length (tensor count, metadata count, a string's length, an array's length, a dimension).
    Count,
    /// A u32 type tag (a value type, an array's element type, a tensor's GGML type, a dimension count).
    Tag,
    /// A tensor's u64 data offset.
    Offset,
}

/// A serialized file and the position of each field in it.
pub struct Written {
    pub bytes: Vec<u8>,
    pub fields: Vec<(usize, Field)>,
    /// Where the tensor data section starts.
    pub data_start: usize,
}

impl Gguf {
    pub fn get(&self, key: &str) -> Option<&Meta> {
        self.kv.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
    pub fn get_mut(&mut self, key: &str) -> Option<&mut Meta> {
        self.kv.iter_mut().find(|(k, _)| k == key).map(|(_, v)| v)
    }
    pub fn set(&mut self, key: &str, v: Meta) {
        match self.get_mut(key) {
            Some(e) => *e = v,
            None => self.kv.push((key.to_string(), v)),
        }
    }

    pub fn write(&self) -> Written {
        let mut w = Written { bytes: Vec::new(), fields: Vec::new(), data_start: 0 };
        w.bytes.extend_from_slice(b"GGUF");
        w.u32(self.version, Field::Tag);
        w.u64(self.tensors.len() as u64, Field::Count);
        w.u64(self.kv.len() as u64, Field::Count);
        for (k, v) in &self.kv {
            w.string(k.as_bytes());
            w.u32(v.type_id(), Field::Tag);
            w.value(v);
        }
        let align = self.alignment.max(1);
        let mut off = 0usize;
        let mut offsets = Vec::new();
        for t in &self.tensors {
            offsets.push(off);
            off = (off + t.data.len()).div_ceil(align) * align;
        }
        for (t, &o) in self.tensors.iter().zip(&offsets) {
            w.string(t.name.as_bytes());
            w.u32(t.dims.len() as u32, Field::Tag);
            for &d in &t.dims {
                w.u64(d, Field::Count);
            }
            w.u32(t.ty, Field::Tag);
            w.u64(o as u64, Field::Offset);
        }
        w.bytes.resize(w.bytes.len().div_ceil(align) * align, 0);
        w.data_start = w.bytes.len();
        for (t, &o) in self.tensors.iter().zip(&offsets) {
            w.bytes.resize(w.data_start + o, 0);
            w.bytes.extend_from_slice(&t.data);
        }
        w
    }

    /// The GGUF file of a model directory: its config as llama.cpp's keys, its tokenizer.json's byte-level BPE as
    /// `tokenizer.ggml.*` (added tokens at their ids, control when special; a vocabulary that is not byte-level,
    /// such as mbd-tiny's characters, respelled in GPT-2's byte alphabet), the ChatML template, and its tensors
    /// under llama.cpp's names (MoE experts stacked), each matrix encoded by `encode(hf_name, rows, cols)`: 0 (f32),
    /// 1 (f16), 2 (q4_0), 6 (q5_0), 8 (q8_0; these three for rows of a multiple of 32 values), 12 (q4_k) or 14
    /// (q6_k; rows of a multiple of 256).
    pub fn from_dir(dir: &Path, encode: &dyn Fn(&str, usize, usize) -> u32) -> Gguf {
        let cfg: Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        let arch = match cfg["architectures"][0].as_str().unwrap() {
            "Qwen2ForCausalLM" => "qwen2",
            "Qwen3ForCausalLM" => "qwen3",
            "Qwen3MoeForCausalLM" => "qwen3moe",
            a => panic!("{a}"),
        };
        let u = |k: &str| cfg[k].as_u64().unwrap() as u32;
        let mut g = Gguf { version: 3, kv: vec![], tensors: vec![], alignment: 32 };
        g.set("general.architecture", Meta::str(arch));
        let a = |k: &str| format!("{arch}.{k}");
        g.set(&a("block_count"), Meta::U32(u("num_hidden_layers")));
        g.set(&a("context_length"), Meta::U32(u("max_position_embeddings")));
        g.set(&a("embedding_length"), Meta::U32(u("hidden_size")));
        g.set(&a("feed_forward_length"), Meta::U32(u("intermediate_size")));
        g.set(&a("attention.head_count"), Meta::U32(u("num_attention_heads")));
        g.set(&a("attention.head_count_kv"), Meta::U32(u("num_key_value_heads")));
        if cfg.get("head_dim").is_some_and(|v| v.is_u64()) {
            g.set(&a("attention.key_length"), Meta::U32(u("head_dim")));
            g.set(&a("attention.value_length"), Meta::U32(u("head_dim")));
        }
        g.set(&a("attention.layer_norm_rms_epsilon"), Meta::F32(cfg["rms_norm_eps"].as_f64().unwrap() as f32));
        let theta = cfg.get("rope_theta").or(cfg.pointer("/rope_parameters/rope_theta")).and_then(|v| v.as_f64());
        g.set(&a("rope.freq_base"), Meta::F32(theta.unwrap_or(10000.0) as f32));
        if arch == "qwen3moe" {
            let e = cfg.get("num_local_experts").or(cfg.get("num_experts")).unwrap().as_u64().unwrap();
            g.set(&a("expert_count"), Meta::U32(e as u32));
            g.set(&a("expert_used_count"), Meta::U32(u("num_experts_per_tok")));
            g.set(&a("expert_feed_forward_length"), Meta::U32(u("moe_intermediate_size")));
            g.set(&a("expert_weights_norm"), Meta::Bool(cfg["norm_topk_prob"].as_bool().unwrap() as u8));
        }
        let (h, data) = read_st(&dir.join("model.safetensors"));
        let vocab_rows = h["model.embed_tokens.weight"]["shape"][0].as_u64().unwrap() as usize;
        let (tokens, types, merges) = vocab(dir, vocab_rows);
        g.set("tokenizer.ggml.model", Meta::str("gpt2"));
        g.set("tokenizer.ggml.pre", Meta::str("default"));
        g.set("tokenizer.ggml.tokens", Meta::strs(&tokens));
        g.set("tokenizer.ggml.token_type", Meta::Arr(5, types.iter().map(|&t| Meta::I32(t)).collect()));
        g.set("tokenizer.ggml.merges", Meta::strs(&merges));
        let eos = match &cfg["eos_token_id"] {
            Value::Array(a) => a[0].as_u64().unwrap(),
            v => v.as_u64().unwrap_or(0),
        };
        g.set("tokenizer.ggml.eos_token_id", Meta::U32(eos as u32));
        g.set("tokenizer.chat_template", Meta::str(CHATML));
        // tensors, in the safetensors file's order of names (sorted), experts stacked per layer and projection
        let mut names: Vec<&String> = h.keys().filter(|k| *k != "__metadata__").collect();
        names.sort();
        let floats = |name: &str| -> (Vec<usize>, Vec<f32>) {
            let e = &h[name];
            let shape: Vec<usize> =
                e["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
            let (s, t) =
                (e["data_offsets"][0].as_u64().unwrap() as usize, e["data_offsets"][1].as_u64().unwrap() as usize);
            let raw = &data[s..t];
            let v = match e["dtype"].as_str().unwrap() {
                "F32" => raw.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect(),
                "BF16" => raw.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
                d => panic!("{d}"),
            };
            (shape, v)
        };
        let mut experts: std::collections::BTreeMap<(usize, String), Vec<Expert>> = Default::default();
        for name in names {
            let (shape, v) = floats(name);
            if let Some((layer, rest)) = name.split_once(".mlp.experts.") {
                let (e, proj) = rest.split_once('.').unwrap();
                let layer: usize = layer.rsplit('.').next().unwrap().parse().unwrap();
                experts.entry((layer, proj.to_string())).or_default().push((e.parse().unwrap(), shape, v));
                continue;
            }
            let gname = gguf_name(name);
            g.tensors.push(tensor(gname, name, &shape, &v, encode));
        }
        for ((layer, proj), mut per) in experts {
            per.sort_by_key(|p| p.0);
            let kind = match proj.as_str() {
                "gate_proj.weight" => "ffn_gate_exps",
                "up_proj.weight" => "ffn_up_exps",
                "down_proj.weight" => "ffn_down_exps",
                p => panic!("{p}"),
            };
            let (rows, cols) = (per[0].1[0], per[0].1[1]);
            let v: Vec<f32> = per.iter().flat_map(|p| p.2.iter().copied()).collect();
            let mut t = tensor(format!("blk.{layer}.{kind}.weight"), &proj, &[per.len() * rows, cols], &v, encode);
            t.dims = vec![cols as u64, rows as u64, per.len() as u64];
            g.tensors.push(t);
        }
        g
    }
}

/// One expert's matrix of a MoE layer: its number, shape and values.
type Expert = (usize, Vec<usize>, Vec<f32>);

/// A tensor's bytes in the type `encode` picks (matrices only; vectors stay f32).
fn tensor(gname: String, hf: &str, shape: &[usize], v: &[f32], encode: &dyn Fn(&str, usize, usize) -> u32) -> GTensor {
    let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
    let ty = if shape.len() == 2 { encode(hf, shape[0], shape[1]) } else { 0 };
    let data = match ty {
        1 => v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
        2 | 6 | 8 | 12 | 14 => {
            let f = match ty {
                2 => QuantFormat::Q4_0,
                6 => QuantFormat::Q5_0,
                8 => QuantFormat::Q8_0,
                12 => QuantFormat::Q4K,
                _ => QuantFormat::Q6K,
            };
            let t = candle_core::Tensor::from_vec(v.to_vec(), (shape[0], shape[1]), &candle_core::Device::Cpu).unwrap();
            QMatrix::quantize(&t, f).unwrap().bytes().to_vec()
        }
        _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    };
    GTensor { name: gname, dims, ty, data }
}

/// llama.cpp's name of a Hugging Face tensor.
pub fn gguf_name(hf: &str) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (layer, part) = rest.split_once('.').unwrap();
    let part = match part {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.o_proj.bias" => "attn_output.bias",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        "mlp.gate.weight" => "ffn_gate_inp.weight",
        p => panic!("{p}"),
    };
    format!("blk.{layer}.{part}")
}

/// The ChatML template scripts/write_gguf.py writes.
pub const CHATML: &str =
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}\
     {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// GPT-2's byte alphabet: the printable character each byte is spelled with in a byte-level vocabulary.
pub fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    if printable(b) {
        return b as char;
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap()
}

/// tokens, token types and merges of a directory's tokenizer.json as llama.cpp's converter lays them out (added
/// tokens at their ids, control when special; `[PAD<i>]` fillers up to the embedding's rows). A vocabulary whose
/// tokenizer is not byte-level is respelled in GPT-2's byte alphabet (the same tokenizer as a byte-level BPE).
pub fn vocab(dir: &Path, rows: usize) -> (Vec<String>, Vec<i32>, Vec<String>) {
    let tj: Value = serde_json::from_slice(&std::fs::read(dir.join("tokenizer.json")).unwrap()).unwrap();
    let byte_level = tj["pre_tokenizer"]["type"] == "ByteLevel" || tj["decoder"]["type"] == "ByteLevel";
    let respell = |t: &str| -> String {
        if byte_level {
            t.to_string()
        } else {
            t.bytes().map(byte_char).collect()
        }
    };
    let mut tokens: Vec<String> = (0..rows).map(|i| format!("[PAD{i}]")).collect();
    let mut types = vec![4i32; rows];
    for (t, i) in tj["model"]["vocab"].as_object().unwrap() {
        let i = i.as_u64().unwrap() as usize;
        tokens[i] = respell(t);
        types[i] = 1;
    }
    for a in tj["added_tokens"].as_array().unwrap() {
        let i = a["id"].as_u64().unwrap() as usize;
        tokens[i] = a["content"].as_str().unwrap().to_string();
        types[i] = if a["special"].as_bool().unwrap() { 3 } else { 4 };
    }
    let merges = tj["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            Value::String(s) => s.split(' ').map(respell).collect::<Vec<_>>().join(" "),
            Value::Array(p) => p.iter().map(|x| respell(x.as_str().unwrap())).collect::<Vec<_>>().join(" "),
            _ => panic!(),
        })
        .collect();
    (tokens, types, merges)
}

impl Written {
    fn u32(&mut self, x: u32, f: Field) {
        self.fields.push((self.bytes.len(), f));
        self.bytes.extend_from_slice(&x.to_le_bytes());
    }
    fn u64(&mut self, x: u64, f: Field) {
        self.fields.push((self.bytes.len(), f));
        self.bytes.extend_from_slice(&x.to_le_bytes());
    }
    fn string(&mut self, s: &[u8]) {
        self.u64(s.len() as u64, Field::Count);
        self.bytes.extend_from_slice(s);
    }
    fn value(&mut self, v: &Meta) {
        let b = &mut self.bytes;
        match v {
            Meta::U8(x) => b.push(*x),
            Meta::I8(x) => b.push(*x as u8),
            Meta::U16(x) => b.extend_from_slice(&x.to_le_bytes()),
            Meta::I16(x) => b.extend_from_slice(&x.to_le_bytes()),
            Meta::U32(x) => b.extend_from_slice(&x.to_le_bytes()),
            Meta::I32(x) => b.extend_from_slice(&x.to_le_bytes()),
            Meta::F32(x) => b.extend_from_slice(&x.to_le_bytes()),
            Meta::Bool(x) => b.push(*x),
            Meta::Str(s) => self.string(s),
            Meta::Arr(et, items) => {
                self.u32(*et, Field::Tag);
                self.u64(items.len() as u64, Field::Count);
                for x in items {
                    self.value(x);
                }
            }
            Meta::U64(x) => b.extend_from_slice(&x.to_le_bytes()),
            Meta::I64(x) => b.extend_from_slice(&x.to_le_bytes()),
            Meta::F64(x) => b.extend_from_slice(&x.to_le_bytes()),
        }
    }
}
