//! Fuzzing the GGUF reader on stable Rust: a seeded mutation loop over GGUF files written from real models (the
//! parity fixtures and the embedded mbd-tiny model, by `common::gguf`, in f32, f16 and block formats). Each input
//! applies 1-3 mutations to the file's structure (metadata keys, values, value types, array contents and element
//! types; the tokenizer's tokens, token types and merges; tensor names, dimensions, GGML types, data; the version and
//! alignment), then may overwrite recorded fields of the written bytes (counts, string and array lengths, type tags,
//! tensor offsets) or raw bytes, and loads the file with `Model::load`, encodes and decodes a string with its
//! tokenizer and renders its chat template. Every outcome must be `Ok` or a crate error other than `Internal`: no
//! panic (caught or not), no abort, no input slower than `fuzz::SLOW`.
//!
//! `MBD_FUZZ_ITERS` inputs (default 1000, under a minute in a debug build), `MBD_FUZZ_SEED` (default fixed). The
//! documented long run is in benches/results/reliability.md:
//! `MBD_FUZZ_ITERS=100000 cargo test --release -p mbd-core --test fuzz_gguf -- --nocapture`

mod common;
use common::fuzz::{mutate_bytes, Rng, Tally};
use common::gguf::{Field, Gguf, Meta, CHATML};
use common::*;

/// Keys worth adding or renaming to, under the seed's architecture (`{a}`) or as they are.
const KEYS: &[&str] = &[
    "general.architecture",
    "general.alignment",
    "general.name",
    "{a}.block_count",
    "{a}.context_length",
    "{a}.embedding_length",
    "{a}.feed_forward_length",
    "{a}.attention.head_count",
    "{a}.attention.head_count_kv",
    "{a}.attention.key_length",
    "{a}.attention.value_length",
    "{a}.attention.layer_norm_rms_epsilon",
    "{a}.rope.freq_base",
    "{a}.rope.scaling.type",
    "{a}.rope.scaling.factor",
    "{a}.expert_count",
    "{a}.expert_used_count",
    "{a}.expert_feed_forward_length",
    "{a}.expert_weights_norm",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.mask_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
    "tokenizer.chat_template.tool_use",
];

fn interesting_str(r: &mut Rng) -> Vec<u8> {
    let s: &str = match r.below(16) {
        0 => "",
        1 => "qwen2",
        2 => "qwen3",
        3 => "qwen3moe",
        4 => "dream",
        5 => "llama",
        6 => "gpt2",
        7 => "default",
        8 => "yarn",
        9 => "<|im_end|>",
        10 => "<|mask|>",
        11 => "{% for m in messages %}{{ m.content }}{% endfor %}",
        12 => "{{ raise_exception('no') }}",
        13 => return vec![0xff, 0xfe, b'a'],
        14 => return vec![b'x'; r.below(70_000)],
        _ => "a b",
    };
    s.as_bytes().to_vec()
}

fn interesting_meta(r: &mut Rng, depth: usize) -> Meta {
    match r.below(if depth > 0 { 22 } else { 26 }) {
        0 => Meta::U32(0),
        1 => Meta::U32(1),
        2 => Meta::U32(u32::MAX),
        3 => Meta::U32(r.below(400) as u32),
        4 => Meta::U64(u64::MAX),
        5 => Meta::U64(1 << 40),
        6 => Meta::I32(-1),
        7 => Meta::I64(i64::MIN),
        8 => Meta::F32(f32::NAN),
        9 => Meta::F32(f32::INFINITY),
        10 => Meta::F32(-0.0),
        11 => Meta::F32(1e-45),
        12 => Meta::F64(f64::NAN),
        13 => Meta::F64(1e300),
        14 => Meta::Bool(r.below(3) as u8),
        15 => Meta::U8(r.next() as u8),
        16 => Meta::I16(r.next() as i16),
        17 => Meta::U16(r.next() as u16),
        18 => Meta::I8(r.next() as i8),
        19 | 20 => Meta::Str(interesting_str(r)),
        21 => Meta::F32(r.below(100_000) as f32 * 0.5),
        // arrays: of one element type, sometimes lying about it, sometimes nested
        22 => Meta::Arr(4, (0..r.below(8)).map(|_| Meta::U32(r.below(100) as u32)).collect()),
        23 => Meta::Arr(8, (0..r.below(8)).map(|_| Meta::Str(interesting_str(r))).collect()),
        24 => Meta::Arr(9, (0..r.below(3)).map(|_| interesting_meta(r, 1)).collect()),
        _ => {
            let et = *r.pick(&[0u32, 5, 6, 7, 8, 12, 13, 99]);
            Meta::Arr(et, (0..r.below(5)).map(|_| interesting_meta(r, 1)).collect())
        }
    }
}

