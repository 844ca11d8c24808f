//! Hostile or careless model directories (the loading side of the hostile-input work): each must give a clear error of
//! the right kind that names the file and the field / tensor and value; never a panic, an abort or a silent load.

mod common;
use common::*;
use serde_json::{json, Map, Value};
use std::path::Path;

const BASE: &str = "qwen3_bias_tied"; // Qwen3, 2 layers, hidden 64, 4 heads / 2 kv heads, head_dim 16, vocab 320

fn with_config(edit: impl FnOnce(&mut Map<String, Value>)) -> (TmpDir, std::path::PathBuf) {
    let (t, d) = model_copy(&parity(BASE));
    edit_json(&d.join("config.json"), edit);
    (t, d)
}

fn expect(dir: &Path, kind_want: &str, needles: &[&str]) -> String {
    let (k, msg) = load_err(dir);
    assert_eq!(k, kind_want, "wrong error kind: {msg}");
    for n in needles {
        assert!(msg.contains(n), "message lacks {n:?}: {msg}");
    }
    msg
}

fn config_err(edit: impl FnOnce(&mut Map<String, Value>), needles: &[&str]) -> String {
    let (_t, d) = with_config(edit);
    expect(&d, "Config", needles)
}

#[test]
fn base_fixture_loads() {
    let (_t, d) = model_copy(&parity(BASE));
    load(&d).unwrap();
}

// ---- config.json ----

#[test]
fn zero_layers_refused() {
    config_err(
        |c| {
            c.insert("num_hidden_layers".into(), json!(0));
        },
        &["config.json", "num_hidden_layers", "found 0"],
    );
}

#[test]
fn absurd_layer_count_refused_before_allocating() {
    config_err(
        |c| {
            c.insert("num_hidden_layers".into(), json!(1_000_000_000u64));
        },
        &["num_hidden_layers is 1000000000", "stores 2 layers", "model.safetensors"],
    );
    // usize::MAX layers: would be a capacity overflow.
    config_err(
        |c| {
            c.insert("num_hidden_layers".into(), json!(u64::MAX));
        },
        &["num_hidden_layers is 18446744073709551615"],
    );
}

#[test]
fn fewer_layers_than_stored_refused() {
    config_err(
        |c| {
            c.insert("num_hidden_layers".into(), json!(1));
        },
        &["num_hidden_layers is 1", "stores 2 layers", "unused"],
    );
}

#[test]
fn absurd_sizes_checked_against_the_checkpoint() {
    config_err(
        |c| {
            c.insert("vocab_size".into(), json!(1u64 << 40));
        },
        &["vocab_size", "1099511627776", "model.embed_tokens.weight"],
    );
    config_err(
        |c| {
            c.insert("hidden_size".into(), json!(1u64 << 40));
        },
        &["hidden_size", "1099511627776"],
    );
    config_err(
        |c| {
            c.insert("intermediate_size".into(), json!(1u64 << 60));
        },
        &["intermediate_size (1152921504606846976)", "overflows"],
    );
    config_err(
        |c| {
            c.insert("vocab_size".into(), json!(0));
        },
        &["'vocab_size' must be at least 1"],
    );
    config_err(
        |c| {
            c.insert("num_attention_heads".into(), json!(1u64 << 62));
            c.insert("num_key_value_heads".into(), json!(1u64 << 62));
        },
        &["overflows"],
    );
}

#[test]
fn head_dim_mismatch_names_fields_and_tensor() {
    config_err(
        |c| {
            c.insert("head_dim".into(), json!(8));
        },
        &["num_attention_heads x head_dim", "q_proj", "[32, 64]", "[64, 64]"],
    );
    config_err(
        |c| {
            c.insert("num_key_value_heads".into(), json!(4));
        },
        &["num_key_value_heads x head_dim", "k_proj"],
    );
}

