//! MoE dispatch and combine across nodes: the plan, on the CPU (issue 16, in progress). What the
//! node-spanning kernels will follow, and what their tests compare against:
//!
//! - [`NodeMap`]: which node each rank is on and its index there (every node holds the same
//!   number of ranks, as DeepEP's internode mode requires).
//! - [`HighThroughputPlan`]: DeepEP's hierarchical high-throughput routing. A token crosses the
//!   network once per destination node, to the rank of the same local index there, which
//!   forwards it over NVLink to the ranks of its node that hold any of its experts; the combine
//!   reduces inside the node first and sends one partial row per (token, node) back.
//! - [`LowLatencyPlan`]: DeepEP's internode low-latency routing. Each selected (token, rank) pair
//!   is one message straight to that rank's per-expert slots, over NVLink where the rank shares
//!   the node and over RDMA otherwise; a count per (expert, source rank) follows the data.
//! - [`Admission`]: receiver-driven admission. A receiver grants buffer slots (clear-to-send
//!   credits, as NCCL's receiver-posted FIFO does) before senders write, so an incast of many
//!   senders onto one rank never overruns a buffer smaller than the worst case.
//! - [`WireModel`]: what a plan puts on the wire (WQEs and bytes per token for each posting mode)
//!   and the time that takes on a NIC of a given rate.
//!
//! The kernels are not written yet: `MoeDispatcher` and `MoeLowLatency` still refuse ranks on
//! other nodes.

use crate::error::{Error, Result};

/// Which node each rank is on, and its index inside the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeMap {
    node_of: Vec<usize>,
    local_of: Vec<usize>,
    ranks_per_node: usize,
}

impl NodeMap {
    /// From each rank's node id (the communicator's `node_ids`; any values, equal for ranks of
    /// one node). Nodes are numbered by first appearance; every node must hold as many ranks.
    pub fn new(node_ids: &[u64]) -> Result<NodeMap> {
        let mut ids: Vec<u64> = Vec::new();
        let mut node_of = Vec::with_capacity(node_ids.len());
        let mut local_of = Vec::with_capacity(node_ids.len());
        let mut sizes: Vec<usize> = Vec::new();
        for id in node_ids {
            let n = match ids.iter().position(|x| x == id) {
                Some(n) => n,
                None => {
                    ids.push(*id);
                    sizes.push(0);
                    ids.len() - 1
                }
            };
            node_of.push(n);
            local_of.push(sizes[n]);
            sizes[n] += 1;
        }
        let ranks_per_node = sizes.first().copied().unwrap_or(0);
        if let Some((n, s)) = sizes
            .iter()
            .enumerate()
            .find(|(_, s)| **s != ranks_per_node)
        {
            return Err(Error::invalid(
                "nodes",
                format!(
                    "node {n} holds {s} ranks, node 0 holds {ranks_per_node}: MoE across nodes \
                     needs the same number of ranks on every node"
                ),
            ));
        }
        Ok(NodeMap {
            node_of,
            local_of,
            ranks_per_node,
        })
    }

    /// Nodes of `nodes` x `per_node` consecutive ranks.
    pub fn uniform(nodes: usize, per_node: usize) -> NodeMap {
        let ids: Vec<u64> = (0..nodes * per_node)
            .map(|r| (r / per_node) as u64)
            .collect();
        NodeMap::new(&ids).expect("uniform nodes")
    }

    /// Ranks in the job.
    pub fn world(&self) -> usize {
        self.node_of.len()
    }

    /// Nodes in the job.
    pub fn nodes(&self) -> usize {
        self.node_of
            .len()
            .checked_div(self.ranks_per_node)
            .unwrap_or(0)
    }

    /// Ranks on each node.
    pub fn ranks_per_node(&self) -> usize {
        self.ranks_per_node
    }

    /// The node of `rank`.
    pub fn node(&self, rank: usize) -> usize {
        self.node_of[rank]
    }

    /// The index of `rank` inside its node.
    pub fn local(&self, rank: usize) -> usize {
        self.local_of[rank]
    }

    /// The rank with local index `local` on `node` (none past the last node or local index).
    pub fn rank(&self, node: usize, local: usize) -> Option<usize> {
        (0..self.world()).find(|&r| self.node_of[r] == node && self.local_of[r] == local)
    }
}

