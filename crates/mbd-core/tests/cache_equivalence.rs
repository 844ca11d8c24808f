//! The exact KV cache changes nothing: on a small random Qwen3 checkpoint (tests/fixtures/parity), greedy
//! generation with the cache gives the same tokens and forward counts as recomputing every step, for causal,
//! block-causal (absolute and prompt-aligned) grids, shifted and unshifted logits, several thresholds and
//! both forced-progress rules. (pytest checks the same against an independent reference decoder; this keeps
//! the invariant visible to `cargo test`.)

use mbd_core::decode::decoder::{Acceptance, ForcedProgress};
use mbd_core::generate::generation::Generation;
use mbd_core::kernels::Kernels;
use mbd_core::params::request::{GenRequest, LogitsRequest, ProfileOverrides};
use mbd_core::util::Cancel;
use mbd_core::{Alignment, AttentionKind, Error, LoadOptions, Model};
use std::path::PathBuf;
use std::sync::Arc;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/parity/qwen3_headdim_gqa")
}

fn load(attention: AttentionKind, alignment: Alignment, shift: bool, block: usize) -> Arc<Model> {
    let overrides = ProfileOverrides {
        mask_token_id: Some(3),
        block_size: Some(block),
        attention: Some(attention),
        alignment: Some(alignment),
        logits_shift: Some(shift),
        eos_token_ids: Some(vec![]),
    };
    Arc::new(Model::load(&fixture(), &LoadOptions { overrides, ..Default::default() }).expect("load fixture"))
}

/// (tokens of the whole completion, forward passes)
fn run(model: &Arc<Model>, prompt: &[u32], req: &GenRequest) -> (Vec<u32>, usize) {
    let mut g = Generation::new(model.clone(), prompt.to_vec(), req).expect("start");
    let mut tokens = vec![];
    loop {
        let o = g.step().expect("step").expect("output before the end");
        tokens.extend(o.token_ids);
        if let Some(u) = o.usage {
            return (tokens, u.forward_passes);
        }
    }
}

#[test]
fn cache_gives_the_same_tokens_and_forwards() {
    let grids = [
        (AttentionKind::Causal, Alignment::Absolute, 1),
        (AttentionKind::BlockCausal, Alignment::Absolute, 4),
        (AttentionKind::BlockCausal, Alignment::Prompt, 3),
    ];
    let mut cases = 0;
    for (attention, alignment, block) in grids {
        for shift in [false, true] {
            let model = load(attention, alignment, shift, block);
            for (prompt_len, threshold, forced) in [
                (5usize, 0.0, ForcedProgress::First),
                (9, 0.01, ForcedProgress::Every),
                (7, 2.0, ForcedProgress::First),
            ] {
                let prompt: Vec<u32> = (0..prompt_len as u32).map(|i| 10 + 7 * i).collect();
                let base = GenRequest {
                    max_tokens: Some(13),
                    acceptance: Some(Acceptance::Confidence),
                    threshold: Some(threshold),
                    forced_progress: Some(forced),
                    block_add_threshold: Some(0.5),
                    early_stop: Some(false),
                    ..Default::default()
                };
                let cached = run(&model, &prompt, &GenRequest { use_cache: Some(true), ..base.clone() });
                let recomputed = run(&model, &prompt, &GenRequest { use_cache: Some(false), ..base });
                assert_eq!(
                    cached, recomputed,
                    "{attention:?} {alignment:?} shift={shift} lp={prompt_len} tau={threshold}"
                );
                assert_eq!(cached.0.len(), 13);
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 18);
}

fn overrides_for(attention: AttentionKind) -> ProfileOverrides {
    ProfileOverrides { attention: Some(attention), block_size: Some(4), ..Default::default() }
}

#[test]
fn attention_in_query_chunks_equals_one_piece() {
    let ids: Vec<u32> = (0..40u32).map(|i| (i * 37 + 11) % 320).collect();
    for attention in [AttentionKind::Causal, AttentionKind::BlockCausal, AttentionKind::Full] {
        let overrides = ProfileOverrides { attention: Some(attention), block_size: Some(4), ..Default::default() };
        // candle's attention path both times
        let candle = Kernels { blocked_attention: false, ..Default::default() };
        let whole = Model::load(
            &fixture(),
            &LoadOptions { overrides: overrides.clone(), kernels: candle, ..Default::default() },
        )
        .unwrap();
        // a budget of one score row: every query row is its own chunk
        let opts = LoadOptions { overrides, kernels: candle, attention_score_bytes: 1, ..Default::default() };
        let chunked = Model::load(&fixture(), &opts).unwrap();
        let prefixes: &[usize] = if attention == AttentionKind::Full { &[0] } else { &[0, 8] };
        for &prefix_len in prefixes {
            let req = LogitsRequest { prefix_len: Some(prefix_len), ..Default::default() };
            let (a, b) = (
                whole.logits(&ids, &req, &Cancel::default()).unwrap(),
                chunked.logits(&ids, &req, &Cancel::default()).unwrap(),
            );
            let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
            let err = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(err <= 1e-5 * scale, "{attention:?} prefix {prefix_len}: max error {err} (scale {scale})");
            // and the blocked attention kernel (the default on AVX2 CPUs) agrees with candle's ops
            let blocked =
                Model::load(&fixture(), &LoadOptions { overrides: overrides_for(attention), ..Default::default() })
                    .unwrap();
            let c = blocked.logits(&ids, &req, &Cancel::default()).unwrap();
            let err = a.iter().zip(&c).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(err <= 1e-5 * scale, "{attention:?} prefix {prefix_len}: blocked attention, max error {err}");
        }
    }
}

#[test]
fn context_check_does_not_wrap() {
    let model = load(AttentionKind::BlockCausal, Alignment::Absolute, false, 4);
    let req = GenRequest { max_tokens: Some(usize::MAX), ..Default::default() };
    match Generation::new(model, vec![5, 6, 7], &req) {
        Err(Error::ContextLength(m)) => assert!(m.contains("maximum context is 256 tokens"), "{m}"),
        Err(e) => panic!("expected a context-length error, got {e}"),
        Ok(_) => panic!("expected a context-length error, got a generation"),
    }
}

#[test]
fn requests_built_in_rust_are_range_checked() {
    let model = load(AttentionKind::BlockCausal, Alignment::Absolute, false, 4);
    let req = GenRequest { decoded_token_threshold: Some(1.5), ..Default::default() };
    let e = Generation::new(model.clone(), vec![5, 6, 7], &req).err().expect("refused").to_string();
    assert_eq!(e, "decoded_token_threshold must be in [0, 1], got 1.5");
    let e = Generation::new(model, vec![5, 999], &GenRequest::default()).err().expect("refused").to_string();
    assert!(e.starts_with("prompt: token id 999 at index 1 is out of range"), "{e}");
}