#[test]
fn heads_not_multiple_of_kv_heads_refused() {
    config_err(
        |c| {
            c.insert("num_key_value_heads".into(), json!(3));
        },
        &["num_attention_heads (4)", "num_key_value_heads (3)"],
    );
}

#[test]
fn rms_norm_eps_must_be_positive_and_finite() {
    for bad in [json!(0.0), json!(-1e-6), json!(1e-50), json!(1e300)] {
        config_err(
            |c| {
                c.insert("rms_norm_eps".into(), bad.clone());
            },
            &["config.json", "'rms_norm_eps'", "positive"],
        );
    }
}

#[test]
fn rope_theta_must_be_positive_and_finite() {
    config_err(
        |c| {
            c.insert("rope_theta".into(), json!(0.0));
        },
        &["'rope_theta'", "found 0"],
    );
    config_err(
        |c| {
            c.insert("rope_theta".into(), json!(-10000.0));
        },
        &["'rope_theta'", "found -10000"],
    );
    config_err(
        |c| {
            c.insert("rope_parameters".into(), json!({"rope_type": "default", "rope_theta": -1.0}));
        },
        &["rope_parameters", "'rope_theta'", "found -1"],
    );
    config_err(
        |c| {
            c.insert("rope_parameters".into(), json!({"rope_type": "default", "rope_theta": "big"}));
        },
        &["rope_parameters", "'rope_theta' must be a number"],
    );
}

#[test]
fn rope_scaling_without_type_or_not_an_object_refused() {
    config_err(
        |c| {
            c.insert("rope_scaling".into(), json!("yarn"));
        },
        &["'rope_scaling' must be an object", "a string"],
    );
    config_err(
        |c| {
            c.insert("rope_scaling".into(), json!({"factor": 4.0}));
        },
        &["'rope_scaling'", "no 'rope_type'", "transformers"],
    );
    config_err(
        |c| {
            c.insert("rope_scaling".into(), json!({"rope_type": 3}));
        },
        &["'rope_type' must be a string"],
    );
    // Plain RoPE spelled several ways still loads.
    for ok in [json!({"rope_type": "default"}), json!({"type": "default", "factor": 1.0}), json!({}), Value::Null] {
        let (_t, d) = with_config(|c| {
            c.insert("rope_scaling".into(), ok.clone());
        });
        load(&d).unwrap_or_else(|e| panic!("{ok}: {e}"));
    }
}

#[test]
fn rope_scaling_we_do_not_implement_is_refused_saying_what_transformers_does() {
    let (_t, d) = with_config(|c| {
        c.insert("rope_scaling".into(), json!({"type": "linear", "factor": 2.0}));
    });
    expect(&d, "Unsupported", &["rope_scaling", "linear", "transformers applies", "different logits"]);
}

#[test]
fn max_position_embeddings_bounded() {
    config_err(
        |c| {
            c.insert("max_position_embeddings".into(), json!(0));
        },
        &["'max_position_embeddings'", "found 0"],
    );
    config_err(
        |c| {
            c.insert("max_position_embeddings".into(), json!(1u64 << 50));
        },
        &["'max_position_embeddings'", "1125899906842624"],
    );
}

#[test]
fn token_ids_beyond_32_bits_are_refused_not_truncated() {
    // 2^32 + 3 truncates to 3, a valid id: it must not load as 3.
    config_err(
        |c| {
            c.insert("mask_token_id".into(), json!((1u64 << 32) + 3));
        },
        &["'mask_token_id'", "4294967299", "32 bits"],
    );
    config_err(
        |c| {
            c.insert("eos_token_id".into(), json!([0, (1u64 << 32)]));
        },
        &["config.json", "'eos_token_id'", "4294967296"],
    );
    let (_t, d) = model_copy(&parity(BASE));
    edit_json(&d.join("generation_config.json"), |g| {
        g.insert("eos_token_id".into(), json!(1u64 << 40));
    });
    expect(&d, "Config", &["generation_config.json", "'eos_token_id'", "1099511627776"]);
}