/// For each token of `topk_idx` (`[T, topk]`, -1: no expert), the ranks holding any of its
/// experts, ascending, each once.
pub fn ranks_of_tokens(topk_idx: &[i32], topk: usize, experts_per_rank: usize) -> Vec<Vec<usize>> {
    topk_idx
        .chunks(topk)
        .map(|ids| {
            let mut ranks: Vec<usize> = ids
                .iter()
                .filter(|&&e| e >= 0)
                .map(|&e| e as usize / experts_per_rank)
                .collect();
            ranks.sort_unstable();
            ranks.dedup();
            ranks
        })
        .collect()
}

/// One rank's high-throughput dispatch across nodes, hierarchical as DeepEP's internode mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HighThroughputPlan {
    /// Tokens this rank sends to each node over the network (its own node: none), in token order:
    /// they land on the rank of this rank's local index there.
    pub to_node: Vec<Vec<usize>>,
    /// Tokens this rank sends over NVLink to each rank of its own node (itself included: the rows
    /// it keeps), in token order.
    pub to_local: Vec<Vec<usize>>,
    /// DeepEP's `num_tokens_per_rank`: tokens that reach each rank, whatever the path.
    pub tokens_per_rank: Vec<u32>,
    /// DeepEP's `num_tokens_per_rdma_rank`: tokens that reach each node.
    pub tokens_per_node: Vec<u32>,
    /// DeepEP's `num_tokens_per_expert`: selections of each expert.
    pub tokens_per_expert: Vec<u32>,
}

impl HighThroughputPlan {
    /// The plan of rank `me` for `topk_idx` (`[T, topk]`) with `num_experts` spread evenly over
    /// the ranks of `map`.
    pub fn new(
        map: &NodeMap,
        me: usize,
        topk_idx: &[i32],
        topk: usize,
        num_experts: usize,
    ) -> Result<HighThroughputPlan> {
        let world = map.world();
        if world == 0 || num_experts % world != 0 || topk == 0 || topk_idx.len() % topk != 0 {
            return Err(Error::invalid(
                "MoE plan",
                format!(
                    "{num_experts} experts over {world} ranks, top-{topk}, {} indices",
                    topk_idx.len()
                ),
            ));
        }
        if let Some(&e) = topk_idx
            .iter()
            .find(|&&e| e < -1 || e >= num_experts as i32)
        {
            return Err(Error::invalid(
                "topk_idx",
                format!("expert {e} outside -1..{num_experts}"),
            ));
        }
        let per_rank = num_experts / world;
        let mut plan = HighThroughputPlan {
            to_node: vec![Vec::new(); map.nodes()],
            to_local: vec![Vec::new(); map.ranks_per_node()],
            tokens_per_rank: vec![0; world],
            tokens_per_node: vec![0; map.nodes()],
            tokens_per_expert: vec![0; num_experts],
        };
        for &e in topk_idx.iter().filter(|&&e| e >= 0) {
            plan.tokens_per_expert[e as usize] += 1;
        }
        let home = map.node(me);
        for (t, ranks) in ranks_of_tokens(topk_idx, topk, per_rank).iter().enumerate() {
            let mut nodes: Vec<usize> = ranks.iter().map(|&r| map.node(r)).collect();
            nodes.sort_unstable();
            nodes.dedup();
            for &r in ranks {
                plan.tokens_per_rank[r] += 1;
                if map.node(r) == home {
                    plan.to_local[map.local(r)].push(t);
                }
            }
            for n in nodes {
                plan.tokens_per_node[n] += 1;
                if n != home {
                    plan.to_node[n].push(t);
                }
            }
        }
        Ok(plan)
    }

    /// Rows this rank puts on the network (each at most once per destination node).
    pub fn network_rows(&self) -> usize {
        self.to_node.iter().map(Vec::len).sum()
    }
}

/// What the rank of local index `local` on `node` forwards over NVLink, having received from
/// every node's rank of the same local index: for each rank of its node, (source rank, token)
/// pairs in source-rank then token order. `plans[r]` is rank `r`'s [`HighThroughputPlan`];
/// `ranks_of[r]` rank `r`'s [`ranks_of_tokens`].
pub fn forwards(
    map: &NodeMap,
    node: usize,
    local: usize,
    plans: &[HighThroughputPlan],
    ranks_of: &[Vec<Vec<usize>>],
) -> Vec<Vec<(usize, usize)>> {
    let mut out = vec![Vec::new(); map.ranks_per_node()];
    for src_node in (0..map.nodes()).filter(|&n| n != node) {
        let Some(src) = map.rank(src_node, local) else {
            continue;
        };
        for &t in &plans[src].to_node[node] {
            for &r in &ranks_of[src][t] {
                if map.node(r) == node {
                    out[map.local(r)].push((src, t));
                }
            }
        }
    }
    out
}

