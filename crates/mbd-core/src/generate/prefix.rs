//! The prefix cache: the K/V of prompts (and of committed answers) kept across requests, so that a request whose
//! tokens begin as an earlier one's prefills only the rest. One per engine, shared by every generation.
//!
//! Exactness. With block-causal attention (blocks aligned at absolute position 0) the K/V of a complete block depend
//! only on the tokens up to its end; with causal attention, those of a position on the tokens up to it. So the K/V
//! a generation committed for [0, n) are the K/V any later sequence beginning with the same n tokens would compute
//! under the same grid, and a request may start from them. Where that does not hold the cache is not used: full
//! attention (a prompt's K/V depend on the masks after it), blocks aligned at the prompt's end, the approximate and
//! recompute policies.
//!
//! Hybrids (Qwen3.5). A Gated DeltaNet layer's state at position n depends on every token before n, so a hit must
//! also restore it: some pages carry a snapshot of the recurrent states at their end (every
//! [`SNAPSHOT_STRIDE`]-th position, and the last page boundary a sequence committed), and a hybrid's hit ends at
//! the end of the last page with one.
//!
//! Layout. Entries are pages of `page_size(grid)` tokens (whole blocks of the grid: the smallest multiple of the
//! block size of at least [`PAGE_TOKENS`]), in a tree per root: a root is the grid (kind and block size: the same
//! tokens under another block size have other K/V) and the request's `cache_salt`. A page's children are keyed by
//! their tokens, so a lookup compares token content exactly, page by page (no hash can collide). A hit may end inside
//! its last page, at any boundary of the grid: the rows after it are not copied.
//!
//! Sharing. A hit copies the pages' K/V into the sequence's own cache (entries are never written after they are
//! made, and a page taken for a copy stays alive until the copy is done even if it is evicted meanwhile). Inserting
//! copies the committed rows of pages the tree does not hold yet.
//!
//! Bounded. The pages' bytes never exceed the cap: before a page is added, least recently used leaves (pages no other
//! page extends) are evicted; the pages of the sequence being inserted are never its own victims. A cap of 0 keeps
//! nothing.

use crate::error::Result;
use crate::net::kv_cache::{KvCache, Snapshot};
use crate::net::mask::{AttentionKind, BlockGrid};
use candle_core::Tensor;
use std::collections::HashMap;
use std::sync::Mutex;

/// Tokens a page holds at least (a page is whole blocks of the grid).
pub const PAGE_TOKENS: usize = 32;

/// A hybrid keeps the recurrent states at every multiple of this many positions (and at the last page boundary a
/// sequence committed): the prefill is cut there ([`Window`](crate::generate::window::Window)).
pub const SNAPSHOT_STRIDE: usize = 512;

/// Per layer (K, V), each (n_kv, page tokens, head_dim).
type Rows = Vec<(Tensor, Tensor)>;

/// A cached page as a lookup finds it: its K/V, and (hybrids) the recurrent states at its end when kept.
pub struct Found {
    pub rows: Rows,
    pub snapshot: Option<Snapshot>,
}

/// A page as a file keeps it ([`generate::prefix_file`](crate::generate::prefix_file)): its tree, its parent (an
/// earlier record's index; None under the root), its tokens, K/V and snapshot.
pub struct PageRecord {
    pub root: String,
    pub parent: Option<usize>,
    pub tokens: Vec<u32>,
    pub rows: Rows,
    pub snapshot: Option<Snapshot>,
}

/// The page size for `grid`: whole blocks (block-causal), or `PAGE_TOKENS` positions (causal).
pub fn page_size(grid: &BlockGrid) -> usize {
    match grid.kind {
        AttentionKind::BlockCausal => grid.block_size * PAGE_TOKENS.div_ceil(grid.block_size.max(1)),
        _ => PAGE_TOKENS,
    }
}

/// The tree a request's pages live in: its grid and its salt.
pub fn root_key(grid: &BlockGrid, salt: &str) -> String {
    let b = if grid.kind == AttentionKind::BlockCausal { grid.block_size } else { 1 };
    format!("{:?}/{b}/{salt}", grid.kind)
}