#[test]
fn zero_or_oversized_block_size_refused() {
    config_err(
        |c| {
            c.insert("block_size".into(), json!(0));
        },
        &["'block_size'", "found 0"],
    );
    config_err(
        |c| {
            c.insert("block_size".into(), json!(1u64 << 40));
        },
        &["block_size 1099511627776", "max_position_embeddings 256"],
    );
}

// ---- shard index ----

#[test]
fn sharded_checkpoint_loads() {
    let (_t, d) = model_copy(&parity(BASE));
    shard_into_two(&d);
    load(&d).unwrap();
}

#[test]
fn empty_weight_map_is_a_config_error() {
    let (_t, d) = model_copy(&parity(BASE));
    shard_into_two(&d);
    write_json(&d.join("model.safetensors.index.json"), &json!({"weight_map": {}}));
    expect(&d, "Config", &["model.safetensors.index.json", "'weight_map' is empty"]);
}

#[test]
fn shard_names_outside_the_model_dir_refused() {
    let (t, d) = model_copy(&parity(BASE));
    let mut wm = shard_into_two(&d);
    // A real safetensors file outside the model directory: it must not be read.
    let outside = t.path().join("outside.safetensors");
    std::fs::rename(d.join("model-00002-of-00002.safetensors"), &outside).unwrap();
    let point_at = |wm: &mut Map<String, Value>, bad: &str| {
        for v in wm.values_mut() {
            if v.as_str().unwrap().starts_with("model-00002") || !v.as_str().unwrap().starts_with("model-") {
                *v = json!(bad);
            }
        }
    };
    for bad in [outside.display().to_string(), "../outside.safetensors".into(), "sub/../../outside.safetensors".into()]
    {
        point_at(&mut wm, &bad);
        write_json(&d.join("model.safetensors.index.json"), &json!({"weight_map": wm}));
        expect(&d, "ModelLoad", &["model.safetensors.index.json", &bad, "inside the model directory"]);
    }
    // A symlink inside the directory that resolves outside it.
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(&outside, d.join("link.safetensors")).unwrap();
        point_at(&mut wm, "link.safetensors");
        write_json(&d.join("model.safetensors.index.json"), &json!({"weight_map": wm}));
        expect(&d, "ModelLoad", &["link.safetensors", "outside the model directory"]);
    }
}

#[cfg(unix)]
#[test]
fn symlinks_inside_the_dir_and_hf_cache_snapshots_still_load() {
    // A Hugging Face cache: <repo>/snapshots/<rev>/file -> ../../blobs/<hash>.
    let t = TmpDir::new("hfcache");
    let repo = t.path().join("models--org--tiny");
    let snap = repo.join("snapshots/abc123");
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    for e in std::fs::read_dir(parity(BASE)).unwrap() {
        let e = e.unwrap();
        let blob = repo.join("blobs").join(format!("blob-{}", e.file_name().to_string_lossy()));
        std::fs::copy(e.path(), &blob).unwrap();
        std::os::unix::fs::symlink(Path::new("../../blobs").join(blob.file_name().unwrap()), snap.join(e.file_name()))
            .unwrap();
    }
    load(&snap).unwrap();
}

#[test]
fn tensor_stored_in_two_shards_refused() {
    let (_t, d) = model_copy(&parity(BASE));
    shard_into_two(&d);
    // Add layer 0's norm to shard 2 as well.
    let p2 = d.join("model-00002-of-00002.safetensors");
    let (mut h, mut data) = read_st(&p2);
    let n = data.len();
    h.insert(
        "model.layers.0.input_layernorm.weight".into(),
        json!({"dtype": "F32", "shape": [64], "data_offsets": [n, n + 256]}),
    );
    data.extend_from_slice(&[0u8; 256]);
    write_st(&p2, &h, &data);
    expect(&d, "ModelLoad", &["model.layers.0.input_layernorm.weight", "stored twice"]);
}