/// One rank's low-latency dispatch across nodes: one message per selected (token, rank).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LowLatencyPlan {
    /// Messages to ranks of this rank's node (NVLink stores).
    pub nvlink_messages: usize,
    /// Messages to ranks of other nodes (RDMA WRITEs).
    pub rdma_messages: usize,
    /// Per destination rank, the (local expert, count) pairs this rank's count words carry:
    /// one count word per (expert, this rank) whether or not any row goes there (a zero count
    /// still tells the receiver this rank is done).
    pub counts: Vec<Vec<u32>>,
}

impl LowLatencyPlan {
    /// The plan of rank `me` for `topk_idx` (`[T, topk]`).
    pub fn new(
        map: &NodeMap,
        me: usize,
        topk_idx: &[i32],
        topk: usize,
        num_experts: usize,
    ) -> Result<LowLatencyPlan> {
        let world = map.world();
        if world == 0 || num_experts % world != 0 || topk == 0 || topk_idx.len() % topk != 0 {
            return Err(Error::invalid(
                "MoE plan",
                format!("{num_experts} experts over {world} ranks, top-{topk}"),
            ));
        }
        let per_rank = num_experts / world;
        let mut plan = LowLatencyPlan {
            nvlink_messages: 0,
            rdma_messages: 0,
            counts: vec![vec![0; per_rank]; world],
        };
        for (t, ranks) in ranks_of_tokens(topk_idx, topk, per_rank).iter().enumerate() {
            for &r in ranks {
                if map.node(r) == map.node(me) {
                    plan.nvlink_messages += 1;
                } else {
                    plan.rdma_messages += 1;
                }
            }
            for &e in topk_idx[t * topk..(t + 1) * topk]
                .iter()
                .filter(|&&e| e >= 0)
            {
                let e = e as usize;
                plan.counts[e / per_rank][e % per_rank] += 1;
            }
        }
        Ok(plan)
    }

    /// Count words this rank writes to ranks of other nodes (one per remote rank's expert).
    pub fn remote_count_words(&self, map: &NodeMap, me: usize) -> usize {
        (0..map.world())
            .filter(|&r| map.node(r) != map.node(me))
            .map(|r| self.counts[r].len())
            .sum()
    }
}

/// A grant of [`Admission`]: sender `sender` may write its chunk `seq` into slot `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// The sender.
    pub sender: usize,
    /// The sender's chunk index (0, 1, ...).
    pub seq: u64,
    /// The receive buffer slot it goes to.
    pub slot: usize,
}

/// Receiver-driven admission for one receiver: a buffer of `slots` chunk slots shared by every
/// sender, handed out as clear-to-send grants (round robin over the senders that still have
/// chunks, so an incast shares the buffer fairly); a slot is granted again only after the
/// receiver consumed what was written there. Senders publish what they wrote; the receiver
/// consumes each sender's chunks in order. The GPU protocol keeps these as monotonic counters in
/// memory both sides reach (grants in the sender's memory, written counts in the receiver's).
#[derive(Debug, Clone)]
pub struct Admission {
    /// Chunks each sender has to send (known from the count exchange; high-throughput mode).
    demand: Vec<u64>,
    /// Chunks granted to each sender so far.
    granted: Vec<u64>,
    /// Free slots, in the order they will be granted.
    free: std::collections::VecDeque<usize>,
    /// Slots granted and not yet consumed: (grant, written).
    outstanding: Vec<(Grant, bool)>,
    /// Chunks consumed from each sender.
    consumed: Vec<u64>,
    next_sender: usize,
}

impl Admission {
    /// A receiver with `slots` chunk slots and, per sender, the chunks it will send.
    pub fn new(slots: usize, demand: Vec<u64>) -> Result<Admission> {
        if slots == 0 {
            return Err(Error::invalid("admission", "a receive buffer of 0 slots"));
        }
        let senders = demand.len();
        Ok(Admission {
            demand,
            granted: vec![0; senders],
            free: (0..slots).collect(),
            outstanding: Vec::new(),
            consumed: vec![0; senders],
            next_sender: 0,
        })
    }

