//! What a forward hands the device, in one copy: its token ids, positions and logits rows, and on CUDA the attention
//! kernels' tables ([`cuda::segment_table`](crate::kernels::cuda::segment_table), the K/V addresses, each segment's key
//! ranges). The forward gathers them on the host as one list of 32-bit words (`StepWords`), and [`StepBuffers::upload`]
//! writes the list into a device buffer that stays put between forwards (grown when a forward needs more), in one
//! host-to-device copy. The forward reads each part as a view of that buffer ([`Step::view`]): no allocation and no
//! other upload per step, which is what a CUDA graph replaying the step needs (docs/dev/cuda.md). The CPU takes the
//! same path (there the copy is a memcpy), so every CPU test reads its inputs through it.

use crate::error::{Error, Result};
use candle_core::{CpuStorage, DType, Device, Layout, Tensor};
use std::collections::HashMap;
use std::sync::Mutex;
use std::thread::ThreadId;

/// Words each part starts at a multiple of: 16 bytes, so that an address table's 8-byte entries are aligned.
const ALIGN: usize = 4;
/// The smallest buffer allocated (words).
const MIN_WORDS: usize = 1024;

/// One part of a forward's words: where it starts in the list and how many words it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Section {
    at: usize,
    len: usize,
}

/// A forward's words, gathered on the host before its one upload.
#[derive(Debug, Default)]
pub(crate) struct StepWords {
    words: Vec<u32>,
}

impl StepWords {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Appends `words` as a new section (starting at a multiple of `ALIGN` words).
    pub(crate) fn push(&mut self, words: impl IntoIterator<Item = u32>) -> Section {
        let at = self.words.len().next_multiple_of(ALIGN);
        self.words.resize(at, 0);
        self.words.extend(words);
        Section { at, len: self.words.len() - at }
    }

    /// Appends 64-bit `values` (device addresses), each as two words, the low one first (little-endian: what a
    /// kernel reading 8-byte values sees). The section counts words.
    pub(crate) fn push_u64(&mut self, values: impl IntoIterator<Item = u64>) -> Section {
        self.push(values.into_iter().flat_map(|v| [v as u32, (v >> 32) as u32]))
    }

    pub(crate) fn len(&self) -> usize {
        self.words.len()
    }

    /// Words a list of `words` words needs to take sections of `more` words in all after it (the next section's
    /// alignment, then them).
    pub(crate) fn room_after(words: usize, more: usize) -> usize {
        words.next_multiple_of(ALIGN) + more
    }
}

/// A model's upload buffers: u32 tensors on its device, reused forward after forward, each by the thread that made
/// it. A forward takes one of its thread's (or makes one, when none is free or the free one is too small) and gives
/// it back when it ends (`Step`'s drop), so forwards running at once on one model each write their own. On CUDA each
/// thread queues its work on its own stream (candle's per-thread default stream): a buffer goes back to its thread
/// only, whose next write is queued after the reads of the forward that used it before. (Given to another thread, the
/// write could overtake those reads.)
#[derive(Debug, Default)]
pub(crate) struct StepBuffers {
    free: Mutex<HashMap<ThreadId, Vec<Tensor>>>,
}

impl StepBuffers {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Writes `words` into a buffer on `dev` in one copy; the forward reads its sections from the returned `Step`.
    pub(crate) fn upload(&self, words: StepWords, dev: &Device) -> Result<Step<'_>> {
        let n = words.len();
        let me = std::thread::current().id();
        let taken =
            self.free.lock().map_err(|_| Error::Internal("a forward panicked".into()))?.get_mut(&me).and_then(Vec::pop);
        let buf = match taken {
            Some(b) if b.elem_count() >= n && b.device().same_device(dev) => b,
            _ => Tensor::zeros(n.max(MIN_WORDS).next_power_of_two(), DType::U32, dev)?,
        };
        buf.inplace_op1(&Write(&words.words))?;
        Ok(Step { buf: Some(buf), owner: Some(self) })
    }

    /// Buffers free now, of every thread (for tests).
    #[cfg(test)]
    fn free(&self) -> usize {
        self.free.lock().unwrap().values().map(Vec::len).sum()
    }
}

/// One forward's uploaded words: read them as views (`view`); the buffer goes back to its model when this drops
/// (a pool's), or stays with the CUDA graph that reads it (a fixed one, [`Step::fixed`]).
pub(crate) struct Step<'a> {
    buf: Option<Tensor>,
    owner: Option<&'a StepBuffers>,
}

impl Step<'static> {
    /// A buffer of `room` words on `dev`, for one forward shape's CUDA graph ([`net::graph`](crate::net::graph)): the
    /// graph reads its views at fixed addresses, so every forward it replays writes its words there (`fixed`).
    pub(crate) fn buffer(room: usize, dev: &Device) -> Result<Tensor> {
        Ok(Tensor::zeros(room.max(1), DType::U32, dev)?)
    }

    /// Writes `words` at the start of `buf` (made by `buffer`, with room for them) in one copy, and reads them
    /// from it.
    pub(crate) fn fixed(buf: &Tensor, words: &StepWords) -> Result<Step<'static>> {
        if words.len() > buf.elem_count() {
            return Err(Error::Internal(format!("{} words for a fixed buffer of {}", words.len(), buf.elem_count())));
        }
        buf.inplace_op1(&Write(&words.words))?;
        Ok(Step { buf: Some(buf.clone()), owner: None })
    }
}

