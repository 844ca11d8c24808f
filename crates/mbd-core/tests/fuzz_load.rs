//! Fuzzing the model-directory readers on stable Rust: a seeded mutation loop over real model directories
//! (the parity fixtures, a sharded copy of one, and the embedded mbd-tiny model). Each input mutates one file
//! (config.json, generation_config.json, a safetensors header or its bytes, the shard index, tokenizer.json,
//! tokenizer_config.json's chat template) by bytes or by JSON values, then loads the directory with
//! `Model::load`, encodes a string with its tokenizer and renders its chat template. Every outcome must be `Ok`
//! or a crate error other than `Internal`: no panic (caught or not), no abort.
//!
//! `MBD_FUZZ_ITERS` inputs (default 2000, a few seconds to a minute in a debug build), `MBD_FUZZ_SEED` (default
//! fixed). The documented long run is in benches/results/reliability.md:
//! `MBD_FUZZ_ITERS=100000 cargo test --release -p mbd-core --test fuzz_load -- --nocapture`

mod common;
use common::fuzz::{mutate_bytes, Rng, Tally};
use common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

fn interesting_value(r: &mut Rng) -> Value {
    match r.below(30) {
        0 => json!(0),
        1 => json!(-1),
        2 => json!(1),
        3 => json!(2),
        4 => json!(1u64 << 31),
        5 => json!(1u64 << 32),
        6 => json!((1u64 << 32) + 1),
        7 => json!((1u64 << 53) + 1),
        8 => json!(1u64 << 63),
        9 => json!(u64::MAX),
        10 => json!(1_000_000_000),
        11 => json!(1e300),
        12 => json!(-1e300),
        13 => json!(0.5),
        14 => json!(1e-50),
        15 => json!(""),
        16 => json!("default"),
        17 => json!("yarn"),
        18 => json!("../x.safetensors"),
        19 => json!("/etc/passwd"),
        20 => json!(*r.pick(&["F32", "BF16", "F16", "F64", "I8", "U8", "BOOL", "F8_E4M3", "F4", "Q4"])),
        21 => Value::Null,
        22 => json!(true),
        23 => json!([]),
        24 => json!({}),
        25 => json!([1, 2]),
        26 => json!({"rope_type": "default"}),
        27 => json!({"factor": 2.0}),
        28 => json!("x".repeat(r.below(5000))),
        _ => json!(r.next() as i64 >> r.below(64)),
    }
}

/// Keys worth adding to config.json with a random value.
const CONFIG_KEYS: &[&str] = &[
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "mask_token_id",
    "eos_token_id",
    "block_size",
    "bd_size",
    "tie_word_embeddings",
    "attention_bias",
    "use_sliding_window",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "norm_topk_prob",
    "architectures",
    "model_type",
    "mbd_family",
    "logits_shift",
    "torch_dtype",
];

/// Visit a random node of a JSON tree and replace it, delete a child, or duplicate one.
fn mutate_json(v: &mut Value, r: &mut Rng, top_keys: &[&str]) {
    if let (Value::Object(m), true) = (&mut *v, r.chance(0.25) && !top_keys.is_empty()) {
        m.insert(r.pick(top_keys).to_string(), interesting_value(r));
        return;
    }
    mutate_node(v, r);
}

fn mutate_node(node: &mut Value, r: &mut Rng) {
    let descend = r.chance(0.7);
    match node {
        Value::Object(m) if !m.is_empty() && descend => {
            let k = m.keys().nth(r.below(m.len())).unwrap().clone();
            if r.chance(0.15) {
                m.remove(&k);
            } else {
                mutate_node(m.get_mut(&k).unwrap(), r);
            }
            return;
        }
        Value::Array(a) if !a.is_empty() && descend => {
            let i = r.below(a.len());
            match r.below(8) {
                0 => {
                    a.remove(i);
                }
                1 => {
                    let x = a[i].clone();
                    a.push(x);
                }
                _ => mutate_node(&mut a[i], r),
            }
            return;
        }
        _ => {}
    }
    *node = match (&*node, r.below(4)) {
        // Nudge numbers, keep their kind half the time.
        (Value::Number(n), 0) => json!(n.as_i64().unwrap_or(1).wrapping_add(r.below(5) as i64 - 2)),
        (Value::Number(n), 1) => json!(n.as_i64().unwrap_or(1).wrapping_mul(1 << r.below(40))),
        (Value::String(s), 0) => {
            let mut s = s.clone();
            let frags = [
                "{{",
                "}}",
                "{%",
                "%}",
                "{% for m in messages %}",
                "{% endfor %}",
                "{{ raise_exception('no') }}",
                "((((((((((((((((((((",
                "<|im_end|>",
                "\u{0}",
                "\u{FFFF}",
                "\\",
                "\"",
                "{# x",
            ];
            let at = (0..=s.len()).filter(|&i| s.is_char_boundary(i)).nth(r.below(s.len() + 1)).unwrap_or(0);
            s.insert_str(at, frags[r.below(frags.len())]);
            json!(s)
        }
        _ => interesting_value(r),
    };
}

