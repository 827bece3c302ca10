//! `kvtier bench --workload NAME`: request streams synthesised in
//! Mooncake's trace format (one request = arrival time + the ids of its
//! 512-token blocks), for the prefix-cache workloads a policy must serve.
//! The replay chains the ids (`trace::chain`), so a block's key names its
//! whole prefix: the same id after a different prefix is a different block,
//! as in the engines. A request's last, partial block gets a fresh id (its
//! content is never seen again).
//!
//! The models and where their parameters come from are in
//! `docs/benchmarks.md` ("Eviction policies"). Every generator is
//! deterministic for a seed.

use super::trace::{Request, BLOCK_TOKENS};
use crate::measure::BenchResult;

/// The generated workloads, by name.
pub const WORKLOADS: [&str; 3] = ["conversation", "agent", "rag"];

/// SplitMix64: small, fast, and good enough for workload shapes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn range(&mut self, low: u64, high: u64) -> u64 {
        low + self.below(high - low + 1)
    }
    /// Exponential with the given mean.
    fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }
    /// Log-normal with the given median and shape (sigma of the log).
    fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        let (u, v) = (1.0 - self.unit(), self.unit());
        let normal = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
        median * (sigma * normal).exp()
    }
}

/// Zipf(s) over `n` items: rank 0 is the most popular.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, s: f64) -> Zipf {
        let mut cdf = Vec::with_capacity(n);
        let mut total = 0.0;
        for rank in 1..=n {
            total += 1.0 / (rank as f64).powf(s);
            cdf.push(total);
        }
        for c in &mut cdf {
            *c /= total;
        }
        Zipf { cdf }
    }
    fn sample(&self, rng: &mut Rng) -> usize {
        let u = rng.unit();
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1)
    }
}

/// Hands out block ids; ids of shared content are fixed up front.
struct Ids(u64);

impl Ids {
    fn fresh(&mut self) -> u64 {
        self.0 += 1;
        self.0
    }
    fn many(&mut self, n: u64) -> Vec<u64> {
        (0..n).map(|_| self.fresh()).collect()
    }
}

/// A prompt that grows by appending tokens: full blocks keep their ids.
struct Context {
    blocks: Vec<u64>,
    /// Tokens in the partial block after `blocks`.
    tail: u64,
}

impl Context {
    fn new(shared: &[u64]) -> Context {
        Context {
            blocks: shared.to_vec(),
            tail: 0,
        }
    }
    fn append(&mut self, tokens: u64, ids: &mut Ids) {
        let total = self.tail + tokens;
        for _ in 0..total / BLOCK_TOKENS {
            self.blocks.push(ids.fresh());
        }
        self.tail = total % BLOCK_TOKENS;
    }
    /// The request's block ids: the full blocks, then the partial one.
    fn request(&self, at_ms: f64, ids: &mut Ids) -> Request {
        let mut hash_ids = self.blocks.clone();
        if self.tail > 0 {
            hash_ids.push(ids.fresh());
        }
        Request {
            timestamp: at_ms.max(0.0) as u64,
            hash_ids,
        }
    }
}

pub fn generate(name: &str, requests: usize, seed: u64) -> BenchResult<Vec<Request>> {
    let mut rng = Rng(seed ^ 0x6B76_7469_6572);
    let mut out = match name {
        "conversation" => conversation(&mut rng, requests),
        "agent" => agent(&mut rng, requests),
        "rag" => rag(&mut rng, requests),
        other => {
            return Err(format!(
                "unknown workload {other:?}: the workloads are {}",
                WORKLOADS.join(", ")
            )
            .into())
        }
    };
    out.sort_by_key(|r| r.timestamp);
    out.truncate(requests);
    Ok(out)
}

/// Multi-turn chat: sessions arrive at random; each turn's prompt is the
/// previous prompt plus the model's answer plus the next user message.
/// Turns per session are geometric (mean 5), think times log-normal with a
/// heavy tail (median 60 s, sigma 1.5: a tenth of the gaps exceed 7 min),
/// so thousands of sessions are open at once and contexts return after
/// long gaps. A few system prompts are shared by all sessions.
fn conversation(rng: &mut Rng, requests: usize) -> Vec<Request> {
    let mut ids = Ids(0);
    let systems: Vec<Vec<u64>> = (0..8).map(|i| ids.many(1 + i % 3)).collect();
    let system_pick = Zipf::new(systems.len(), 1.0);
    let mut out = Vec::with_capacity(requests + 64);
    // A session starts about every 0.37 s, so about 2,000 are open at once.
    let mut start = 0.0;
    while out.len() < requests {
        start += rng.exp(370.0);
        let mut at = start;
        let mut context = Context::new(&systems[system_pick.sample(rng)]);
        context.append(rng.lognormal(600.0, 0.8) as u64, &mut ids);
        loop {
            out.push(context.request(at, &mut ids));
            if rng.unit() < 0.2 {
                break;
            }
            let answer = rng.lognormal(400.0, 0.7) as u64;
            let user = rng.lognormal(250.0, 1.0) as u64;
            context.append(answer + user, &mut ids);
            at += rng.lognormal(60_000.0, 1.5);
        }
    }
    out
}

