//! Small shared helpers: string-named enums and the one ordering used for "best first, ties to the lower
//! index" everywhere (sampling, acceptance, MoE routing).

use std::cmp::Ordering;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::Arc;

/// A cancellation token: cheap to clone, set from any thread (`cancel`), polled by long work between its pieces (a
/// prefill chunk, a layer of a forward, a chunk of scored positions), which then stops with
/// [`Error::Cancelled`](crate::error::Error::Cancelled).
#[derive(Clone, Debug, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    /// Ask the work to stop.
    pub fn cancel(&self) {
        self.0.store(true, AtomicOrdering::SeqCst);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(AtomicOrdering::SeqCst)
    }

    /// `Err(Error::Cancelled)` once cancelled (`what`: the work, for the message).
    pub fn check(&self, what: &str) -> crate::error::Result<()> {
        if self.is_cancelled() {
            return Err(crate::error::Error::Cancelled(format!("{what} was cancelled")));
        }
        Ok(())
    }
}

/// An enum whose variants have fixed external names (API values, config values, report strings).
/// Generates `name()`, `parse()` (an `InvalidRequest` error that lists the valid names, under `$what`),
/// and `NAMES`.
macro_rules! string_enum {
    ($(#[$m:meta])* $vis:vis enum $ty:ident ($what:literal) { $($(#[$vm:meta])* $v:ident = $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        $vis enum $ty { $($(#[$vm])* $v),+ }

        impl $ty {
            /// Every variant's external name, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($s),+];
            pub fn name(&self) -> &'static str {
                match self { $($ty::$v => $s),+ }
            }
            pub fn parse(s: &str) -> $crate::error::Result<Self> {
                match s {
                    $($s => Ok($ty::$v),)+
                    _ => Err($crate::error::Error::invalid(format!(
                        "{} must be {}, got '{s}'", $what, $crate::util::one_of(Self::NAMES)
                    ))),
                }
            }
        }
    };
}

/// Path-scoped (`crate::util::string_enum!`), so the modules that declare such enums import this ground module,
/// not the crate root.
pub(crate) use string_enum;

/// "'a'", "'a' or 'b'", "'a', 'b' or 'c'".
pub fn one_of(names: &[&str]) -> String {
    let q: Vec<String> = names.iter().map(|n| format!("'{n}'")).collect();
    match q.split_last() {
        None => String::new(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
    }
}

/// A zero-filled vector of `n` elements, allocated fallibly: a size the allocator refuses is an error, not
/// an abort.
pub fn try_zeroed<T: Clone>(n: usize, zero: T, what: &dyn Fn() -> String) -> crate::error::Result<Vec<T>> {
    let mut v: Vec<T> = Vec::new();
    v.try_reserve_exact(n).map_err(|e| {
        crate::error::Error::load(format!(
            "{}: cannot allocate {} bytes: {e}",
            what(),
            (n as u128) * std::mem::size_of::<T>() as u128
        ))
    })?;
    v.resize(n, zero);
    Ok(v)
}

/// The bytes of a file a model brings (a JSON file, tokenizer.json, chat_template.jinja): a regular file (symlinks
/// followed) of at most `max` bytes, checked before it is opened (opening a FIFO blocks until a writer comes) and
/// again while it is read (a file that grows is cut off at `max` + 1 bytes and refused). `what`: why the file is
/// needed, for a missing file's error.
pub fn read_model_file(path: &std::path::Path, max: u64, what: &str) -> crate::error::Result<Vec<u8>> {
    use crate::error::Error;
    use std::io::Read;
    let cannot = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::FileNotFound { path: path.to_path_buf(), what: what.into() }
        } else {
            Error::load(format!("{}: cannot read: {e}", path.display()))
        }
    };
    let too_big = |n: String| {
        Error::load(format!("{}: {n} bytes is larger than the {} MiB such a file may be", path.display(), max >> 20))
    };
    let meta = std::fs::metadata(path).map_err(cannot)?;
    if !meta.is_file() {
        let kind = if meta.is_dir() { "a directory" } else { "not a regular file (a FIFO, socket or device)" };
        return Err(Error::load(format!("{}: {kind}; expected a regular file", path.display())));
    }
    if meta.len() > max {
        return Err(too_big(meta.len().to_string()));
    }
    let f = std::fs::File::open(path).map_err(cannot)?;
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(meta.len() as usize)
        .map_err(|e| Error::load(format!("{}: cannot allocate {} bytes: {e}", path.display(), meta.len())))?;
    f.take(max + 1).read_to_end(&mut bytes).map_err(cannot)?;
    if bytes.len() as u64 > max {
        return Err(too_big(format!("more than {max}")));
    }
    Ok(bytes)
}