fn arch(g: &Gguf) -> String {
    match g.get("general.architecture") {
        Some(Meta::Str(s)) => String::from_utf8_lossy(s).into_owned(),
        _ => "qwen2".into(),
    }
}

/// One structural mutation of the file.
fn mutate_gguf(g: &mut Gguf, r: &mut Rng) {
    let key = |r: &mut Rng, g: &Gguf| r.pick(KEYS).replace("{a}", &arch(g));
    match r.below(20) {
        0 | 1 if !g.kv.is_empty() => {
            let i = r.below(g.kv.len());
            g.kv[i].1 = interesting_meta(r, 0);
        }
        2 if !g.kv.is_empty() => {
            let i = r.below(g.kv.len());
            g.kv.remove(i);
        }
        3 if !g.kv.is_empty() => {
            let i = r.below(g.kv.len());
            let e = g.kv[i].clone();
            g.kv.push(e);
        }
        4 => {
            let k = key(r, g);
            let v = interesting_meta(r, 0);
            g.set(&k, v);
        }
        5 if !g.kv.is_empty() => {
            let i = r.below(g.kv.len());
            g.kv[i].0 = key(r, g);
        }
        6 => {
            // the tokens: swap, duplicate, replace by a control token's text, remove one
            if let Some(Meta::Arr(_, t)) = g.get_mut("tokenizer.ggml.tokens") {
                if t.is_empty() {
                    return;
                }
                let (i, j) = (r.below(t.len()), r.below(t.len()));
                match r.below(4) {
                    0 => t.swap(i, j),
                    1 => t[i] = t[j].clone(),
                    2 => t[i] = Meta::Str(interesting_str(r)),
                    _ => {
                        t.remove(i);
                    }
                }
            }
        }
        7 => {
            if let Some(Meta::Arr(_, t)) = g.get_mut("tokenizer.ggml.token_type") {
                if !t.is_empty() {
                    let i = r.below(t.len());
                    t[i] = Meta::I32(r.below(9) as i32 - 1);
                }
            }
        }
        8 => {
            if let Some(Meta::Arr(_, m)) = g.get_mut("tokenizer.ggml.merges") {
                match r.below(3) {
                    0 if !m.is_empty() => {
                        let i = r.below(m.len());
                        m.remove(i);
                    }
                    1 => m.push(Meta::Str(interesting_str(r))),
                    _ if !m.is_empty() => {
                        let i = r.below(m.len());
                        m[i] = Meta::str("<|im_end|> a");
                    }
                    _ => {}
                }
            }
        }
        9 | 10 if !g.tensors.is_empty() => {
            let i = r.below(g.tensors.len());
            let d = &mut g.tensors[i].dims;
            if d.is_empty() {
                d.push(r.below(4) as u64);
            }
            let j = r.below(d.len());
            match r.below(7) {
                0 => d[j] = 0,
                1 => d[j] = d[j].wrapping_mul(2),
                2 => d[j] /= 2,
                3 => d[j] = *r.pick(&[u64::MAX, 1 << 32, 1 << 62, 31, 33]),
                4 => d.push(r.below(4) as u64),
                5 => {
                    d.pop();
                }
                _ => d.reverse(),
            }
        }
        11 if !g.tensors.is_empty() => {
            let i = r.below(g.tensors.len());
            g.tensors[i].ty = *r.pick(&[0u32, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 20, 30, 39, 1000]);
        }
        12 if !g.tensors.is_empty() => {
            let i = r.below(g.tensors.len());
            let j = r.below(g.tensors.len());
            g.tensors[i].name = match r.below(4) {
                0 => g.tensors[j].name.clone(),
                1 => "blk.999.attn_q.weight".into(),
                2 => "rope_freqs.weight".into(),
                _ => g.tensors[i].name.replace("blk.0.", "blk.1."),
            };
        }
        13 if !g.tensors.is_empty() => {
            let i = r.below(g.tensors.len());
            if r.chance(0.5) {
                g.tensors.remove(i);
            } else {
                let t = g.tensors[i].clone();
                g.tensors.push(t);
            }
        }
        14 if !g.tensors.is_empty() => {
            // non-finite values or scales, or a cut tensor
            let i = r.below(g.tensors.len());
            let d = &mut g.tensors[i].data;
            if d.len() >= 4 {
                let at = r.below(d.len() / 2) * 2;
                let pats: [&[u8]; 4] =
                    [&[0x00, 0x00, 0xc0, 0x7f], &[0x00, 0x00, 0x80, 0xff], &[0x00, 0x7c], &[0xff, 0x7f]];
                let p = pats[r.below(pats.len())];
                let k = p.len().min(d.len() - at);
                d[at..at + k].copy_from_slice(&p[..k]);
            }
            if r.chance(0.2) {
                let n = r.below(d.len() + 1);
                d.truncate(n);
            }
        }
        15 => g.version = *r.pick(&[1u32, 2, 3, 4, 3 << 24, u32::MAX]),
        16 => {
            let a = *r.pick(&[0u64, 1, 3, 16, 64, 1 << 20, 1 << 40]);
            g.set("general.alignment", Meta::U32(a as u32));
            if a.is_power_of_two() && a <= 4096 && r.chance(0.7) {
                g.alignment = a as usize;
            }
        }
        17 => {
            let k = *r.pick(&[
                "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.mask_token_id",
                "tokenizer.ggml.eot_token_id",
            ]);
            let v = *r.pick(&[0u32, 3, 319, 320, 99_999, u32::MAX]);
            g.set(k, Meta::U32(v));
            if r.chance(0.3) {
                g.set("tokenizer.ggml.add_bos_token", Meta::Bool(1));
            }
        }
        18 => {
            let frags = ["{{", "}}", "{% for m in messages %}", "{% endfor %}", "{{ raise_exception('no') }}", "\u{0}"];
            let mut t = CHATML.to_string();
            let at = (0..=t.len()).filter(|&i| t.is_char_boundary(i)).nth(r.below(t.len() + 1)).unwrap_or(0);
            t.insert_str(at, frags[r.below(frags.len())]);
            g.set("tokenizer.chat_template", Meta::str(&t));
        }
        _ => {
            let a = *r.pick(&["qwen2", "qwen3", "qwen3moe", "dream", "llama"]);
            let old = arch(g);
            g.set("general.architecture", Meta::str(a));
            if r.chance(0.5) {
                // move the architecture's keys along
                for (k, _) in g.kv.iter_mut() {
                    if let Some(rest) = k.strip_prefix(&format!("{old}.")) {
                        *k = format!("{a}.{rest}");
                    }
                }
            }
        }
    }
}