/// Tool-using agents: a task runs a loop of steps on one of a few tool
/// sets, whose long system prompt and tool descriptions (8-24 blocks) are
/// shared by every task using them; each step appends a tool's output and
/// the model's next action, seconds after the previous step.
fn agent(rng: &mut Rng, requests: usize) -> Vec<Request> {
    let mut ids = Ids(0);
    let toolsets: Vec<Vec<u64>> = (0..6).map(|_| ids.many(rng.range(8, 24))).collect();
    let toolset_pick = Zipf::new(toolsets.len(), 1.2);
    let mut out = Vec::with_capacity(requests + 64);
    let mut at = 0.0;
    while out.len() < requests {
        at += rng.exp(600.0);
        let mut step_at = at;
        let mut context = Context::new(&toolsets[toolset_pick.sample(rng)]);
        context.append(rng.lognormal(300.0, 0.8) as u64, &mut ids);
        for _ in 0..rng.range(3, 20) {
            out.push(context.request(step_at, &mut ids));
            let tool_output = rng.lognormal(800.0, 1.0) as u64;
            let action = rng.lognormal(150.0, 0.5) as u64;
            context.append(tool_output + action, &mut ids);
            step_at += rng.lognormal(3_000.0, 0.8);
        }
    }
    out
}

/// Few-shot and retrieval-augmented prompts: one of a handful of hot
/// instruction templates (Zipf 1.1), then two retrieved document chunks
/// from a corpus with Zipf(0.9) popularity, then a one-off question.
/// Documents after different templates or in a different order are
/// different prefixes, as they are for the engines.
fn rag(rng: &mut Rng, requests: usize) -> Vec<Request> {
    let mut ids = Ids(0);
    let templates: Vec<Vec<u64>> = (0..16).map(|_| ids.many(rng.range(2, 8))).collect();
    let template_pick = Zipf::new(templates.len(), 1.1);
    let documents: Vec<Vec<u64>> = (0..20_000).map(|_| ids.many(rng.range(1, 4))).collect();
    let document_pick = Zipf::new(documents.len(), 0.9);
    let mut out = Vec::with_capacity(requests);
    let mut at = 0.0;
    for _ in 0..requests {
        at += rng.exp(100.0);
        let mut context = Context::new(&templates[template_pick.sample(rng)]);
        for _ in 0..2 {
            context
                .blocks
                .extend_from_slice(&documents[document_pick.sample(rng)]);
        }
        context.append(rng.lognormal(200.0, 0.8) as u64, &mut ids);
        out.push(context.request(at, &mut ids));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn workloads_are_deterministic_and_shaped_as_described() {
        for name in WORKLOADS {
            let a = generate(name, 5_000, 1).unwrap();
            let b = generate(name, 5_000, 1).unwrap();
            let c = generate(name, 5_000, 2).unwrap();
            assert_eq!(a.len(), 5_000, "{name}");
            let ids = |r: &[Request]| r.iter().map(|q| q.hash_ids.clone()).collect::<Vec<_>>();
            assert_eq!(ids(&a), ids(&b), "{name}: not deterministic");
            assert_ne!(ids(&a), ids(&c), "{name}: the seed does nothing");
            assert!(a.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
            // Some prefix reuse, not all: a policy has something to decide.
            let mut seen = HashSet::new();
            let (mut reused, mut total) = (0usize, 0usize);
            for r in &a {
                total += r.hash_ids.len();
                reused += r
                    .hash_ids
                    .iter()
                    .take_while(|id| seen.contains(*id))
                    .count();
                seen.extend(r.hash_ids.iter().copied());
            }
            let share = reused as f64 / total as f64;
            assert!((0.2..0.95).contains(&share), "{name}: reuse {share}");
        }
        // Conversations extend the previous turn's prompt.
        let turns = generate("conversation", 2_000, 3).unwrap();
        let extended = turns
            .iter()
            .filter(|r| {
                turns.iter().any(|p| {
                    p.timestamp < r.timestamp
                        && p.hash_ids.len() >= 2
                        && r.hash_ids.starts_with(&p.hash_ids[..p.hash_ids.len() - 1])
                        && r.hash_ids.len() > p.hash_ids.len() - 1
                        && p.hash_ids[0] == r.hash_ids[0]
                        && p.hash_ids.len() > 2
                })
            })
            .count();
        assert!(extended > 500, "{extended} turns extend an earlier prompt");
    }
}
