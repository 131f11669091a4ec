//! NPU compute-graph bucketing (shadowAttn, 004 §3.3) and the graph cache. Pure code.
//!
//! A static QNN graph bakes in its tensors' quantization scales, so one Q·K graph cannot serve
//! heads whose scales differ by several times. Offline, the mean scales `⟨λ̄q, λ̄k⟩` are
//! profiled; Leap then keeps graphs for the grid `⟨λ̄q·σ^i, λ̄k·σ^j⟩`, `i, j ∈ -r..=r` (the
//! paper's default: step σ = 0.5 and r = 1, nine buckets). Online, each head's
//! `⟨λq, λk⟩` picks the bucket with the smallest squared error, and heads that picked the same
//! bucket launch fused in one graph (004 §3.4). Graphs are cached by (op, shape, dtype,
//! bucket).

use std::collections::{BTreeMap, HashMap};

/// A bucket's grid position: `(i, j)` for `⟨λ̄q·σ^i, λ̄k·σ^j⟩`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BucketId {
    pub q: i8,
    pub k: i8,
}

/// The scale buckets around a profiled mean.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScaleBuckets {
    /// Profiled mean query scale `λ̄q`.
    pub mean_q: f32,
    /// Profiled mean key scale `λ̄k`.
    pub mean_k: f32,
    /// The step σ (a factor: 0.5 means the neighbours are ×0.5 and ×2).
    pub step: f32,
    /// Buckets on each side of the mean, per axis.
    pub radius: i8,
}

impl ScaleBuckets {
    /// shadowAttn's default: σ = 0.5, nine buckets.
    pub fn new(mean_q: f32, mean_k: f32) -> ScaleBuckets {
        ScaleBuckets {
            mean_q,
            mean_k,
            step: 0.5,
            radius: 1,
        }
    }

    /// Profile the means from per-head scales `(λq, λk)`.
    pub fn profile(scales: &[(f32, f32)]) -> ScaleBuckets {
        let n = scales.len().max(1) as f32;
        let (q, k) = scales
            .iter()
            .fold((0f32, 0f32), |(a, b), &(q, k)| (a + q, b + k));
        ScaleBuckets::new(q / n, k / n)
    }

    /// The scales of a bucket.
    pub fn scales(&self, id: BucketId) -> (f32, f32) {
        (
            self.mean_q * self.step.powi(id.q as i32),
            self.mean_k * self.step.powi(id.k as i32),
        )
    }

    /// Every bucket, row by row.
    pub fn all(&self) -> Vec<BucketId> {
        let r = self.radius;
        (-r..=r)
            .flat_map(|q| (-r..=r).map(move |k| BucketId { q, k }))
            .collect()
    }

    /// The bucket whose scales have the smallest squared error to `(λq, λk)` (004 §3.3).
    pub fn pick(&self, q_scale: f32, k_scale: f32) -> BucketId {
        let err = |id: BucketId| {
            let (bq, bk) = self.scales(id);
            ((bq - q_scale) as f64).powi(2) + ((bk - k_scale) as f64).powi(2)
        };
        self.all()
            .into_iter()
            .min_by(|&a, &b| err(a).total_cmp(&err(b)))
            .unwrap_or(BucketId { q: 0, k: 0 })
    }

    /// Heads grouped by the bucket they pick, for fused launches; heads keep their order.
    pub fn group(&self, head_scales: &[(f32, f32)]) -> BTreeMap<BucketId, Vec<usize>> {
        let mut groups: BTreeMap<BucketId, Vec<usize>> = BTreeMap::new();
        for (h, &(q, k)) in head_scales.iter().enumerate() {
            groups.entry(self.pick(q, k)).or_default().push(h);
        }
        groups
    }
}

/// What identifies a cached graph.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GraphKey {
    pub op: &'static str,
    pub shape: Vec<u32>,
    pub dtype: &'static str,
    pub bucket: Option<BucketId>,
}

impl GraphKey {
    /// A name usable as a QNN graph name and a file name.
    pub fn name(&self) -> String {
        let shape: Vec<String> = self.shape.iter().map(|d| d.to_string()).collect();
        let mut name = format!("{}_{}_{}", self.op, shape.join("x"), self.dtype);
        if let Some(b) = self.bucket {
            name += &format!("_b{}_{}", b.q, b.k);
        }
        name.replace('-', "m")
    }
}