// ---- safetensors bytes ----

fn with_weights(edit: impl FnOnce(&mut Map<String, Value>, &mut Vec<u8>)) -> (TmpDir, std::path::PathBuf) {
    let (t, d) = model_copy(&parity(BASE));
    let p = d.join("model.safetensors");
    let (mut h, mut data) = read_st(&p);
    edit(&mut h, &mut data);
    write_st(&p, &h, &data);
    (t, d)
}

#[test]
fn text_file_is_not_a_safetensors_file_and_is_not_echoed() {
    let (_t, d) = model_copy(&parity(BASE));
    std::fs::write(
        d.join("model.safetensors"),
        "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin\n".repeat(40),
    )
    .unwrap();
    let msg = expect(&d, "ModelLoad", &["model.safetensors", "not a safetensors file"]);
    assert!(!msg.contains("root") && !msg.contains("daemon") && !msg.contains("bash"), "echoes the file: {msg}");
    // A plausible length followed by text that is JSON but not an object: serde would quote it.
    let mut b = 26u64.to_le_bytes().to_vec();
    b.extend_from_slice(b"\"root:x:0:0:secret-string\"");
    std::fs::write(d.join("model.safetensors"), b).unwrap();
    let msg = expect(&d, "ModelLoad", &["not a safetensors file", "not a JSON object"]);
    assert!(!msg.contains("secret"), "echoes the file: {msg}");
}

#[test]
fn header_claiming_a_terabyte_tensor_refused() {
    let (_t, d) = with_weights(|h, _| {
        h.insert("big".into(), json!({"dtype": "F32", "shape": [1u64 << 38], "data_offsets": [0, 1u64 << 40]}));
    });
    expect(&d, "ModelLoad", &["tensor 'big'", "claims more bytes"]);
}

#[test]
fn shape_whose_element_count_overflows_refused() {
    // numel wraps to 0 in unchecked arithmetic, which would match the byte range 0..0.
    let (_t, d) = with_weights(|h, _| {
        h.insert("wrap".into(), json!({"dtype": "F32", "shape": [1u64 << 62, 4], "data_offsets": [0, 0]}));
    });
    expect(&d, "ModelLoad", &["tensor 'wrap'", "claims more bytes"]);
    // numel fits but numel x bits wraps.
    let (_t, d) = with_weights(|h, _| {
        h.insert("wrap".into(), json!({"dtype": "F32", "shape": [1u64 << 59], "data_offsets": [0, 0]}));
    });
    expect(&d, "ModelLoad", &["tensor 'wrap'", "claims more bytes"]);
}

#[test]
fn overlapping_and_duplicated_byte_ranges_refused() {
    let (_t, d) = with_weights(|h, _| {
        let r = h["model.norm.weight"]["data_offsets"].clone();
        h.insert("alias".into(), json!({"dtype": "F32", "shape": [64], "data_offsets": r}));
    });
    expect(&d, "ModelLoad", &["overlap", "model.norm.weight", "alias"]);
    let (_t, d) = with_weights(|h, _| {
        let s = h["model.norm.weight"]["data_offsets"][0].as_u64().unwrap();
        h.insert("straddle".into(), json!({"dtype": "F32", "shape": [64], "data_offsets": [s - 128, s + 128]}));
    });
    expect(&d, "ModelLoad", &["overlap", "straddle"]);
}

#[test]
fn unsupported_dtype_named() {
    let (_t, d) = with_weights(|h, _| {
        h["model.norm.weight"]["dtype"] = json!("I32");
    });
    expect(&d, "ModelLoad", &["tensor 'model.norm.weight'", "I32", "supported weight dtypes"]);
    let (_t, d) = with_weights(|h, _| {
        h["model.norm.weight"]["dtype"] = json!("Q4_K");
    });
    expect(&d, "ModelLoad", &["header entry 'model.norm.weight'"]);
}