    /// Grants every free slot it can, round robin over senders with chunks left.
    pub fn grant(&mut self) -> Vec<Grant> {
        let senders = self.demand.len();
        let mut out = Vec::new();
        while !self.free.is_empty() {
            let Some(s) = (0..senders)
                .map(|i| (self.next_sender + i) % senders)
                .find(|&s| self.granted[s] < self.demand[s])
            else {
                break;
            };
            let slot = self.free.pop_front().expect("checked");
            let g = Grant {
                sender: s,
                seq: self.granted[s],
                slot,
            };
            self.granted[s] += 1;
            self.next_sender = (s + 1) % senders;
            self.outstanding.push((g, false));
            out.push(g);
        }
        out
    }

    /// The sender wrote the chunk of `grant` (an error if it was not granted, or written twice).
    pub fn written(&mut self, grant: Grant) -> Result<()> {
        match self.outstanding.iter_mut().find(|(g, _)| *g == grant) {
            Some((_, w)) if !*w => {
                *w = true;
                Ok(())
            }
            Some(_) => Err(Error::invalid(
                "admission",
                format!("{grant:?} written twice"),
            )),
            None => Err(Error::invalid(
                "admission",
                format!("{grant:?} was never granted: the write would overrun the buffer"),
            )),
        }
    }

    /// Consumes, for each sender, the written chunks that come next in its order; returns them
    /// and frees their slots.
    pub fn consume(&mut self) -> Vec<Grant> {
        let mut out = Vec::new();
        loop {
            let next = self
                .outstanding
                .iter()
                .position(|(g, w)| *w && g.seq == self.consumed[g.sender]);
            let Some(i) = next else { break };
            let (g, _) = self.outstanding.swap_remove(i);
            self.consumed[g.sender] += 1;
            self.free.push_back(g.slot);
            out.push(g);
        }
        out
    }

    /// Whether every sender's chunks were consumed.
    pub fn done(&self) -> bool {
        self.consumed == self.demand
    }

    /// Slots granted and not yet consumed (never more than the buffer holds).
    pub fn in_use(&self) -> usize {
        self.outstanding.len()
    }
}

/// How work requests reach the NIC, for [`WireModel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Posting {
    /// Kernels write WQEs and ring (IBGDA), or a host thread rings (CPU-assisted): same WQEs.
    Gpu,
    /// The proxy turns PortChannel triggers into work requests (mlx5 WQEs or `ibv_post_send`).
    Proxy,
}

/// What a plan puts on the wire, and how long that takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WireModel {
    /// Work requests posted.
    pub wqes: u64,
    /// Bytes on the wire (payload).
    pub bytes: u64,
    /// FIFO triggers the GPU pushes (proxy posting; 0 when the GPU posts).
    pub triggers: u64,
}

impl WireModel {
    /// A low-latency dispatch: one WRITE per RDMA message of `row_bytes` (the row plus its
    /// metadata: FP8 scales, source token), then per remote (expert, source) count word an
    /// 8-byte atomic; with the proxy, one trigger per WRITE and one per count.
    pub fn low_latency(
        plan: &LowLatencyPlan,
        count_words: usize,
        row_bytes: u64,
        posting: Posting,
    ) -> WireModel {
        let rows = plan.rdma_messages as u64;
        let counts = count_words as u64;
        WireModel {
            wqes: rows + counts,
            bytes: rows * row_bytes + counts * 8,
            triggers: match posting {
                Posting::Gpu => 0,
                Posting::Proxy => rows + counts,
            },
        }
    }

    /// A high-throughput dispatch: one WRITE per network row (rows grouped per destination node
    /// in chunks of `chunk_rows`, one WRITE per chunk) plus one 8-byte tail update per chunk.
    pub fn high_throughput(
        plan: &HighThroughputPlan,
        row_bytes: u64,
        chunk_rows: u64,
    ) -> WireModel {
        let chunks: u64 = plan
            .to_node
            .iter()
            .map(|t| (t.len() as u64).div_ceil(chunk_rows.max(1)))
            .sum();
        let rows = plan.network_rows() as u64;
        WireModel {
            wqes: 2 * chunks,
            bytes: rows * row_bytes + chunks * 8,
            triggers: 0,
        }
    }

    /// Microseconds the bytes take on a NIC of `gbit_per_s` at `efficiency` of line rate (the
    /// payload share after headers and protocol), plus `latency_us` once.
    pub fn wire_us(&self, gbit_per_s: f64, efficiency: f64, latency_us: f64) -> f64 {
        latency_us + self.bytes as f64 * 8.0 / (gbit_per_s * 1e3 * efficiency)
    }
}