/// Finalized graphs by key; a miss builds through the caller's closure.
pub struct GraphCache<G> {
    graphs: HashMap<GraphKey, G>,
    pub hits: usize,
    pub misses: usize,
}

impl<G> Default for GraphCache<G> {
    fn default() -> Self {
        GraphCache {
            graphs: HashMap::new(),
            hits: 0,
            misses: 0,
        }
    }
}

impl<G> GraphCache<G> {
    /// The graph for `key`, built with `build` on a miss.
    ///
    /// # Errors
    /// Whatever `build` returns; nothing is cached then.
    pub fn get_or_build<E>(
        &mut self,
        key: GraphKey,
        build: impl FnOnce(&GraphKey) -> Result<G, E>,
    ) -> Result<&G, E> {
        use std::collections::hash_map::Entry;
        match self.graphs.entry(key) {
            Entry::Occupied(e) => {
                self.hits += 1;
                Ok(e.into_mut())
            }
            Entry::Vacant(e) => {
                let g = build(e.key())?;
                self.misses += 1;
                Ok(e.insert(g))
            }
        }
    }

    /// The keys of the cached graphs.
    pub fn keys(&self) -> impl Iterator<Item = &GraphKey> {
        self.graphs.keys()
    }

    /// The cached graphs.
    pub fn values(&self) -> impl Iterator<Item = &G> {
        self.graphs.values()
    }

    /// Graphs cached.
    pub fn len(&self) -> usize {
        self.graphs.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.graphs.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nine_buckets_around_the_mean() {
        let b = ScaleBuckets::new(0.1, 0.02);
        let all = b.all();
        assert_eq!(all.len(), 9);
        assert_eq!(b.scales(BucketId { q: 0, k: 0 }), (0.1, 0.02));
        assert_eq!(b.scales(BucketId { q: 1, k: -1 }), (0.05, 0.04));
    }

    #[test]
    fn pick_takes_the_smallest_error() {
        let b = ScaleBuckets::new(0.1, 0.02);
        assert_eq!(b.pick(0.1, 0.02), BucketId { q: 0, k: 0 });
        assert_eq!(b.pick(0.19, 0.011), BucketId { q: -1, k: 1 });
        assert_eq!(b.pick(0.06, 0.02), BucketId { q: 1, k: 0 });
        // Far outside the grid: the nearest edge.
        assert_eq!(b.pick(10.0, 0.0), BucketId { q: -1, k: 1 });
    }

    #[test]
    fn heads_group_by_bucket_and_profile_means() {
        let scales = [(0.1, 0.02), (0.2, 0.02), (0.1, 0.021), (0.05, 0.04)];
        let b = ScaleBuckets::profile(&scales);
        assert!((b.mean_q - 0.1125).abs() < 1e-6);
        let b = ScaleBuckets::new(0.1, 0.02);
        let g = b.group(&scales);
        assert_eq!(g[&BucketId { q: 0, k: 0 }], vec![0, 2]);
        assert_eq!(g[&BucketId { q: -1, k: 0 }], vec![1]);
        assert_eq!(g[&BucketId { q: 1, k: -1 }], vec![3]);
    }

    #[test]
    fn cache_builds_once_per_key() {
        let mut c: GraphCache<String> = GraphCache::default();
        let key = |b| GraphKey {
            op: "qk",
            shape: vec![2, 4, 64, 32],
            dtype: "q8",
            bucket: Some(BucketId { q: b, k: 0 }),
        };
        let mut built = 0;
        for b in [0, 0, -1, 0] {
            let g = c
                .get_or_build::<()>(key(b), |k| {
                    built += 1;
                    Ok(k.name())
                })
                .unwrap();
            assert!(g.starts_with("qk_2x4x64x32_q8_b"));
        }
        assert_eq!((built, c.hits, c.misses, c.len()), (2, 2, 2, 2));
        assert_eq!(key(-1).name(), "qk_2x4x64x32_q8_bm1_0");
        assert!(c.get_or_build::<&str>(key(1), |_| Err("no")).is_err());
        assert_eq!(c.len(), 2);
    }
}