/// Overwrite one recorded field of the written file with a value a hostile file might hold.
fn mutate_field(b: &mut [u8], fields: &[(usize, Field)], r: &mut Rng) {
    let (at, f) = fields[r.below(fields.len())];
    let len = b.len() as u64;
    if at + 8 > b.len() {
        return; // the bytes were cut by an earlier mutation
    }
    match f {
        Field::Count | Field::Offset => {
            let old = u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
            let x = *r.pick(&[
                0,
                1,
                old.wrapping_add(1),
                old.wrapping_sub(1),
                old.wrapping_add(32),
                old.wrapping_mul(2),
                len,
                len - 8,
                u64::MAX,
                1 << 32,
                1 << 62,
                (1 << 24) + 1,
                (1 << 20) + 1,
            ]);
            b[at..at + 8].copy_from_slice(&x.to_le_bytes());
        }
        Field::Tag => {
            let x = *r.pick(&[0u32, 1, 4, 5, 6, 7, 8, 9, 10, 12, 13, 30, 99, u32::MAX]);
            b[at..at + 4].copy_from_slice(&x.to_le_bytes());
        }
    }
}

/// The seeds: GGUF files of the parity fixtures (f32; and f16 / q8_0 / q4_0 / q5_0 matrices) and of mbd-tiny (q8_0
/// and q4_k matrices: its f32 file is 18 MB), with how often each is picked; built once for the tests that use them.
fn seeds() -> &'static [(String, Gguf, usize)] {
    static SEEDS: std::sync::OnceLock<Vec<(String, Gguf, usize)>> = std::sync::OnceLock::new();
    SEEDS.get_or_init(build_seeds)
}