fn poke_f32(h: &Map<String, Value>, data: &mut [u8], name: &str, i: usize, x: f32) {
    let s = h[name]["data_offsets"][0].as_u64().unwrap() as usize + 4 * i;
    data[s..s + 4].copy_from_slice(&x.to_le_bytes());
}

#[test]
fn non_finite_weights_refused_at_load() {
    let (_t, d) = with_weights(|h, data| poke_f32(h, data, "model.layers.1.mlp.up_proj.weight", 77, f32::NAN));
    expect(&d, "ModelLoad", &["model.layers.1.mlp.up_proj.weight", "non-finite", "NaN", "flat index 77"]);
    let (_t, d) = with_weights(|h, data| poke_f32(h, data, "model.norm.weight", 3, f32::NEG_INFINITY));
    expect(&d, "ModelLoad", &["model.norm.weight", "-inf", "flat index 3"]);
}

#[test]
fn non_finite_bf16_weight_refused() {
    let (_t, d) = model_copy(&parity("qwen3_bf16"));
    let p = d.join("model.safetensors");
    let (h, mut data) = read_st(&p);
    let s = h["model.embed_tokens.weight"]["data_offsets"][0].as_u64().unwrap() as usize + 2 * 5;
    data[s..s + 2].copy_from_slice(&half::bf16::NAN.to_le_bytes());
    write_st(&p, &h, &data);
    expect(&d, "ModelLoad", &["model.embed_tokens.weight", "non-finite", "flat index 5"]);
}

#[test]
fn allocation_failure_is_an_error_not_an_abort() {
    // 2^60 f32 elements: no allocator can satisfy it; Vec::with_capacity would abort the process.
    let e = mbd_core::util::try_zeroed(1usize << 60, 0f32, &|| "tensor 'x'".to_string()).unwrap_err();
    assert_eq!(kind(&e), "ModelLoad");
    assert!(e.to_string().contains("tensor 'x': cannot allocate 4611686018427387904 bytes"), "{e}");
}

// ---- tokenizer.json ----

