//! Batching never changes outputs. (1) A forward over several sequences' segments gives each segment the
//! logits it gets alone, bit for bit: dense, bf16-stored and mixture-of-experts checkpoints, few-row windows
//! (skinny kernel) stacked with long ones (gemm), grid and custom masks, explicit positions. (2) Streams run
//! through the scheduler, many at once with different prompts, lengths, block sizes, cache policies and
//! sampling, give the tokens, texts and forward counts they give alone; a stream cancelled mid-way ends
//! "cancelled" with a prefix of its lone output and does not disturb the others.

#![allow(clippy::single_range_in_vec_init)] // masks are lists of key ranges, some of one range

use mbd_core::generate::generation::{FinishReason, Generation, StepOutput};
use mbd_core::generate::scheduler::Scheduler;
use mbd_core::kernels::Kernels;
use mbd_core::net::mask::MaskSpec;
use mbd_core::net::segment::Segment;
use mbd_core::params::load::BatchLimits;
use mbd_core::params::request::{GenRequest, ProfileOverrides};
use mbd_core::{Alignment, AttentionKind, BlockGrid, LoadOptions, Model};
use std::path::PathBuf;
use std::sync::Arc;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/parity").join(name)
}

fn load(name: &str, max_rows: usize) -> Arc<Model> {
    load_with(name, Kernels { max_rows, ..Kernels::default() })
}

fn load_with(name: &str, kernels: Kernels) -> Arc<Model> {
    let overrides = ProfileOverrides {
        mask_token_id: Some(3),
        block_size: Some(4),
        attention: Some(AttentionKind::BlockCausal),
        alignment: Some(Alignment::Absolute),
        logits_shift: Some(false),
        eos_token_ids: Some(vec![]),
    };
    Arc::new(Model::load(&fixture(name), &LoadOptions { overrides, kernels, ..Default::default() }).expect("load"))
}

fn ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (seed * 31 + i * 17 + 5) % 200 + 4).collect()
}

/// A sequence's state for one forward: a cache filled with `prefix` tokens, a window, its mask and rows.
#[derive(Clone)]
struct Case {
    prefix: usize,
    window: usize,
    mask: Option<MaskSpec>,
    rows: Vec<usize>,
    positions: Option<Vec<usize>>,
}

fn forward_cases(model: &Model, cases: &[Case], together: bool) -> Vec<Vec<f32>> {
    let grid = BlockGrid::new(AttentionKind::BlockCausal, 4, Alignment::Absolute, 0).unwrap();
    let mut caches: Vec<_> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut cache = model.new_cache().unwrap();
            if c.prefix > 0 {
                model.fill_cache(&mut cache, &ids(c.prefix, i as u32), &grid).unwrap();
            }
            cache
        })
        .collect();
    let windows: Vec<Vec<u32>> = cases.iter().enumerate().map(|(i, c)| ids(c.window, 100 + i as u32)).collect();
    let segs: Vec<Segment> = caches
        .iter_mut()
        .zip(cases)
        .zip(&windows)
        .map(|((cache, c), w)| Segment {
            positions: c.positions.clone().unwrap_or_else(|| (c.prefix..c.prefix + c.window).collect()),
            cache,
            ids: w,
            mask: c.mask.clone().unwrap_or(MaskSpec::Grid(grid)),
            rows: c.rows.clone(),
            cancel: None,
        })
        .collect();
    let out = if together {
        let mut segs = segs;
        model.forward_segments(&mut segs).unwrap()
    } else {
        segs.into_iter().map(|s| model.forward_segments(&mut [s]).unwrap().pop().unwrap()).collect()
    };
    out.into_iter().map(|t| t.rows.flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect()
}