/// Allocate nothing, but check that `bytes` more could be allocated now: a request whose buffers cannot exist
/// gets an error instead of aborting the process (Rust aborts on allocation failure, which no panic guard
/// catches).
pub fn check_alloc(bytes: usize, what: impl FnOnce() -> String) -> crate::error::Result<()> {
    let mut probe: Vec<u8> = Vec::new();
    let reserved = probe.try_reserve_exact(bytes);
    // the probe must be seen to escape: an allocation that is freed unused may be elided by the optimizer, which
    // then takes it as having succeeded (release builds passed usize::MAX / 2 before this)
    std::hint::black_box(&probe);
    reserved.map_err(|_| {
        crate::error::Error::invalid(format!(
            "{}: {:.1} GB cannot be allocated on this machine",
            what(),
            bytes as f64 / 1e9
        ))
    })
}

/// Order indices by a score, lowest score first, ties (and NaNs) by the lower index. Sort with
/// `|&a, &b| by_score_then_index(s[a], s[b], a, b)`; for highest first, swap the scores.
pub fn by_score_then_index<S: PartialOrd>(sa: S, sb: S, a: usize, b: usize) -> Ordering {
    sa.partial_cmp(&sb).unwrap_or(Ordering::Equal).then(a.cmp(&b))
}

/// Seeded uniform values in [-0.5, 0.5) (a 64-bit LCG's high bits), the test data of the kernels' unit tests.
/// A float as an error message shows it: plain where that is short, else in exponent form (`1e-300`, not 300
/// digits).
pub fn show_f64(x: f64) -> String {
    let plain = format!("{x}");
    if plain.len() <= 16 {
        plain
    } else {
        format!("{x:e}")
    }
}

#[cfg(test)]
pub(crate) fn uniform(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed;
    move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    string_enum! {
        enum Colour ("colour") { Red = "red", Dark = "dark_blue" }
    }

    #[test]
    fn names_round_trip_and_errors_list_choices() {
        for n in Colour::NAMES {
            assert_eq!(Colour::parse(n).unwrap().name(), *n);
        }
        let e = Colour::parse("green").unwrap_err().to_string();
        assert_eq!(e, "colour must be 'red' or 'dark_blue', got 'green'");
        assert_eq!(one_of(&["a", "b", "c"]), "'a', 'b' or 'c'");
    }

    #[test]
    fn impossible_allocations_are_errors() {
        assert!(check_alloc(1 << 20, || "a megabyte".into()).is_ok());
        let e = check_alloc(usize::MAX / 2, || "the KV cache".into()).unwrap_err().to_string();
        assert!(e.starts_with("the KV cache: ") && e.ends_with("cannot be allocated on this machine"), "{e}");
    }

    #[test]
    fn ties_go_to_the_lower_index() {
        let s = [0.5, 0.1, 0.5];
        let mut idx: Vec<usize> = (0..3).collect();
        idx.sort_by(|&a, &b| by_score_then_index(s[a], s[b], a, b));
        assert_eq!(idx, [1, 0, 2]);
    }
}