#[test]
fn tokenizer_padding_and_truncation_from_the_file_are_ignored() {
    // A fixed padding length of 2^40 would size the first encoding (an abort); truncation would cut prompts.
    let (_t, d) = model_copy(&parity(BASE));
    edit_json(&d.join("tokenizer.json"), |t| {
        t.insert(
            "padding".into(),
            json!({"strategy": {"Fixed": 1u64 << 40}, "direction": "Right", "pad_to_multiple_of": null,
            "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"}),
        );
        t.insert(
            "truncation".into(),
            json!({"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0}),
        );
    });
    let m = load(&d).unwrap();
    let plain = load(&parity(BASE)).unwrap();
    let text = "hello there, how are you";
    let a = m.tokenizer.encode(text, false).unwrap();
    let b = plain.tokenizer.encode(text, false).unwrap();
    assert_eq!(a.get_ids(), b.get_ids());
    assert!(a.get_ids().len() > 2);
}

#[test]
fn tokenizer_library_panics_become_load_errors() {
    // tokenizers 0.22 slices every BPE merge by the prefix length: a prefix longer than a merge panics.
    let (_t, d) = model_copy(&parity(BASE));
    edit_json(&d.join("tokenizer.json"), |t| {
        t.get_mut("model").unwrap()["continuing_subword_prefix"] = json!("####");
    });
    expect(&d, "ModelLoad", &["tokenizer.json", "not a valid tokenizer", "tokenizers library failed"]);
    // A syntax error inside "decoder" hits an expect() in tokenizers: caught as malformed JSON first.
    let text = std::fs::read_to_string(parity(BASE).join("tokenizer.json")).unwrap();
    let at = text.find("\"decoder\"").unwrap();
    let broken = format!("{}\"decoder\": {{\"type\": \"ByteLevel\", tru}}, {}", &text[..at], &text[at..]);
    std::fs::write(d.join("tokenizer.json"), broken).unwrap();
    expect(&d, "ModelLoad", &["tokenizer.json", "malformed JSON"]);
    // Not JSON at all: said so, without quoting it.
    std::fs::write(d.join("tokenizer.json"), "root:x:0:0:root:/root:/bin/bash\n").unwrap();
    let msg = expect(&d, "ModelLoad", &["tokenizer.json", "malformed JSON"]);
    assert!(!msg.contains("root"), "{msg}");
}

// ---- GGUF files (the second hostile-input round): written by `common::gguf` from the fixture, then broken ----

fn gguf_of(edit: impl FnOnce(&mut common::gguf::Gguf)) -> (TmpDir, std::path::PathBuf) {
    let mut g = common::gguf::Gguf::from_dir(&parity(BASE), &|_, _, _| 0);
    edit(&mut g);
    let t = TmpDir::new("gguf");
    let p = t.path().join("m.gguf");
    std::fs::write(&p, g.write().bytes).unwrap();
    (t, p)
}

#[test]
fn gguf_control_tokens_and_mask_have_their_own_ids() {
    let (_t, p) = gguf_of(|_| {});
    let (g, d) = (load(&p).unwrap(), load(&parity(BASE)).unwrap());
    for (i, t) in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"].iter().enumerate() {
        assert_eq!(g.tokenize(t, false).unwrap(), [i as u32], "{t}");
        assert_eq!(g.detokenize(&[i as i64], false).unwrap(), *t);
    }
    assert_eq!(g.profile.mask_token_id, Some(3));
    let text = "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(g.tokenize(text, false).unwrap(), d.tokenize(text, false).unwrap());
}

#[test]
fn gguf_non_finite_floats_name_the_key() {
    use common::gguf::Meta;
    for (key, v, shown) in [
        ("qwen3.rope.freq_base", Meta::F32(f32::NAN), "NaN"),
        ("qwen3.attention.layer_norm_rms_epsilon", Meta::F32(f32::INFINITY), "inf"),
        ("qwen3.rope.freq_base", Meta::F64(f64::NEG_INFINITY), "-inf"),
    ] {
        let (_t, p) = gguf_of(|g| g.set(key, v));
        expect(&p, "Config", &[&format!("metadata '{key}' is {shown}; expected a finite number")]);
    }
    // a NaN under a key the loader does not read is skipped unread
    let (_t, p) = gguf_of(|g| g.set("general.quality", Meta::F32(f32::NAN)));
    load(&p).unwrap();
}

#[test]
fn gguf_eos_outside_the_vocabulary_is_refused() {
    let (_t, p) = gguf_of(|g| g.set("tokenizer.ggml.eos_token_id", common::gguf::Meta::U32(320)));
    expect(&p, "Config", &["GGUF metadata as config.json", "'eos_token_id'", "token id 320", "vocabulary of 320"]);
}

#[test]
fn gguf_lists_under_keys_of_one_value_are_refused_by_name() {
    use common::gguf::Meta;
    let (_t, p) = gguf_of(|g| g.set("tokenizer.ggml.eos_token_id", Meta::Arr(4, vec![Meta::U32(0), Meta::U32(1)])));
    expect(&p, "Config", &["metadata 'tokenizer.ggml.eos_token_id' is a list of 2 values; one value is expected"]);
    let (_t, p) = gguf_of(|g| g.set("qwen3.attention.head_count_kv", Meta::Arr(4, vec![Meta::U32(2); 2])));
    expect(&p, "Unsupported", &["metadata 'qwen3.attention.head_count_kv' is a per-layer list"]);
}

#[test]
fn gguf_strings_and_metadata_are_capped() {
    use common::gguf::Meta;
    // a chat template over 4 MiB
    let (_t, p) = gguf_of(|g| g.set("tokenizer.chat_template", Meta::Str(vec![b' '; (4 << 20) + 1])));
    expect(&p, "ModelLoad", &["metadata 'tokenizer.chat_template': a string of 4194305 bytes; at most 4194304"]);
    // any other string the loader reads over 64 KiB, and a key over 64 KiB
    let (_t, p) = gguf_of(|g| g.set("tokenizer.ggml.pre", Meta::Str(vec![b'x'; 70_000])));
    expect(&p, "ModelLoad", &["metadata 'tokenizer.ggml.pre': a string of 70000 bytes; at most 65536"]);
    let (_t, p) = gguf_of(|g| g.set(&"k".repeat(70_000), Meta::U8(1)));
    expect(&p, "ModelLoad", &["a metadata key: a string of 70000 bytes; at most 65536"]);
    // strings the loader does not read are skipped, whatever their size
    let (_t, p) = gguf_of(|g| g.set("general.license", Meta::Str(vec![b'x'; 5 << 20])));
    load(&p).unwrap();
    // the metadata it builds: 9M token types are 288 MB of values
    let (_t, p) = gguf_of(|g| g.set("tokenizer.ggml.token_type", Meta::Arr(0, vec![Meta::U8(1); 9 << 20])));
    expect(&p, "ModelLoad", &["metadata 'tokenizer.ggml.token_type'", "would take more than 256 MiB of memory"]);
}

#[test]
fn gguf_tensor_sizes_that_overflow_are_errors() {
    // 2^63 f32 values: the byte count of a row overflowed before the other dimensions were multiplied (a panic)
    let (_t, p) = gguf_of(|g| {
        let t = g.tensors.iter_mut().find(|t| t.name == "output_norm.weight").unwrap();
        t.dims = vec![1 << 63];
    });
    expect(&p, "ModelLoad", &["tensor 'output_norm.weight'", "claims more bytes than the file holds"]);
}

#[test]
fn long_added_tokens_are_refused_quickly() {
    // The tokenizers library builds its added-token matcher in time that grows with the square of a token's length
    // for some texts (found by fuzz_gguf: a 47 KB control token held a load for a minute).
    let (_t, d) = model_copy(&parity(BASE));
    edit_json(&d.join("tokenizer.json"), |t| {
        t.get_mut("added_tokens")
            .unwrap()
            .as_array_mut()
            .unwrap()
            .push(json!({"id": 319, "content": "x".repeat(20_000),
            "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}));
    });
    let t0 = std::time::Instant::now();
    expect(&d, "ModelLoad", &["tokenizer.json", "added token 4 (id 319) is 20000 bytes long; at most 256"]);
    assert!(t0.elapsed().as_secs_f64() < 2.0, "{:?}", t0.elapsed());
    let (_t, p) = gguf_of(|g| {
        if let Some(common::gguf::Meta::Arr(_, toks)) = g.get_mut("tokenizer.ggml.tokens") {
            toks[3] = common::gguf::Meta::Str(vec![b'x'; 47_000]);
        }
    });
    expect(&p, "ModelLoad", &["GGUF tokenizer", "added token 3 (id 3) is 47000 bytes long"]);
}

// ---- the third hostile-input round: the loader's own fields, strict shapes, clear messages ----

fn config_err_in(fixture: &str, edit: impl FnOnce(&mut Map<String, Value>), needles: &[&str]) -> String {
    let (_t, d) = model_copy(&parity(fixture));
    edit_json(&d.join("config.json"), edit);
    expect(&d, "Config", needles)
}

#[test]
fn a_config_may_not_switch_on_the_gguf_loaders_own_fields() {
    for key in ["gguf_norms_include_one", "gguf_tiled_value_heads"] {
        for fixture in [BASE, "qwen35_hybrid"] {
            config_err_in(
                fixture,
                |c| {
                    c.insert(key.into(), json!(true));
                },
                &["config.json", &format!("field '{key}' is mbd-rs's own"), "may not name it"],
            );
        }
    }
    // a GGUF file's metadata sets them for itself: such files load (gguf_control_tokens_and_mask_have_their_own_ids)
}

#[test]
fn architectures_must_be_a_list_of_names() {
    for bad in [json!(5), json!("Qwen3ForCausalLM"), json!([5])] {
        config_err(
            |c| {
                c.insert("architectures".into(), bad);
            },
            &["field 'architectures' must be a list of class names (strings)"],
        );
    }
}

#[test]
fn rope_types_must_be_strings_that_agree() {
    config_err(
        |c| {
            c.insert("rope_scaling".into(), json!({"rope_type": "default", "type": 5}));
        },
        &["field 'rope_scaling': 'type' must be a string, found a number (5)"],
    );
    config_err(
        |c| {
            c.insert("rope_scaling".into(), json!({"rope_type": "default", "type": "linear", "factor": 2.0}));
        },
        &["'rope_type' ('default') and 'type' ('linear') disagree"],
    );
}

#[test]
fn qwen35_mrope_interleaved_must_be_a_boolean() {
    config_err_in(
        "qwen35_hybrid",
        |c| {
            c["rope_parameters"].as_object_mut().unwrap().insert("mrope_interleaved".into(), json!("yes"));
        },
        &["mrope_interleaved", "true or false"],
    );
    config_err_in(
        "qwen35_hybrid",
        |c| {
            c.insert("mrope_interleaved".into(), json!(1));
        },
        &["mrope_interleaved", "true or false"],
    );
}

#[test]
fn a_layer_holding_the_other_mixers_tensor_is_refused() {
    // qwen35_hybrid: layers 0-2 are Gated DeltaNet, layer 3 attention; a softmax layer's q_proj copied into layer 0
    let (_t, d) = model_copy(&parity("qwen35_hybrid"));
    let p = d.join("model.safetensors");
    let (mut h, mut data) = read_st(&p);
    let mut q = h["model.layers.3.self_attn.q_proj.weight"].clone();
    let off = q["data_offsets"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect::<Vec<_>>();
    let start = data.len();
    data.extend_from_within(off[0]..off[1]);
    q["data_offsets"] = json!([start, data.len()]);
    h.insert("model.layers.0.self_attn.q_proj.weight".into(), q);
    write_st(&p, &h, &data);
    expect(&d, "Config", &["layer 0 is 'linear_attention'", "stores a 'full_attention' layer's tensor there"]);
}

#[test]
fn moe_without_an_expert_count_names_both_spellings() {
    config_err_in(
        "qwen3moe_top1",
        |c| {
            c.remove("num_experts");
            c.remove("num_local_experts");
        },
        &["field 'num_experts' (or 'num_local_experts'"],
    );
}

#[test]
fn gguf_version_zero_is_called_what_it_is() {
    let (_t, p) = gguf_of(|_| {});
    let mut b = std::fs::read(&p).unwrap();
    b[4..8].copy_from_slice(&0u32.to_le_bytes());
    std::fs::write(&p, b).unwrap();
    let msg = expect(&p, "ModelLoad", &["GGUF version 0 is not a version llama.cpp ever wrote"]);
    assert!(!msg.contains("big-endian"), "{msg}");
}

#[test]
fn gguf_zero_dimension_names_the_dimension() {
    let (_t, p) = gguf_of(|g| {
        let t = g.tensors.iter_mut().find(|t| t.name == "blk.0.attn_q.weight").unwrap();
        t.dims = vec![t.dims[0], 0];
    });
    let msg = expect(&p, "ModelLoad", &["tensor 'blk.0.attn_q.weight'", "dimension 1 is 0"]);
    assert!(!msg.contains("its rows"), "{msg}");
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn a_fifo_is_not_a_model_and_not_missing() {
    let t = TmpDir::new("fifo");
    let p = t.path().join("m.gguf");
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let msg = expect(&p, "ModelLoad", &["not a regular file or a directory"]);
    assert!(!msg.contains("no such"), "{msg}");
}