fn build_seeds() -> Vec<(String, Gguf, usize)> {
    let mut out = vec![];
    let fixtures =
        ["qwen2_gqa_tied", "qwen2_mha_untied", "qwen3_headdim_gqa", "qwen3_bias_tied", "qwen3moe_top1", "qwen3_bf16"];
    for (i, name) in fixtures.iter().enumerate() {
        out.push((format!("{name}.f32"), Gguf::from_dir(&parity(name), &|_, _, _| 0), 10));
        let mixed = move |hf: &str, _rows: usize, cols: usize| -> u32 {
            if !cols.is_multiple_of(32) {
                return 1;
            }
            match (i + hf.len()) % 4 {
                0 => 8,
                1 => 2,
                2 => 6,
                _ => 1,
            }
        };
        out.push((format!("{name}.mixed"), Gguf::from_dir(&parity(name), &mixed), 10));
    }
    let tiny_q = |hf: &str, _rows: usize, cols: usize| -> u32 {
        if cols.is_multiple_of(256) && hf.contains("mlp") {
            12
        } else {
            8
        }
    };
    out.push(("mbd-tiny.q".into(), Gguf::from_dir(&tiny(), &tiny_q), 2));
    out
}

#[test]
fn seeds_load_and_tokenize_like_their_directories() {
    let t = TmpDir::new("gguf-seeds");
    for (name, g, _) in seeds() {
        let p = t.path().join(format!("{name}.gguf"));
        std::fs::write(&p, g.write().bytes).unwrap();
        let m = load(&p).unwrap_or_else(|e| panic!("{name}: {e}"));
        let dir = if name.starts_with("mbd-tiny") { tiny() } else { parity(name.split('.').next().unwrap()) };
        let d = load(&dir).unwrap();
        for text in ["<|im_start|>user\nhi there<|im_end|>\n<|mask|>", "12 + 30 = ?"] {
            assert_eq!(m.tokenize(text, false).unwrap(), d.tokenize(text, false).unwrap(), "{name}: {text:?}");
        }
    }
}

#[test]
fn fuzz_gguf_files() {
    let iters: usize = std::env::var("MBD_FUZZ_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(1000);
    let seed: u64 = std::env::var("MBD_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5EED_6606);
    let t = TmpDir::new("fuzz-gguf");
    let seeds = seeds();
    let total: usize = seeds.iter().map(|s| s.2).sum();
    let path = t.path().join("m.gguf");
    let mut tally = Tally::new();
    let mut r = Rng(seed);
    for it in 0..iters {
        let mut x = r.below(total);
        let (name, orig, _) = seeds
            .iter()
            .find(|s| {
                let hit = x < s.2;
                x = x.saturating_sub(s.2);
                hit
            })
            .unwrap();
        let mut g = orig.clone();
        let n = if r.chance(0.8) { 1 + r.below(3) } else { 0 };
        for _ in 0..n {
            mutate_gguf(&mut g, &mut r);
        }
        let w = g.write();
        let mut b = w.bytes;
        if n == 0 || r.chance(0.3) {
            for _ in 0..1 + r.below(2) {
                if r.chance(0.6) {
                    mutate_field(&mut b, &w.fields, &mut r);
                } else if r.chance(0.7) && w.data_start <= b.len() {
                    // raw bytes of the header
                    let mut head = b[..w.data_start].to_vec();
                    mutate_bytes(&mut head, &mut r);
                    head.extend_from_slice(&b[w.data_start..]);
                    b = head;
                } else {
                    mutate_bytes(&mut b, &mut r);
                }
            }
        }
        std::fs::write(&path, &b).unwrap();
        let keep = || {
            let keep = std::env::temp_dir().join(format!("mbd-fuzz-gguf-crash-{it}-{name}.gguf"));
            let _ = std::fs::write(&keep, &b);
            keep
        };
        tally.run(&path, &format!("input {it} (from {name})"), keep);
    }
    tally.finish(iters, seed);
}
