//! A wake line: a descriptor an event loop watches in place of a thread per stream. The scheduler calls its
//! [`Waker`] after each output; the reader drains the line, then polls its streams with
//! [`StreamHandle::try_next`](crate::generate::scheduler::StreamHandle::try_next).

use crate::generate::scheduler::Waker;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The two ends of a non-blocking socket pair and whether a wake is pending: a wake writes one byte unless one
/// is already unread, so a burst of outputs costs one write and one readiness event.
pub struct WakeLine {
    tx: UnixStream,
    rx: UnixStream,
    /// A byte was written and is not yet known to be read: while it is set, a wake writes nothing.
    pending: AtomicBool,
}

impl WakeLine {
    pub fn new() -> std::io::Result<WakeLine> {
        let (tx, rx) = UnixStream::pair()?;
        tx.set_nonblocking(true)?;
        rx.set_nonblocking(true)?;
        Ok(WakeLine { tx, rx, pending: AtomicBool::new(false) })
    }

    /// The descriptor to watch for reading.
    pub fn fd(&self) -> RawFd {
        self.rx.as_raw_fd()
    }

    /// Make the descriptor readable (called after an output was sent: the reader's next drain-then-poll sees it).
    pub fn wake(&self) {
        if !self.pending.swap(true, Ordering::SeqCst) {
            let _ = (&self.tx).write(&[1]); // a full buffer already holds a wake
        }
    }

    /// The line as a stream's waker.
    pub fn waker(self: &Arc<Self>) -> Waker {
        let line = self.clone();
        Arc::new(move || line.wake())
    }

    /// Read every pending byte, then let the next wake write again; returns whether a byte was read. The order
    /// matters: a flag cleared before the read would let the read swallow a byte written in between and leave the
    /// flag set over an empty line, so that no wake ever wrote again. Cleared after, a wake that still finds it
    /// set sent its output before the poll that follows the drain.
    pub fn drain(&self) -> bool {
        self.drain_with(|| {})
    }

    /// [`drain`](Self::drain) with `between` called before each of its steps, where a test lands a wake.
    fn drain_with(&self, mut between: impl FnMut()) -> bool {
        let mut buf = [0u8; 64];
        let mut any = false;
        loop {
            between();
            match (&self.rx).read(&mut buf) {
                Ok(n) if n > 0 => any = true,
                _ => break,
            }
        }
        between();
        self.pending.store(false, Ordering::SeqCst);
        any
    }
}

#[cfg(test)]
mod tests {
    use super::WakeLine;
    use std::io::Read;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// A writer publishes a counter and wakes after each step; a reader that, like an event loop, drains only
    /// when the descriptor is readable and then reads the counter. No wake may be lost: the reader always comes
    /// to see the writer's last value (a lost wake leaves it waiting on a line that never becomes readable).
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn no_wake_is_lost_between_a_writer_and_a_reader_that_drains_when_readable() {
        const N: usize = 300_000;
        let line = Arc::new(WakeLine::new().unwrap());
        let counter = Arc::new(AtomicUsize::new(0));
        let writer = {
            let (line, counter) = (line.clone(), counter.clone());
            std::thread::spawn(move || {
                for i in 1..=N {
                    counter.store(i, Ordering::SeqCst);
                    line.wake();
                    for _ in 0..(i % 97) {
                        std::hint::spin_loop();
                    }
                }
            })
        };
        let mut seen = 0;
        while seen < N {
            let mut p = libc::pollfd { fd: line.fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd for the duration of the call
            let n = unsafe { libc::poll(&mut p, 1, 5000) };
            assert!(n >= 0, "poll failed");
            assert!(n > 0, "a wake was lost: the reader saw {seen} of {N} and the line stays unreadable");
            line.drain();
            seen = counter.load(Ordering::SeqCst);
        }
        writer.join().unwrap();
    }

    /// An output that lands at any step of a drain is either seen by the poll that follows the drain or wakes
    /// the line again; either way the output after it makes the line readable. (A lost wake shows as a line that
    /// stays unreadable after that later output.)
    #[test]
    fn a_wake_landing_at_any_step_of_a_drain_leaves_the_line_able_to_wake() {
        for woken in [true, false] {
            for step in 0..8 {
                let line = WakeLine::new().unwrap();
                if woken {
                    line.wake();
                }
                let mut calls = 0;
                line.drain_with(|| {
                    if calls == step {
                        line.wake();
                    }
                    calls += 1;
                });
                line.wake();
                let mut buf = [0u8; 64];
                let readable = matches!((&line.rx).read(&mut buf), Ok(n) if n > 0);
                assert!(readable, "a wake at step {step} of a drain (woken: {woken}) was lost");
            }
        }
    }

    #[test]
    fn a_burst_of_wakes_is_one_byte_and_a_drain_rearms() {
        let line = WakeLine::new().unwrap();
        assert!(!line.drain());
        for _ in 0..100 {
            line.wake();
        }
        let mut buf = [0u8; 64];
        assert_eq!((&line.rx).read(&mut buf).unwrap(), 1, "a hundred wakes before a drain wrote more than one byte");
        line.pending.store(false, Ordering::SeqCst);
        line.wake();
        assert!(line.drain());
        line.wake();
        assert!(line.drain(), "the drain did not rearm the line");
    }
}
