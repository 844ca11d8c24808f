//! The pieces the stable-Rust fuzz harnesses share (`fuzz_load.rs`: model directories, `fuzz_gguf.rs`: GGUF
//! files): a seeded RNG, raw byte mutations, one load-and-use of a model (`run_one`), and the tally of outcomes that
//! fails the run on any panic (caught or not), `Internal` error, or input slower than `SLOW`.
#![allow(dead_code)]

use super::{kind, load};
use mbd_core::error::catch_panic;
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// An input whose load and use takes longer than this counts as a hang (the models are a few hundred KB; a
/// release build loads them in milliseconds, a debug build in well under a second).
pub const SLOW: Duration = Duration::from_secs(20);

/// SplitMix64: small, seeded, reproducible.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// A raw mutation: a bit flip, a special byte, a deletion, a duplicated run, a truncation, a planted u64, or
/// random bytes appended.
pub fn mutate_bytes(b: &mut Vec<u8>, r: &mut Rng) {
    let n = b.len();
    match r.below(7) {
        0 if n > 0 => {
            let i = r.below(n);
            b[i] ^= 1 << r.below(8);
        }
        1 if n > 0 => {
            let i = r.below(n);
            b[i] = *r.pick(&[0u8, 0xff, 0x7f, 0x80, b'"', b'{', b'}', b'[', b']', b',', b':', b'-', b'9', b'e', b'.']);
        }
        2 if n > 0 => {
            let i = r.below(n);
            let k = r.below(64.min(n - i) + 1);
            b.drain(i..i + k);
        }
        3 if n > 0 => {
            let i = r.below(n);
            let k = r.below(64.min(n - i) + 1);
            let chunk = b[i..i + k].to_vec();
            let at = r.below(n + 1);
            b.splice(at..at, chunk);
        }
        4 => b.truncate(r.below(n + 1)),
        5 if n >= 8 => {
            let i = r.below(n - 7);
            let x: u64 =
                *r.pick(&[0, 1, 7, 8, u64::MAX, 1 << 32, 1 << 63, 100_000_001, n as u64, (n as u64).wrapping_sub(8)]);
            b[i..i + 8].copy_from_slice(&x.to_le_bytes());
        }
        _ => b.extend((0..r.below(32)).map(|_| r.next() as u8)),
    }
}

/// Load a model (a directory or a GGUF file) and exercise what it loaded: tokenize a string with control tokens,
/// check the ids, render the chat template. The error kind and a message shape (digits and quoted parts removed) of
/// the outcome.
pub fn run_one(path: &Path) -> std::result::Result<(), (String, String)> {
    let res = catch_panic(|| {
        let m = load(path)?;
        let ids = m.tokenize("hello <|im_end|> 12+30<|mask|>", true)?;
        let _ = m.check_ids("ids", &ids);
        let _ = m.detokenize(&ids.iter().map(|&i| i as i64).collect::<Vec<_>>(), false);
        if let Some(t) = &m.chat_template {
            t.render(&json!([{"role": "user", "content": "hi"}]), true, &json!({}))?;
        }
        Ok(())
    });
    res.map_err(|e| {
        let msg = e.to_string().replace(&path.display().to_string(), "<dir>");
        let shape: String = msg
            .split('\'')
            .enumerate()
            .filter(|(i, _)| i % 2 == 0)
            .map(|(_, s)| s.chars().filter(|c| !c.is_ascii_digit()).collect::<String>())
            .collect::<Vec<_>>()
            .join("'…'");
        (kind(&e).to_string(), shape.chars().take(100).collect())
    })
}

/// The outcomes of a fuzz run. Panics are caught by `catch_panic` (as `Error::Internal`); the panic hook keeps
/// their messages instead of printing the default report. One `Tally` per test binary (the hook is global).
pub struct Tally {
    panics: Arc<Mutex<Vec<String>>>,
    n_panics: usize,
    contained: usize,
    outcomes: BTreeMap<(String, String), usize>,
    internal: Vec<String>,
    slow: Vec<String>,
    slowest: Duration,
    t0: Instant,
}