impl Step<'_> {
    /// Section `s` as a u32 tensor (a contiguous view of the buffer).
    pub(crate) fn view(&self, s: Section) -> Result<Tensor> {
        Ok(self.buf.as_ref().expect("a step's buffer until it drops").narrow(0, s.at, s.len)?)
    }
}

impl Drop for Step<'_> {
    fn drop(&mut self) {
        if let (Some(b), Some(Ok(mut free))) = (self.buf.take(), self.owner.map(|o| o.free.lock())) {
            free.entry(std::thread::current().id()).or_default().push(b);
        }
    }
}

/// Writes its words at the start of a u32 tensor's view: a memcpy on the CPU, one host-to-device copy on CUDA
/// (`write_words` of [`kernels::cuda`](crate::kernels::cuda), with the `cuda` feature).
struct Write<'a>(&'a [u32]);

impl candle_core::InplaceOp1 for Write<'_> {
    fn name(&self) -> &'static str {
        "mbd-step-words"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let at = layout.start_offset();
        match storage {
            CpuStorage::U32(v) if at + self.0.len() <= v.len() => {
                v[at..at + self.0.len()].copy_from_slice(self.0);
                Ok(())
            }
            _ => candle_core::bail!("a step's words go into a u32 buffer large enough"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &mut candle_core::cuda_backend::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<()> {
        crate::kernels::cuda::write_words(storage, layout.start_offset(), self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(step: &Step<'_>, s: Section) -> Vec<u32> {
        step.view(s).unwrap().to_vec1::<u32>().unwrap()
    }

    /// The address of a CPU buffer's first word (to tell buffers apart).
    fn address(step: &Step<'_>) -> usize {
        let (st, _) = step.buf.as_ref().unwrap().storage_and_layout();
        match &*st {
            candle_core::Storage::Cpu(CpuStorage::U32(v)) => v.as_ptr() as usize,
            _ => unreachable!(),
        }
    }

    #[test]
    fn sections_read_back_aligned_and_in_order() {
        let mut w = StepWords::new();
        let a = w.push([7, 8, 9]);
        let b = w.push_u64([0x1_0000_0002, u64::MAX - 1]);
        let c = w.push(std::iter::empty());
        let d = w.push(0..5);
        assert_eq!((a.at, b.at, c.at, d.at), (0, 4, 8, 8));
        assert_eq!((b.len, c.len, d.len), (4, 0, 5));
        let bufs = StepBuffers::new();
        let step = bufs.upload(w, &Device::Cpu).unwrap();
        assert_eq!(read(&step, a), [7, 8, 9]);
        assert_eq!(read(&step, b), [2, 1, u32::MAX - 1, u32::MAX]);
        assert_eq!(read(&step, d), [0, 1, 2, 3, 4]);
    }

    #[test]
    fn a_buffer_is_reused_grown_and_never_shared_by_two_forwards_at_once() {
        let bufs = StepBuffers::new();
        let words = |n: u32| {
            let mut w = StepWords::new();
            (w.push(0..n), w)
        };
        let (s1, w1) = words(10);
        let first = bufs.upload(w1, &Device::Cpu).unwrap();
        let a1 = address(&first);
        drop(first);
        assert_eq!(bufs.free(), 1);
        // the next forward writes the same buffer, and reads only its own words
        let (s2, w2) = words(3);
        let second = bufs.upload(w2, &Device::Cpu).unwrap();
        assert_eq!(address(&second), a1);
        assert_eq!(read(&second, s2), [0, 1, 2]);
        // a forward running beside it gets another buffer; its words do not touch the first's
        let (s3, mut w3) = words(4);
        w3.words.iter_mut().for_each(|x| *x += 100);
        let third = bufs.upload(w3, &Device::Cpu).unwrap();
        assert_ne!(address(&third), a1);
        assert_eq!((read(&second, s2), read(&third, s3)), (vec![0, 1, 2], vec![100, 101, 102, 103]));
        drop((second, third));
        assert_eq!(bufs.free(), 2);
        // a forward larger than the free buffer gets a larger one, which stays for later forwards
        let (s4, w4) = words(5000);
        let big = bufs.upload(w4, &Device::Cpu).unwrap();
        assert_eq!(big.buf.as_ref().unwrap().elem_count(), 8192);
        assert_eq!(read(&big, s4)[4999], 4999);
        drop(big);
        assert_eq!(bufs.free(), 2);
        let _ = s1;
        // another thread never takes this thread's buffers (on CUDA its stream is not ordered with this one's)
        let here = address(&bufs.upload(words(3).1, &Device::Cpu).unwrap());
        std::thread::scope(|sc| {
            sc.spawn(|| assert_ne!(address(&bufs.upload(words(3).1, &Device::Cpu).unwrap()), here));
        });
        assert_eq!(bufs.free(), 3);
    }
}