/// A safetensors file: mutate its header as JSON (offsets, shapes, dtypes, names), its length prefix, or its
/// data (NaN/inf patterns), or its raw bytes.
fn mutate_safetensors(b: &mut Vec<u8>, r: &mut Rng) {
    let parsed = (b.len() >= 8)
        .then(|| u64::from_le_bytes(b[..8].try_into().unwrap()) as usize)
        .filter(|&n| n.checked_add(8).is_some_and(|e| e <= b.len()))
        .and_then(|n| serde_json::from_slice::<Value>(&b[8..8 + n]).ok().map(|h| (n, h)));
    let Some((n, mut h)) = parsed else { return mutate_bytes(b, r) };
    match r.below(5) {
        0 | 1 => {
            mutate_json(&mut h, r, &[]);
            let mut out = st_head(&h);
            out.extend_from_slice(&b[8 + n..]);
            *b = out;
        }
        2 if b.len() > 8 + n + 4 => {
            // A non-finite float at an aligned spot of the data section.
            let data = b.len() - 8 - n;
            let at = 8 + n + (r.below(data / 2) * 2);
            let pats: [&[u8]; 4] = [&[0x00, 0x00, 0xc0, 0x7f], &[0x00, 0x00, 0x80, 0xff], &[0xc0, 0x7f], &[0x00, 0x7c]];
            let pat = pats[r.below(pats.len())];
            let k = pat.len().min(b.len() - at);
            b[at..at + k].copy_from_slice(&pat[..k]);
        }
        3 => {
            let x: u64 =
                *r.pick(&[0, 2, (n as u64) + 1, (n as u64).wrapping_sub(1), 100_000_001, u64::MAX, b.len() as u64]);
            b[..8].copy_from_slice(&x.to_le_bytes());
        }
        _ => mutate_bytes(b, r),
    }
}

fn st_head(h: &Value) -> Vec<u8> {
    let hb = serde_json::to_vec(h).unwrap();
    let mut out = (hb.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&hb);
    out
}

/// One seed directory: a working copy whose files are mutated in turn and restored.
struct Seed {
    dir: PathBuf,
    files: Vec<(String, Vec<u8>)>,
}

fn seeds(root: &Path) -> Vec<Seed> {
    let mut srcs: Vec<(String, PathBuf)> = std::fs::read_dir(repo_root().join("tests/fixtures/parity"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .map(|p| (p.file_name().unwrap().to_string_lossy().to_string(), p))
        .collect();
    srcs.sort();
    srcs.push(("mbd-tiny".into(), tiny()));
    let mut out = Vec::new();
    for (name, src) in &srcs {
        let dir = root.join(name);
        copy_files(src, &dir);
        out.push(dir);
    }
    // A sharded copy (index + two shards) of the MoE fixture.
    let sharded = root.join("sharded");
    copy_files(&parity("qwen3moe_top1"), &sharded);
    shard_into_two(&sharded);
    out.push(sharded);
    // A directory with a chat_template.jinja.
    let jinja = root.join("jinja");
    copy_files(&tiny(), &jinja);
    if let Some(t) = read_json(&jinja.join("tokenizer_config.json")).get("chat_template").and_then(|t| t.as_str()) {
        std::fs::write(jinja.join("chat_template.jinja"), t).unwrap();
    }
    out.push(jinja);
    out.into_iter()
        .map(|dir| {
            let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_none_or(|x| x != "npz"))
                .map(|p| (p.file_name().unwrap().to_string_lossy().to_string(), std::fs::read(&p).unwrap()))
                .collect();
            files.sort();
            Seed { dir, files }
        })
        .collect()
}

fn copy_files(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() && !e.file_name().to_string_lossy().ends_with(".npz") {
            std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        }
    }
}

/// Which file of a seed to mutate: weighted towards the readers under test.
fn pick_file(seed: &Seed, r: &mut Rng) -> usize {
    let weight = |name: &str| match name {
        "config.json" => 30,
        n if n.ends_with(".safetensors") => 25,
        "model.safetensors.index.json" => 15,
        "tokenizer.json" => 12,
        "tokenizer_config.json" | "chat_template.jinja" => 10,
        "generation_config.json" => 5,
        _ => 1,
    };
    let total: usize = seed.files.iter().map(|(n, _)| weight(n)).sum();
    let mut x = r.below(total);
    for (i, (n, _)) in seed.files.iter().enumerate() {
        let w = weight(n);
        if x < w {
            return i;
        }
        x -= w;
    }
    0
}

#[test]
fn fuzz_model_dirs() {
    let iters: usize = std::env::var("MBD_FUZZ_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(2000);
    let seed: u64 = std::env::var("MBD_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5EED_0011);
    let t = TmpDir::new("fuzz");
    let seeds = seeds(t.path());
    let mut tally = Tally::new();
    let mut r = Rng(seed);
    for it in 0..iters {
        let s = &seeds[r.below(seeds.len())];
        let fi = pick_file(s, &mut r);
        let (name, orig) = &s.files[fi];
        let mut b = orig.clone();
        for _ in 0..1 + r.below(3) {
            if name.ends_with(".safetensors") {
                mutate_safetensors(&mut b, &mut r);
            } else if name.ends_with(".json") && r.chance(0.7) {
                match serde_json::from_slice::<Value>(&b) {
                    Ok(mut v) => {
                        let keys: &[&str] = if name == "config.json" { CONFIG_KEYS } else { &[] };
                        mutate_json(&mut v, &mut r, keys);
                        b = serde_json::to_vec_pretty(&v).unwrap();
                    }
                    Err(_) => mutate_bytes(&mut b, &mut r),
                }
            } else {
                mutate_bytes(&mut b, &mut r);
            }
        }
        let path = s.dir.join(name);
        std::fs::write(&path, &b).unwrap();
        let keep = || {
            let keep = s.dir.parent().unwrap().parent().unwrap().join(format!("mbd-fuzz-crash-{it}-{name}"));
            let _ = std::fs::write(&keep, &b);
            keep
        };
        tally.run(&s.dir, &format!("input {it}: {name} of {}", s.dir.display()), keep);
        std::fs::write(&path, orig).unwrap();
    }
    tally.finish(iters, seed);
}