impl Tally {
    pub fn new() -> Tally {
        let panics: Arc<Mutex<Vec<String>>> = Arc::default();
        let seen = panics.clone();
        std::panic::set_hook(Box::new(move |info| {
            let loc = info.location().map(|l| format!("{}:{}", l.file(), l.line())).unwrap_or_default();
            let m = format!("{info} at {loc}");
            if !m.contains("/tokenizers-") {
                eprintln!("fuzz: panic: {m}");
            }
            seen.lock().unwrap().push(m);
        }));
        Tally {
            panics,
            n_panics: 0,
            contained: 0,
            outcomes: BTreeMap::new(),
            internal: vec![],
            slow: vec![],
            slowest: Duration::ZERO,
            t0: Instant::now(),
        }
    }

    /// Run one input (`run_one` on `path`) and record its outcome; `keep` saves the input of an `Internal`
    /// error or a slow run and returns where, `label` says which input it was.
    pub fn run(&mut self, path: &Path, label: &str, keep: impl FnOnce() -> PathBuf) {
        let t = Instant::now();
        let out = run_one(path);
        let took = t.elapsed();
        self.slowest = self.slowest.max(took);
        let key = match out {
            Ok(()) => ("Ok".to_string(), String::new()),
            Err(k) => k,
        };
        {
            // A panic inside the tokenizers library that the loader caught and reported as a ModelLoad error
            // naming the tokenizer is contained; any other panic fails the run.
            let mut p = self.panics.lock().unwrap();
            let fresh: Vec<String> = p.drain(self.n_panics..).collect();
            if !fresh.is_empty() {
                let in_lib = fresh.iter().all(|m| m.contains("/tokenizers-"));
                if in_lib && key.0 == "ModelLoad" && key.1.contains("tokenizers library failed") {
                    self.contained += fresh.len();
                } else {
                    p.extend(fresh);
                }
            }
            self.n_panics = p.len();
        }
        if key.0 == "Internal" || took > SLOW {
            let kept = keep();
            let what = if took > SLOW { format!("took {:.1} s", took.as_secs_f64()) } else { key.1.clone() };
            let line = format!("{label} (kept at {}): {what}", kept.display());
            if took > SLOW {
                self.slow.push(line);
            } else {
                self.internal.push(line);
            }
        }
        *self.outcomes.entry(key).or_default() += 1;
    }

    /// Print the run's outcomes (by kind, then each distinct message shape) and fail on any panic, `Internal`
    /// error or slow input.
    pub fn finish(self, iters: usize, seed: u64) {
        let secs = self.t0.elapsed().as_secs_f64();
        let _ = std::panic::take_hook();
        let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
        for ((k, _), n) in &self.outcomes {
            *kinds.entry(k.as_str()).or_default() += n;
        }
        eprintln!("fuzz: {iters} inputs in {secs:.1} s (seed {seed:#x}); outcomes by kind: {kinds:?}");
        eprintln!("fuzz: slowest input {:.3} s", self.slowest.as_secs_f64());
        eprintln!(
            "fuzz: {} panics inside the tokenizers library, caught by the loader as ModelLoad errors",
            self.contained
        );
        eprintln!(
            "fuzz: {} distinct error messages (digits and quoted names removed):",
            self.outcomes.len() - self.outcomes.contains_key(&("Ok".into(), String::new())) as usize
        );
        for ((k, m), n) in &self.outcomes {
            eprintln!("  {n:>7}  {k:<13} {m}");
        }
        let panics = self.panics.lock().unwrap();
        assert!(
            self.internal.is_empty() && panics.is_empty() && self.slow.is_empty(),
            "{} panics:\n{}\n{}\nslow inputs:\n{}",
            panics.len(),
            panics.join("\n"),
            self.internal.join("\n"),
            self.slow.join("\n")
        );
    }
}