/// What the cache holds and has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// The cap, and the bytes and pages held.
    pub capacity_bytes: usize,
    pub bytes: usize,
    pub pages: usize,
    /// Requests that looked a prefix up, those that found one, and the tokens found.
    pub lookups: usize,
    pub hits: usize,
    pub hit_tokens: usize,
    /// Pages added and pages evicted.
    pub inserted_pages: usize,
    pub evicted_pages: usize,
}

struct Node {
    parent: Option<usize>,
    /// The page's tokens (empty for a root).
    key: Vec<u32>,
    /// A root's key in `roots`.
    root: Option<String>,
    children: HashMap<Vec<u32>, usize>,
    rows: Rows,
    snapshot: Option<Snapshot>,
    bytes: usize,
    last_used: u64,
}

#[derive(Default)]
struct Inner {
    nodes: Vec<Option<Node>>,
    free: Vec<usize>,
    roots: HashMap<String, usize>,
    tick: u64,
    stats: PrefixStats,
}

pub struct PrefixCache {
    inner: Mutex<Inner>,
}

impl PrefixCache {
    /// A cache that holds at most `capacity_bytes` of K/V (0: nothing).
    pub fn new(capacity_bytes: usize) -> PrefixCache {
        let inner = Inner { stats: PrefixStats { capacity_bytes, ..Default::default() }, ..Default::default() };
        PrefixCache { inner: Mutex::new(inner) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // a panic elsewhere while the lock was held leaves consistent data (every change is a few plain writes)
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn capacity(&self) -> usize {
        self.lock().stats.capacity_bytes
    }

    pub fn stats(&self) -> PrefixStats {
        self.lock().stats
    }

    /// Drop every page (requests running keep the rows they copied).
    pub fn clear(&self) {
        let mut g = self.lock();
        let stats = PrefixStats { bytes: 0, pages: 0, ..g.stats };
        *g = Inner { stats, ..Default::default() };
    }

    /// Every page, parents before children (roots in name order, then breadth first): what a file keeps.
    pub fn records(&self) -> Vec<PageRecord> {
        let g = self.lock();
        let mut roots: Vec<(&String, &usize)> = g.roots.iter().collect();
        roots.sort();
        let mut out = vec![];
        for (name, &r) in roots {
            let mut queue = std::collections::VecDeque::from([(r, None)]);
            while let Some((id, parent)) = queue.pop_front() {
                let node = g.node(id);
                let me = if id == r {
                    None
                } else {
                    out.push(PageRecord {
                        root: name.clone(),
                        parent,
                        tokens: node.key.clone(),
                        rows: node.rows.clone(),
                        snapshot: node.snapshot.clone(),
                    });
                    Some(out.len() - 1)
                };
                let mut kids: Vec<usize> = node.children.values().copied().collect();
                kids.sort_unstable();
                queue.extend(kids.into_iter().map(|k| (k, me)));
            }
        }
        out
    }

    /// Add the pages of `records` (parents before children, as `records` gives them) that the tree does not hold,
    /// each taking `bytes(record)` of the cap: least recently used leaves are evicted for them, never a page of this
    /// call; a page that does not fit is left out with the pages under it. Returns the pages added.
    pub fn restore(&self, records: Vec<PageRecord>, bytes: impl Fn(&PageRecord) -> usize) -> usize {
        let mut g = self.lock();
        let cap = g.stats.capacity_bytes;
        g.tick += 1;
        let tick = g.tick;
        let mut placed: Vec<Option<usize>> = Vec::with_capacity(records.len());
        let mut added = 0;
        for rec in records {
            let parent = match rec.parent {
                Some(p) => placed.get(p).copied().flatten(),
                None => Some(g.root_node(&rec.root, tick)),
            };
            let Some(at) = parent else {
                placed.push(None);
                continue;
            };
            if let Some(&next) = g.node(at).children.get(&rec.tokens) {
                g.node_mut(next).last_used = tick;
                placed.push(Some(next));
                continue;
            }
            let b = bytes(&rec);
            if !g.make_room(b, cap, tick) {
                placed.push(None);
                continue;
            }
            let id = g.add_page(at, rec.tokens, rec.rows, rec.snapshot, b, tick);
            placed.push(Some(id));
            added += 1;
        }
        added
    }

    /// The cached pages that begin `tokens[..limit]` under `root`, longest first match: their rows, at most
    /// `limit / page` pages (the caller cuts the last one to where its hit ends). Counts a lookup.
    pub fn lookup(&self, root: &str, tokens: &[u32], page: usize, limit: usize) -> Vec<Found> {
        let mut g = self.lock();
        g.stats.lookups += 1;
        g.tick += 1;
        let tick = g.tick;
        let mut found = vec![];
        let Some(&r) = g.roots.get(root) else { return found };
        let mut at = r;
        for chunk in tokens[..limit.min(tokens.len())].chunks_exact(page.max(1)) {
            let Some(&next) = g.node(at).children.get(chunk) else { break };
            let n = g.node_mut(next);
            n.last_used = tick;
            found.push(Found { rows: n.rows.clone(), snapshot: n.snapshot.clone() });
            at = next;
        }
        found
    }

    /// Count a request's hit of `tokens` tokens (what it used of `lookup`'s pages).
    pub fn record_hit(&self, tokens: usize) {
        if tokens > 0 {
            let mut g = self.lock();
            g.stats.hits += 1;
            g.stats.hit_tokens += tokens;
        }
    }

    /// Keep the pages of `tokens[..n]` (n <= cache.len(), the rows' K/V final under the root's grid) that the tree
    /// does not hold, copied from `cache`, evicting least recently used leaves to stay within the cap. Stops at the
    /// first page that does not fit. A hybrid's cache gives `snapshots`, its recurrent states at some page ends
    /// (position, states): only the pages up to the last of them are kept, each with its snapshot.
    pub fn insert(
        &self,
        root: &str,
        tokens: &[u32],
        page: usize,
        cache: &KvCache,
        n: usize,
        snapshots: &[(usize, Snapshot)],
    ) -> Result<()> {
        let hybrid = cache.has_recurrent();
        let n = if hybrid { snapshots.iter().map(|s| s.0).filter(|&p| p <= n).max().unwrap_or(0) } else { n };
        let mut g = self.lock();
        let cap = g.stats.capacity_bytes;
        let page_bytes = cache.bytes_per_position() * page;
        if page == 0 || page_bytes > cap {
            return Ok(());
        }
        g.tick += 1;
        let tick = g.tick;
        let mut at = g.root_node(root, tick);
        let n = n.min(tokens.len()).min(cache.len());
        for (i, chunk) in tokens[..n].chunks_exact(page).enumerate() {
            let end = (i + 1) * page;
            let snapshot = snapshots.iter().find(|s| s.0 == end).map(|s| s.1.clone());
            let snap_bytes = if snapshot.is_some() { cache.recurrent_bytes() } else { 0 };
            if let Some(&next) = g.node(at).children.get(chunk) {
                g.node_mut(next).last_used = tick;
                at = next;
                // a page cached without the states at its end gets them when they fit
                if snapshot.is_some() && g.node(next).snapshot.is_none() && g.make_room(snap_bytes, cap, tick) {
                    let nd = g.node_mut(next);
                    nd.snapshot = snapshot;
                    nd.bytes += snap_bytes;
                    g.stats.bytes += snap_bytes;
                }
                continue;
            }
            if !g.make_room(page_bytes + snap_bytes, cap, tick) {
                return Ok(());
            }
            let rows = cache.copy_rows(i * page, page)?;
            at = g.add_page(at, chunk.to_vec(), rows, snapshot, page_bytes + snap_bytes, tick);
        }
        Ok(())
    }
}

impl Inner {
    fn node(&self, i: usize) -> &Node {
        self.nodes[i].as_ref().expect("a live node")
    }

    fn node_mut(&mut self, i: usize) -> &mut Node {
        self.nodes[i].as_mut().expect("a live node")
    }

    /// A new page under `parent` (room made for its `bytes` already), counted; returns its node.
    fn add_page(
        &mut self,
        parent: usize,
        key: Vec<u32>,
        rows: Rows,
        snapshot: Option<Snapshot>,
        bytes: usize,
        tick: u64,
    ) -> usize {
        let id = self.add(Node {
            parent: Some(parent),
            key: key.clone(),
            root: None,
            children: HashMap::new(),
            rows,
            snapshot,
            bytes,
            last_used: tick,
        });
        self.node_mut(parent).children.insert(key, id);
        self.stats.bytes += bytes;
        self.stats.pages += 1;
        self.stats.inserted_pages += 1;
        id
    }

    /// The root node of the tree `root` (made when missing), marked used at `tick`.
    fn root_node(&mut self, root: &str, tick: u64) -> usize {
        let r = match self.roots.get(root) {
            Some(&r) => r,
            None => {
                let r = self.add(Node {
                    parent: None,
                    key: vec![],
                    root: Some(root.to_string()),
                    children: HashMap::new(),
                    rows: vec![],
                    snapshot: None,
                    bytes: 0,
                    last_used: tick,
                });
                self.roots.insert(root.to_string(), r);
                r
            }
        };
        self.node_mut(r).last_used = tick;
        r
    }

    fn add(&mut self, n: Node) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i] = Some(n);
                i
            }
            None => {
                self.nodes.push(Some(n));
                self.nodes.len() - 1
            }
        }
    }

    /// Evict least recently used leaves until `bytes` more fit under `cap`; false when they cannot.
    fn make_room(&mut self, bytes: usize, cap: usize, tick: u64) -> bool {
        if bytes > cap {
            return false;
        }
        while self.stats.bytes + bytes > cap {
            if !self.evict_one(tick) {
                return false;
            }
        }
        true
    }

    /// Evict the least recently used leaf page used before `tick`; false when there is none.
    fn evict_one(&mut self, tick: u64) -> bool {
        let victim = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
            .filter(|(_, n)| n.parent.is_some() && n.children.is_empty() && n.last_used < tick)
            .min_by_key(|(_, n)| n.last_used)
            .map(|(i, _)| i);
        let Some(v) = victim else { return false };
        let node = self.nodes[v].take().expect("a live node");
        self.free.push(v);
        self.stats.bytes -= node.bytes;
        self.stats.pages -= 1;
        self.stats.evicted_pages += 1;
        let parent = node.parent.expect("a page has a parent");
        let p = self.node_mut(parent);
        p.children.remove(&node.key);
        // a root left without pages goes too
        if p.children.is_empty() && p.parent.is_none() && p.last_used < tick {
            let root = p.root.take();
            self.nodes[parent] = None;
            self.free.push(parent);
            if let Some(r) = root {
                self.roots.remove(&r);
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// A one-layer cache holding positions with K = V = their token value.
    fn cache_of(tokens: &[u32]) -> KvCache {
        let mut c = KvCache::new(1, 1, 1, DType::F32, &Device::Cpu);
        c.begin_window(tokens.len()).unwrap();
        let vals: Vec<f32> = tokens.iter().map(|&t| t as f32).collect();
        let k = Tensor::from_slice(&vals, (1, tokens.len(), 1), &Device::Cpu).unwrap();
        c.write_window(0, &k, &k, 0).unwrap();
        c.commit(tokens.len()).unwrap();
        c
    }

    fn values(pages: &[Found]) -> Vec<f32> {
        pages.iter().flat_map(|p| p.rows[0].0.flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect()
    }

    #[test]
    fn a_lookup_finds_the_longest_run_of_whole_pages_of_equal_tokens() {
        let pc = PrefixCache::new(1 << 20);
        let a: Vec<u32> = (0..10).collect();
        pc.insert("r", &a, 4, &cache_of(&a), 10, &[]).unwrap();
        assert_eq!(pc.stats().pages, 2); // 10 tokens: two whole pages of 4
        assert_eq!(values(&pc.lookup("r", &a, 4, 10)), (0..8).map(|x| x as f32).collect::<Vec<_>>());
        // a different third token: nothing; a different sixth: the first page only
        let mut b = a.clone();
        b[2] = 99;
        assert!(pc.lookup("r", &b, 4, 10).is_empty());
        let mut c = a.clone();
        c[5] = 99;
        assert_eq!(pc.lookup("r", &c, 4, 10).len(), 1);
        // the limit, another root
        assert_eq!(pc.lookup("r", &a, 4, 7).len(), 1);
        assert!(pc.lookup("salted", &a, 4, 10).is_empty());
        pc.clear();
        assert!(pc.lookup("r", &a, 4, 10).is_empty());
        assert_eq!((pc.stats().pages, pc.stats().bytes), (0, 0));
    }

    #[test]
    fn the_cap_holds_and_least_recently_used_leaves_go_first() {
        // one position is 8 bytes (K and V of one f32): a page of 4 is 32 bytes, the cap three pages
        let pc = PrefixCache::new(96);
        let a: Vec<u32> = (0..8).collect();
        let b: Vec<u32> = (100..108).collect();
        pc.insert("r", &a, 4, &cache_of(&a), 8, &[]).unwrap();
        pc.insert("r", &b, 4, &cache_of(&b), 8, &[]).unwrap(); // needs a[4..8]'s room: the older leaf goes
        let s = pc.stats();
        assert_eq!((s.pages, s.bytes, s.evicted_pages), (3, 96, 1));
        assert_eq!(pc.lookup("r", &a, 4, 8).len(), 1);
        assert_eq!(pc.lookup("r", &b, 4, 8).len(), 2);
        // a sequence longer than the cap keeps what fits of itself, never evicting its own pages
        let c: Vec<u32> = (200..220).collect();
        pc.insert("r", &c, 4, &cache_of(&c), 20, &[]).unwrap();
        assert!(pc.stats().bytes <= 96);
        assert_eq!(pc.lookup("r", &c, 4, 20).len(), 3);
        // a cap below one page keeps nothing
        let none = PrefixCache::new(16);
        none.insert("r", &a, 4, &cache_of(&a), 8, &[]).unwrap();
        assert_eq!(none.stats().pages, 0);
    }

    #[test]
    fn records_restore_the_tree_within_the_cap() {
        let pc = PrefixCache::new(1 << 20);
        let a: Vec<u32> = (0..12).collect();
        let mut b = a.clone();
        b[9] = 99; // shares a's first two pages
        pc.insert("r", &a, 4, &cache_of(&a), 12, &[]).unwrap();
        pc.insert("r", &b, 4, &cache_of(&b), 12, &[]).unwrap();
        pc.insert("salted", &a, 4, &cache_of(&a), 8, &[]).unwrap();
        let recs = pc.records();
        assert_eq!(recs.len(), 6); // r: 3 + 1 pages, salted: 2
        assert!(recs.iter().enumerate().all(|(i, r)| r.parent.is_none_or(|p| p < i)));
        let bytes = |r: &PageRecord| 8 * r.tokens.len();
        let copy = PrefixCache::new(1 << 20);
        assert_eq!(copy.restore(pc.records(), bytes), 6);
        assert_eq!(copy.restore(pc.records(), bytes), 0); // held already
        assert_eq!(values(&copy.lookup("r", &b, 4, 12)), b.iter().map(|&x| x as f32).collect::<Vec<_>>());
        assert_eq!(copy.lookup("salted", &a, 4, 12).len(), 2);
        assert_eq!(copy.stats().bytes, pc.stats().bytes);
        // a cap of three pages: what fits, a page's children never without it
        let small = PrefixCache::new(96);
        let n = small.restore(pc.records(), bytes);
        assert!(n <= 3 && small.stats().bytes <= 96 && small.stats().pages == n);
    }
}