#[test]
fn a_segment_gets_the_same_logits_alone_and_batched() {
    // a verification-style window: 3 drafts at 9..12, then the same positions again, each seeing the first
    // half strictly causally and itself only
    let custom: Vec<Vec<std::ops::Range<usize>>> =
        (0..6).map(|i| if i < 3 { vec![0..9 + i + 1] } else { vec![0..9 + (i - 3), 9 + i..9 + i + 1] }).collect();
    let cases = vec![
        Case { prefix: 8, window: 4, mask: None, rows: vec![0, 1, 2, 3], positions: None },
        Case { prefix: 0, window: 1, mask: None, rows: vec![0], positions: None },
        Case { prefix: 20, window: 7, mask: None, rows: vec![6, 2], positions: None },
        Case { prefix: 4, window: 40, mask: None, rows: (0..40).collect(), positions: None },
        Case { prefix: 12, window: 9, mask: None, rows: vec![], positions: None },
        Case {
            prefix: 9,
            window: 6,
            mask: Some(MaskSpec::Custom(custom)),
            rows: vec![0, 3, 5],
            positions: Some(vec![9, 10, 11, 9, 10, 11]),
        },
        Case { prefix: 33, window: 2, mask: None, rows: vec![1], positions: None },
    ];
    let mut checked = 0;
    // dense f32, bf16 weights kept bf16, mixture of experts; default kernels and a low few-row cut (so that
    // the longer windows go to gemm, each alone, next to stacked few-row ones); matrices packed at load (the
    // default on AVX2 CPUs) and row-major; the blocked attention kernel (the default on AVX2 CPUs) and candle's ops
    let combos =
        [(64, true, true), (5, true, true), (64, true, false), (5, true, false), (64, false, false), (5, false, false)];
    for name in ["qwen3_headdim_gqa", "qwen3_bf16", "qwen3moe_top2_norm", "qwen2_gqa_tied"] {
        for (max_rows, blocked_attention, packed_weights) in combos {
            let kernels = Kernels { max_rows, blocked_attention, packed_weights, ..Kernels::default() };
            let model = load_with(name, kernels);
            let alone = forward_cases(&model, &cases, false);
            let together = forward_cases(&model, &cases, true);
            for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
                assert_eq!(a.len(), cases[i].rows.len() * model.config.vocab_size, "{name} case {i}");
                assert!(
                    a == b,
                    "{name} {max_rows} {blocked_attention} {packed_weights}: case {i} changed when batched"
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 4 * combos.len() * cases.len());
}

#[test]
fn packed_weights_compute_every_window_alike_and_as_row_major_ones_do() {
    if !mbd_core::kernels::panels::PackedMatrix::available() {
        return;
    }
    let cases = vec![
        Case { prefix: 8, window: 4, mask: None, rows: vec![0, 1, 2, 3], positions: None },
        Case { prefix: 0, window: 1, mask: None, rows: vec![0], positions: None },
        Case { prefix: 4, window: 40, mask: None, rows: (0..40).collect(), positions: None },
        Case { prefix: 12, window: 9, mask: None, rows: vec![], positions: None },
    ];
    // dense f32, bf16 kept bf16, a tied head (the embedding lookups read the packed table)
    for name in ["qwen3_headdim_gqa", "qwen3_bf16", "qwen2_gqa_tied"] {
        let packed = forward_cases(&load_with(name, Kernels::default()), &cases, true);
        // with every matrix packed, the few-row cut changes no bit: a window of any length is the same product
        let cut = forward_cases(&load_with(name, Kernels { max_rows: 2, ..Kernels::default() }), &cases, true);
        assert!(packed == cut, "{name}: packed logits depend on the few-row cut");
        let plain =
            forward_cases(&load_with(name, Kernels { packed_weights: false, ..Kernels::default() }), &cases, true);
        for (i, (a, b)) in packed.iter().zip(&plain).enumerate() {
            let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
            let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(a.len() == b.len() && err <= 1e-5 * scale, "{name} case {i}: max error {err} (scale {scale})");
        }
    }
}

#[test]
fn a_custom_mask_equal_to_the_grid_gives_the_grid_logits() {
    // the custom form is the grid's rule written out: same keys, same logits
    let model = load("qwen3_headdim_gqa", 64);
    let (p, w) = (6usize, 6usize);
    let rows: Vec<Vec<std::ops::Range<usize>>> = (0..w)
        .map(|i| vec![0..((p + i) / 4 + 1) * 4].into_iter().map(|r| r.start..r.end.min(p + w)).collect())
        .collect();
    let grid = Case { prefix: p, window: w, mask: None, rows: (0..w).collect(), positions: None };
    let custom = Case { mask: Some(MaskSpec::Custom(rows)), ..grid.clone() };
    let a = forward_cases(&model, &[grid], false);
    let b = forward_cases(&model, &[custom], false);
    assert_eq!(a, b);
}

/// Everything a stream emits, concatenated: (token ids, text, finish reason, forward passes). (How it is cut
/// into outputs may differ: a stream's handle joins outputs that piled up unread.)
type Run = (Vec<u32>, String, Option<FinishReason>, usize);

fn collect(outs: impl IntoIterator<Item = StepOutput>) -> Run {
    let mut r: Run = (vec![], String::new(), None, 0);
    for o in outs {
        r.0.extend(o.token_ids);
        r.1.push_str(&o.text);
        if o.finish_reason.is_some() {
            r.2 = o.finish_reason;
            r.3 = o.usage.map(|u| u.forward_passes).unwrap_or(0);
        }
    }
    r
}

fn alone(model: &Arc<Model>, prompt: &[u32], req: &GenRequest) -> Run {
    let mut g = Generation::new(model.clone(), prompt.to_vec(), req).unwrap();
    collect(std::iter::from_fn(|| g.step().unwrap()))
}

fn requests() -> Vec<(Vec<u32>, GenRequest)> {
    let mut out = vec![];
    for i in 0..12u32 {
        let req = GenRequest {
            max_tokens: Some([13, 5, 24, 9][i as usize % 4]),
            block_size: Some([4, 2, 8][i as usize % 3]),
            threshold: Some([0.9, 0.5, 0.99, 0.7][i as usize % 4]),
            use_cache: Some(i % 5 != 3),
            temperature: if i % 4 == 1 { Some(0.8) } else { None },
            seed: Some(i as u64),
            early_stop: Some(false),
            ..Default::default()
        };
        out.push((ids(3 + (i as usize * 7) % 30, i), req));
    }
    out
}

#[test]
fn streams_batched_by_the_scheduler_equal_streams_run_alone() {
    for max_rows in [64, 5] {
        let model = load("qwen3_headdim_gqa", max_rows);
        let reqs = requests();
        let expected: Vec<Run> = reqs.iter().map(|(p, r)| alone(&model, p, r)).collect();
        // 8 batched at once, the rest waiting for a place; a small row cap splits some ticks
        let sched = Scheduler::new(model.clone(), BatchLimits { max_seqs: 8, max_rows: 24 }).unwrap();
        let handles: Vec<_> = reqs
            .iter()
            .map(|(p, r)| sched.submit(Generation::new(model.clone(), p.clone(), r).unwrap()).unwrap())
            .collect();
        let got: Vec<Run> = std::thread::scope(|s| {
            let threads: Vec<_> = handles
                .into_iter()
                .map(|mut h| s.spawn(move || collect(std::iter::from_fn(|| h.next().map(|r| r.unwrap())))))
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g, e, "max_rows={max_rows}: stream {i} differs when batched");
            assert!(e.2.is_some() && !e.0.is_empty());
        }
    }
}

#[test]
fn a_cancelled_stream_ends_cancelled_and_the_others_are_unchanged() {
    let model = load("qwen3_headdim_gqa", 64);
    let reqs = requests();
    let expected: Vec<Run> = reqs.iter().map(|(p, r)| alone(&model, p, r)).collect();
    let sched = Scheduler::new(model.clone(), BatchLimits::default()).unwrap();
    let mut handles: Vec<_> = reqs
        .iter()
        .map(|(p, r)| sched.submit(Generation::new(model.clone(), p.clone(), r).unwrap()).unwrap())
        .collect();
    // stream 2: read one output, then cancel; stream 5: dropped unread (its generation is freed)
    let first = handles[2].next().unwrap().unwrap();
    handles[2].cancel();
    drop(handles.remove(5));
    let mut outs = vec![first];
    let mut cancelled = None;
    for o in handles[2].by_ref() {
        let o = o.unwrap();
        if o.finish_reason.is_some() {
            cancelled = o.finish_reason;
        }
        outs.push(o);
    }
    assert_eq!(cancelled, Some(FinishReason::Cancelled));
    let c = collect(outs);
    assert!(expected[2].0.starts_with(&c.0), "a cancelled stream's tokens are a prefix of its lone run");
    for (k, mut h) in handles.into_iter().enumerate() {
        let i = if k >= 5 { k + 1 } else { k };
        if i == 2 {
            continue;
        }
        let got = collect(std::iter::from_fn(|| h.next().map(|r| r.unwrap())));
        assert_eq!(got, expected[i], "stream {i}");
    }
}
